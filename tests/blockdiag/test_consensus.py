"""Ranks agree or all fail together (gloo, bounded): ranks that disagree on the ids, the length, the dtype or a knob
all raise the same ``CPMismatchError`` before any collective of the step; a rank that never arrives makes every
waiting rank raise ``CPTimeoutError`` naming it within ``step_timeout_s``; a kernel failing on one rank ends the same
way on every rank for every exchange; knobs and the check's cost per layer."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from longtrain.blockdiag_cp import (
    CPMismatchError,
    CPStepError,
    CPTimeoutError,
    build_cp_step,
    configure_cp_varlen,
    cp_varlen_attention,
    state,
)
from tests._dist import GlooWorld
from tests.blockdiag import _cp_model as cm

pytestmark = pytest.mark.dist

IDS = torch.tensor([1] * 9 + [2] * 11 + [3] * 8 + [0] * 8)


def _attend(rank, world, ids, dtype=torch.float32, exchange=None):
    step = build_cp_step(ids, cm.FakeMesh(world, rank, dist.group.WORLD), kv_exchange=exchange)
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(step.local_len, 4, 8, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(step.local_len, 2, 8, generator=gen, dtype=dtype, requires_grad=True)
    out = cp_varlen_attention(q, k, k, step)
    out.sum().backward()
    return out


def _scenario_worker(rank, world, scenario):
    ids = IDS.clone()
    dtype, exchange = torch.float32, None
    if scenario == "ids" and rank == world - 1:
        ids[9] = 1  # document 1 one token longer on this rank only
    if scenario == "length" and rank == world - 1:
        ids = torch.cat([ids, ids.new_zeros(world)])
    if scenario == "dtype" and rank == 0:
        dtype = torch.float64
    if scenario == "exchange":
        exchange = "halo" if rank == 0 else "allgather"
    try:
        with cm.count_collectives() as counts:
            _attend(rank, world, ids, dtype, exchange)
        return ("ok", dict(counts))
    except CPMismatchError as exc:
        return ("mismatch", str(exc), dict(counts))


@pytest.mark.parametrize("scenario, field", [("ids", "document layout"), ("length", "document layout"),
                                             ("dtype", "dtype"), ("exchange", "kv_exchange")])  # fmt: skip
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_disagreeing_ranks_all_raise_the_same_error(gloo, world, scenario, field):
    results = gloo(_scenario_worker, world, scenario, timeout=60)
    assert all(r[0] == "mismatch" for r in results), results
    assert len({r[1] for r in results}) == 1, "every rank raises the same message"
    assert field in results[0][1] and "ranks [" in results[0][1]
    assert all(r[2] == {} for r in results), "no collective of the step was issued"


def _bad_arguments_worker(rank, world, scenario):
    """The last rank's first attention call of the step fails its own argument checks; the others' are fine."""
    from longtrain.blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    previous = configure_cp_varlen(step_timeout_s=20)  # a bound, so that a regression fails instead of hanging
    start = time.monotonic()
    try:
        with cm.count_collectives() as counts:
            bad = rank == world - 1
            if scenario == "sdpa_shape":  # the SDPA drop-in's own shard check
                batch = {"input_ids": torch.zeros(1, IDS.numel(), dtype=torch.int64), "_packed_seq_ids": IDS[None]}
                ctx, _, layout = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
                rows = layout.padded_seq_len // world - int(bad)
                with ctx():
                    cp_blockdiag_sdpa(*(torch.randn(1, 2, rows, 8) for _ in range(3)))
            else:
                step = build_cp_step(IDS, dist.group.WORLD)
                rows, heads = step.local_len - int(bad and scenario == "rows"), 3 if bad and scenario == "heads" else 4
                q, k = torch.randn(rows, heads, 8), torch.randn(rows, 2, 8)
                cp_varlen_attention(q, k, k, step, dropout_p=1.0 if bad and scenario == "dropout" else 0.0)
        return ("ok", "", dict(counts), time.monotonic() - start)
    except Exception as exc:
        return (type(exc).__name__, str(exc), dict(counts), time.monotonic() - start)
    finally:
        configure_cp_varlen(**previous)


@pytest.mark.parametrize("scenario", ["rows", "heads", "dropout", "sdpa_shape"])
def test_a_rank_failing_its_argument_checks_is_named_on_every_rank_at_once(gloo, scenario):
    """Before, the failing rank raised its ValueError and the others waited for it in the step's check until
    ``step_timeout_s`` (a CPTimeoutError) or, without the knob, the store's timeout (30 minutes by default)."""
    *good, bad = gloo(_bad_arguments_worker, 3, scenario, timeout=60)
    assert bad[0] == "ValueError", bad
    for kind, message, counts, waited in good:
        assert kind == "CPMismatchError" and "argument checks" in message and "ranks [2]: failed" in message, message
        assert counts == {} and waited < 10.0, (counts, waited)  # no collective; no wait for the bound


