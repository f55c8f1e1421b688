"""Multi-rank parity of the block-diagonal CP runtime on gloo (CPU, fp32, backend auto -> reference).

For W in {2, 3, 4} and every K/V exchange, a q/k/v/o layer run through ``make_cp_blockdiag_batch_and_ctx`` +
``cp_blockdiag_sdpa`` must equal the single-process float64 dense reference in local outputs, input gradients
and all-reduced parameter gradients; the collectives per layer call are counted; activation checkpointing
gives identical gradients; a kernel failing on one rank ends in the same error (needed-only) or the same
correct result (all-gather fallback) on every rank, never a hang. Each world size is one harness call.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tests.blockdiag import _cp_model as cm

pytestmark = pytest.mark.dist

# fp32 against a float64 reference, max-norm relative: a handful of fp32 roundings over <= 130 keys and 16-32
# wide projections stays well below 1e-5.
RTOL = 1e-5
MODES = ("allgather", "halo", "a2a")


def _run_cp(rank, world, name, *, ckpt=None):
    """One CP step of the layer; returns local output rows, gathered grads, collective counts and the path.

    ``ckpt``: None, ``"layer"`` (the whole layer checkpointed) or ``"core"`` (only the attention call, so the
    region ends at the attention output: recompute must still issue the same collectives on every rank).
    """
    from longtrain.blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx, state

    ids, s, ref, params, x, batch = cm.fp32_case(name)
    factory, batch, layout = make_cp_blockdiag_batch_and_ctx(cm.FakeMesh(world, rank, dist.group.WORLD), None, batch)
    local_len = layout.padded_seq_len // world
    off = rank * local_len
    n_in = max(0, min(s, off + local_len) - off)
    g_local = torch.zeros(1, local_len, cm.E)
    g_local[:, :n_in] = ref["g"][:, off : off + n_in].float()

    def core(q, k, v, is_causal=False):
        return checkpoint(cp_blockdiag_sdpa, q, k, v, use_reentrant=False)

    def layer(inp, *ps):
        return cm.attention_layer(inp, list(ps), core if ckpt == "core" else cp_blockdiag_sdpa)

    with factory():
        step = state._CP_BLOCKDIAG_STATE.get()
        with cm.count_collectives() as counts:
            if ckpt == "layer":
                y = checkpoint(layer, batch["inputs_embeds"], *params, use_reentrant=False)
            else:
                y = layer(batch["inputs_embeds"], *params)
            fwd = dict(counts)
            counts.clear()
            (y * g_local).sum().backward()
            bwd = dict(counts)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in [x, *params]]
    for gr in grads:
        dist.all_reduce(gr)
    paths = [v[0] for key, v in step.cache.items() if key[0] == "path"]  # the memoised exchange decision
    path = None if not paths or paths[0] == "allgather" else paths[0]
    real = ids[off : off + n_in] > 0
    return {
        "y": y.detach()[:, :n_in][:, real],
        "y_ref": ref["y"][:, off : off + n_in][:, real],
        "y_pad_finite": bool(torch.isfinite(y).all()),
        "grads": grads,
        "grads_ref": [ref["x_grad"], *ref["param_grads"]],
        "fwd": fwd,
        "bwd": bwd,
        "path": path,
        "max_halo": 0 if path is None else step.kv_plan.max_halo,
    }


def _expected_counts(mode_path, max_halo):
    if mode_path is None:  # all-gather
        return {"all_gather": 1}, {"reduce_scatter": 1}
    if mode_path == "halo":
        p2p = {"batch_isend_irecv": 1} if max_halo else {}
        return {"all_reduce": 2, **p2p}, dict(p2p)
    return {"all_reduce": 2, "all_to_all_single": 1}, {"all_to_all_single": 1}


def _parity_worker(rank, world):
    """Every case x exchange x {auto, dense} plus checkpointing; returns a list of failure strings."""
    from longtrain.blockdiag_cp import configure_cp_varlen

    failures = []
    for name in cm.CASES:
        for mode, backend in [*((m, "auto") for m in MODES), ("allgather", "dense")]:
            tag = f"W={world} rank={rank} case={name} mode={mode} backend={backend}"
            previous = configure_cp_varlen(attn_backend=backend, kv_exchange=mode)
            try:
                res = _run_cp(rank, world, name)
                res_ck = [_run_cp(rank, world, name, ckpt=c) for c in ("layer", "core")]
            finally:
                configure_cp_varlen(**previous)
            if mode != "allgather" and res["path"] is None:
                failures.append(f"{tag}: needed-only exchange not taken")
            err = cm.rel_err(res["y"], res["y_ref"])
            if err > RTOL:
                failures.append(f"{tag}: output rel err {err:.2e}")
            if not res["y_pad_finite"]:
                failures.append(f"{tag}: non-finite padding rows")
            for i, (got, want) in enumerate(zip(res["grads"], res["grads_ref"])):
                err = cm.rel_err(got, want)
                if err > RTOL:
                    failures.append(f"{tag}: grad[{i}] rel err {err:.2e}")
            fwd, bwd = _expected_counts(res["path"], res["max_halo"])
            if res["fwd"] != fwd or res["bwd"] != bwd:
                failures.append(f"{tag}: collectives fwd={res['fwd']} bwd={res['bwd']}, expected {fwd} / {bwd}")
            for ck, other in zip(("layer", "core"), res_ck):
                for i, (a, b) in enumerate(zip(res["grads"], other["grads"])):
                    if not torch.equal(a, b):
                        failures.append(
                            f"{tag}: {ck}-checkpointed grad[{i}] differs by {float((a - b).abs().max()):.2e}"
                        )
    return failures


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_parity_every_exchange_and_case(gloo, world):
    failures = gloo(_parity_worker, world, timeout=240)
    flat = [f for per_rank in failures for f in per_rank]
    assert not flat, "\n".join(flat[:20])


def _fault_worker(rank, world, bad_rank):
    """The varlen kernel raises on ``bad_rank`` only."""
    from dataclasses import replace

    from longtrain.blockdiag_cp import configure_cp_varlen, providers

    real = providers.PROVIDERS["reference"]

    def flaky(*args, **kwargs):
        if rank == bad_rank:
            raise RuntimeError("injected kernel failure")
        return real.attention(*args, **kwargs)

    out = {}
    providers.PROVIDERS["reference"] = replace(real, attention=flaky)
    try:
        for mode in MODES:
            previous = configure_cp_varlen(kv_exchange=mode)
            try:
                res = _run_cp(rank, world, "straddle_pad")
                out[mode] = (
                    "ok",
                    cm.rel_err(res["y"], res["y_ref"]),
                    [cm.rel_err(a, b) for a, b in zip(res["grads"], res["grads_ref"])],
                )
            except RuntimeError as exc:
                out[mode] = ("raised", str(exc))
            finally:
                configure_cp_varlen(**previous)
    finally:
        providers.PROVIDERS["reference"] = real
    # The group still works after the failure.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_kernel_failure_on_one_rank(gloo, world):
    results = gloo(_fault_worker, world, world - 2, timeout=60)
    for mode in MODES:
        outcomes = [r[mode] for r in results]
        if mode == "allgather":
            # rank-local dense fallback: every rank correct
            for r, o in enumerate(outcomes):
                assert o[0] == "ok", f"rank {r}: {o}"
                assert o[1] <= RTOL and max(o[2]) <= RTOL, f"rank {r}: {o}"
        else:
            assert all(o[0] == "raised" for o in outcomes), outcomes
            assert len({o[1] for o in outcomes}) == 1, outcomes
            assert "failed on at least one CP rank" in outcomes[0][1]
    assert [r["after"] for r in results] == [float(world)] * world


def _preflight_and_emulation_worker(rank, world):
    """(a) one rank reports its backend unavailable -> every rank takes all-gather; (b) the gloo fallbacks of
    reduce_scatter / uneven all_to_all_single give the same results."""
    from longtrain.blockdiag_cp import configure_cp_varlen, exchange, providers

    out = {}
    real_reason = providers.unavailable_reason
    providers.unavailable_reason = lambda *a, **k: "injected" if rank == 0 else real_reason(*a, **k)
    previous = configure_cp_varlen(kv_exchange="a2a")
    try:
        res = _run_cp(rank, world, "one_doc")
        out["preflight"] = (res["path"], res["fwd"], cm.rel_err(res["y"], res["y_ref"]))
    finally:
        providers.unavailable_reason = real_reason
        configure_cp_varlen(**previous)

    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support this collective")

    real = {n: getattr(dist, n) for n in ("reduce_scatter", "all_to_all_single")}
    for n in real:
        setattr(dist, n, unsupported)
    try:
        for mode in ("allgather", "a2a"):
            previous = configure_cp_varlen(kv_exchange=mode)
            try:
                res = _run_cp(rank, world, "one_doc")
            finally:
                configure_cp_varlen(**previous)
            errs = [cm.rel_err(res["y"], res["y_ref"])] + [
                cm.rel_err(a, b) for a, b in zip(res["grads"], res["grads_ref"])
            ]
            out[mode] = (max(errs), res["bwd"])
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
        exchange._EMULATED.clear()
    return out


def test_preflight_consensus_and_collective_emulation(gloo):
    world = 3
    results = gloo(_preflight_and_emulation_worker, world, timeout=60)
    for r, res in enumerate(results):
        path, fwd, err = res["preflight"]
        assert path is None and fwd == {"all_gather": 1, "all_reduce": 1}, (r, res["preflight"])
        assert err <= RTOL
        assert res["allgather"][0] <= RTOL and res["allgather"][1] == {"reduce_scatter": 1, "all_reduce": 1}
        assert res["a2a"][0] <= RTOL, (r, res["a2a"])