def _dropout_worker(rank, world):
    """Dropout on one rank only, with a provider that has no dropout (cudnn, fa4, te, flex on a GPU; simulated here)
    and a needed-only exchange: that rank would all-gather (the dense fallback keeps dropout) while the others run
    the preflight all-reduce, and gloo failed after the process group's timeout."""
    from dataclasses import replace

    from longtrain.blockdiag_cp import providers

    real = providers.PROVIDERS["reference"]
    providers.PROVIDERS["reference"] = replace(real, dropout=False)
    try:
        step = build_cp_step(IDS, dist.group.WORLD, kv_exchange="a2a", attn_backend="reference")
        q, k = torch.randn(step.local_len, 4, 8), torch.randn(step.local_len, 2, 8)
        with cm.count_collectives() as counts:
            cp_varlen_attention(q, k, k, step, dropout_p=0.1 if rank == 0 else 0.0)
        return ("ok", "", dict(counts))
    except CPMismatchError as exc:
        return ("mismatch", str(exc), dict(counts))
    finally:
        providers.PROVIDERS["reference"] = real


def test_ranks_that_disagree_on_dropout_raise_the_same_error(gloo):
    results = gloo(_dropout_worker, 2, timeout=60)
    assert all(r[0] == "mismatch" and "attention dropout" in r[1] and r[2] == {} for r in results), results
    assert len({r[1] for r in results}) == 1


def _nodes_worker(rank, world):
    """Ranks whose environments answer "does the CP group span nodes" differently (LOCAL_WORLD_SIZE 1 on rank 0, 2
    on rank 1): rank 0 would all-gather while rank 1 runs the needed-only preflight all-reduce."""
    import os

    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == 0 else "2"
    step = build_cp_step(IDS, dist.group.WORLD, kv_exchange="a2a", attn_backend="reference")
    q, k = torch.randn(step.local_len, 4, 8), torch.randn(step.local_len, 2, 8)
    try:
        with cm.count_collectives() as counts:
            cp_varlen_attention(q, k, k, step)
        return ("ok", "", dict(counts))
    except CPMismatchError as exc:
        return ("mismatch", str(exc), dict(counts))
    finally:  # the harness's worker processes run the next tests
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


def test_ranks_whose_environments_disagree_on_spanning_nodes_raise_the_same_error(gloo):
    results = gloo(_nodes_worker, 2, timeout=60)
    assert all(r[0] == "mismatch" and "CP group spans nodes" in r[1] and r[2] == {} for r in results), results
    assert len({r[1] for r in results}) == 1


def _agree_worker(rank, world):
    with cm.count_collectives() as counts:
        for _ in range(3):  # three steps; each step's check is one store exchange, no torch.distributed collective
            _attend(rank, world, IDS)
    return dict(counts)


def test_agreeing_ranks_pay_one_store_exchange_per_step(gloo):
    for counts in gloo(_agree_worker, 2, timeout=60):
        assert counts == {"all_gather": 3, "reduce_scatter": 3}


def _absent_worker(rank, world, bound):
    previous = configure_cp_varlen(step_timeout_s=bound)
    try:
        if rank == 1:  # fails before the step, stays alive
            time.sleep(bound + 2.0)
            return ("absent", None)
        start = time.monotonic()
        try:
            _attend(rank, world, IDS)
        except CPTimeoutError as exc:
            return ("timeout", str(exc), time.monotonic() - start)
        return ("ok", None)
    finally:
        configure_cp_varlen(**previous)


def test_a_rank_that_never_arrives_is_named_within_the_bound():
    pool = GlooWorld(2)  # a pool of its own: the ranks end this test out of step
    try:
        results = pool.run(_absent_worker, 1.5, timeout=60)
    finally:
        pool.close(kill=True)
    status, message, waited = results[0]
    assert status == "timeout" and "CP ranks [1] of 2 did not reach the step check" in message
    assert 1.4 <= waited < 10.0


def _kernel_failure_worker(rank, world):
    from dataclasses import replace

    from longtrain.blockdiag_cp import providers

    real = providers.PROVIDERS["reference"]

    def flaky(*args, **kwargs):
        if rank == 0:
            raise RuntimeError("kernel failed on rank 0")
        return real.attention(*args, **kwargs)

    providers.PROVIDERS["reference"] = replace(real, attention=flaky)
    out = {}
    try:
        for mode in ("allgather", "halo", "a2a"):
            try:
                _attend(rank, world, IDS, exchange=mode)
                out[mode] = "ok"
            except CPStepError as exc:
                out[mode] = f"CPStepError: {exc}"
    finally:
        providers.PROVIDERS["reference"] = real
    return out


def test_a_kernel_failing_on_one_rank_ends_alike_everywhere(gloo):
    results = gloo(_kernel_failure_worker, 2, timeout=60)
    assert [r["allgather"] for r in results] == ["ok", "ok"]  # the all-gather path falls back to dense per rank
    for mode in ("halo", "a2a"):
        assert all(r[mode].startswith("CPStepError") for r in results) and len({r[mode] for r in results}) == 1


def test_step_timeout_knob():
    previous = configure_cp_varlen(step_timeout_s=5)
    try:
        assert state.step_timeout_s() == 5.0 and state.cp_varlen_runtime_config()["step_timeout_s"] == 5.0
        for bad in (0, -1, float("nan"), "5", True):
            with pytest.raises(ValueError, match="step_timeout_s"):
                configure_cp_varlen(step_timeout_s=bad)
        assert state.step_timeout_s() == 5.0
    finally:
        configure_cp_varlen(**previous)
    assert "step_timeout_s" not in state.cp_varlen_runtime_config()  # the default shows only the documented keys
