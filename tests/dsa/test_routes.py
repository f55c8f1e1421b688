"""``backend="auto"``: the measured route table drives the choice per op and direction, doctor prints it, and every
call is validated once.

The machine is faked through the probes of :mod:`longtrain.dsa.routes` (what is installed, the SM); the cuDNN
kernels are the fakes of ``test_cudnn_dsa.py``. The real mixed route runs in tests/gpu/test_dsa_cudnn_gpu.py.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

import pytest
import torch

from longtrain import cli
from longtrain.dsa import cudnn_dsa as cd
from longtrain.dsa import ops, routes
from longtrain.dsa import reference as ref
from longtrain.dsa.metadata import prepare_dsa_metadata
from tests.dsa.test_cudnn_dsa import FakeFlashMLA, _assert_bf16_close, _reference_grads, _sparse_inputs, fakes  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def glm_call(**changes):
    shape = dict(routes.GLM52_SPARSE_MLA)
    shape.update(changes)
    return routes.CallShape("sparse_mla", CPU, **shape)


def glm_indexer(**changes):
    shape = dict(routes.GLM52_INDEXER)
    shape.update(changes)
    return routes.CallShape("indexer_topk", CPU, **shape)


@pytest.fixture
def machine(monkeypatch):
    """``machine(triton=..., cudnn=..., flash_mla=..., major=9)``: which routes the probes report present."""

    def setup(triton=True, cudnn=True, flash_mla=False, major=9):
        monkeypatch.setattr(routes, "triton_absent", lambda device: None if triton else "no triton here")
        monkeypatch.setattr(routes, "cudnn_absent", lambda device: None if cudnn else "no cudnn here")
        monkeypatch.setattr(routes, "flash_mla_absent", lambda device: None if flash_mla else "no flash_mla here")
        monkeypatch.setattr(routes, "device_major", lambda device: major)

    return setup


# --------------------------------------------------------------------------------------------- the table


def test_every_op_and_direction_has_rows_fastest_first_and_ends_on_torch():
    for key in (("sparse_mla", "fwd"), ("sparse_mla", "bwd"), ("indexer_topk", "fwd")):
        rows = routes.rows_for(*key)
        assert rows[-1].route == "torch", key
        measured = [r.tflops for r in rows if r.tflops is not None]
        assert measured == sorted(measured, reverse=True), f"{key}: measured rows must stay fastest first"
        assert len({r.route for r in rows}) == len(rows), key
    assert {(r.op, r.direction) for r in routes.ROUTE_TABLE} == {
        ("sparse_mla", "fwd"),
        ("sparse_mla", "bwd"),
        ("indexer_topk", "fwd"),
    }
    for bwd, fwds in routes.FOLLOWS.items():
        assert bwd in {r.route for r in routes.rows_for("sparse_mla", "bwd")}
        assert set(fwds) <= {r.route for r in routes.rows_for("sparse_mla", "fwd")}


def test_every_figure_names_a_committed_report_and_unmeasured_rows_say_why():
    for row in routes.ROUTE_TABLE:
        if row.tflops is None:
            assert row.sm == "-" and row.figure == "not measured" and len(row.source) > 40, row
            continue
        assert row.sm == "90", row
        report = REPO / row.source.split(" ")[0]
        assert report.is_file(), f"{row.route} {row.direction}: {report} is not in the repository"
        # The figure is the report's own number, as the report prints it.
        assert f"{row.tflops:g}" in report.read_text(), row


# --------------------------------------------------------------------------------------------- the choice


def test_cudnn_present_and_fitting_runs_our_forward_and_cudnns_backward(machine):
    machine(triton=True, cudnn=True)
    plan = routes.auto_plan(glm_call())
    assert (plan.fwd, plan.bwd) == ("triton", "cudnn")
    assert plan.fwd_row == routes.rows_for("sparse_mla", "fwd")[0]
    assert plan.bwd_row == routes.rows_for("sparse_mla", "bwd")[0] and plan.major == 9
    # FlashMLA installed too: it has no measurement here, so it stays behind our forward.
    machine(triton=True, cudnn=True, flash_mla=True)
    assert routes.auto_plan(glm_call())[:2] == ("triton", "cudnn")
    # Without Triton, FlashMLA's forward is the next row the cuDNN backward can follow.
    machine(triton=False, cudnn=True, flash_mla=True)
    assert routes.auto_plan(glm_call())[:2] == ("flash_mla", "cudnn")


@pytest.mark.parametrize(
    "changes",
    [
        dict(dtype=torch.float16),
        dict(dtype=torch.float32),
        dict(d_v=448),
        dict(has_sink=True),
        dict(width=512, d_v=512),
        dict(heads=48),
        dict(topk=4096),
    ],
    ids=["fp16", "fp32", "d_v448", "sink", "D_qk512", "heads48", "K4096"],
)
def test_cudnn_present_but_call_does_not_fit_runs_triton_both_ways(machine, changes):
    machine(triton=True, cudnn=True, flash_mla=True)
    assert routes.route_unfit("cudnn", glm_call(**changes), 9) is not None
    assert routes.auto_plan(glm_call(**changes))[:2] == ("triton", "triton")


def test_head_rule_follows_the_sm_generation(machine):
    machine(triton=True, cudnn=True, major=9)
    assert routes.auto_plan(glm_call(heads=192))[:2] == ("triton", "cudnn")  # SM90: multiples of 64
    machine(triton=True, cudnn=True, major=10)
    assert routes.auto_plan(glm_call(heads=192))[:2] == ("triton", "triton")  # SM100: 192 does not pad


def test_no_triton_and_no_cudnn_is_torch(machine):
    machine(triton=False, cudnn=False, flash_mla=False)
    assert routes.auto_plan(glm_call())[:2] == ("torch", "torch")
    # cuDNN alone has no forward to follow: the backward falls to torch with its forward.
    machine(triton=False, cudnn=True, flash_mla=False)
    assert routes.auto_plan(glm_call())[:2] == ("torch", "torch")
    # fp64 does not fit our kernels either.
    machine(triton=True, cudnn=True)
    assert routes.auto_plan(glm_call(dtype=torch.float64))[:2] == ("torch", "torch")


def test_indexer_rows(machine):
    machine(triton=True, cudnn=True)
    plan = routes.auto_plan(glm_indexer())
    assert (plan.fwd, plan.bwd) == ("triton", None) and plan.fwd_row.tflops is not None
    machine(triton=False, cudnn=True)
    assert routes.auto_plan(glm_indexer()).fwd == "cudnn"
    assert routes.auto_plan(glm_indexer(heads=16)).fwd == "torch"
    assert routes.auto_plan(glm_indexer(weight_dtype=torch.float64)).fwd == "torch"
    machine(triton=True, cudnn=False)
    assert routes.auto_plan(glm_indexer(key_dtype=torch.float16)).fwd == "torch"  # mixed dtypes: not our kernel


def test_real_probes_on_cpu_pick_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "CUDA only" in routes.triton_absent(CPU)
    assert routes.cudnn_absent(CPU) and routes.flash_mla_absent(CPU)
    assert routes.auto_plan(glm_call())[:2] == ("torch", "torch")
    assert routes.auto_plan(glm_indexer()).fwd == "torch"


# --------------------------------------------------------------------------------------------- doctor


def test_doctor_prints_the_choice_and_its_row(machine, capsys):
    machine(triton=True, cudnn=True)
    rows = dict(ops.backend_status())
    fwd = next(name for name in rows if name.startswith("auto sparse_mla fwd -> "))
    bwd = next(name for name in rows if name.startswith("auto sparse_mla bwd -> "))
    idx = next(name for name in rows if name.startswith("auto indexer_topk -> "))
    assert fwd.startswith("auto sparse_mla fwd -> triton: 492.7 TFLOP/s on SM90 (dsa_mla_34a525d_h200_2026-12-07.md)")
    assert bwd.startswith("auto sparse_mla bwd -> cudnn: 411 TFLOP/s on SM90 (blockdiag_cudnn_bwd_probe_2026-11-29")
    assert idx.startswith("auto indexer_topk -> triton: 286.6 TFLOP/s on SM90 (dsa_indexer_34a525d_h200_2026")
    assert "auto indexer_topk fp8=True -> triton: 3.80 ms against 3.84 ms in bf16" in "\n".join(rows)
    machine(triton=False, cudnn=False)
    assert cli.cmd_doctor(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    fwd_line = next(line for line in out.splitlines() if "auto sparse_mla fwd -> torch" in line)
    assert "9.029 TFLOP/s on SM90 (dsa_2026-11-29.md); rows above it not usable here: triton, flash_mla" in fwd_line
    assert "auto sparse_mla bwd -> torch" in out
    assert "not measured" in next(line for line in out.splitlines() if "auto indexer_topk -> torch" in line)
    assert "auto indexer_topk fp8=True -> torch" in out


# --------------------------------------------------------------------------------------------- dispatch


def test_auto_on_cpu_equals_the_float64_reference():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(9, 3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    kv = torch.randn(11, 1, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.randint(-1, 11, (9, 5), generator=gen)
    lengths = torch.randint(0, 6, (9,), generator=gen)
    out = ops.sparse_mla_attention(q, kv, idx, 0.3, d_v=8, topk_length=lengths)  # backend="auto"
    want = ref.sparse_mla_reference(q, kv, idx, 0.3, d_v=8, topk_length=lengths)[0]
    grad = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    got, exp = torch.autograd.grad(out, (q, kv), grad), torch.autograd.grad(want, (q, kv), grad)
    # float64 against float64: the row chunks only reorder sums.
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    iq, ik = torch.randn(9, 2, 8, dtype=torch.float64, generator=gen), torch.randn(9, 8, dtype=torch.float64)
    w = torch.rand(9, 2, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    meta = prepare_dsa_metadata(cu, 9)
    want_sel = ref.indexer_topk_reference(iq, ik, w, meta.starts, meta.causal_lengths, 3)
    assert torch.equal(ops.indexer_topk(iq, ik, w, cu, 3), want_sel)


def test_auto_mixed_route_runs_our_forward_then_cudnns_backward(fakes, machine, monkeypatch):  # noqa: F811
    from longtrain.dsa.triton import sparse_mla

    machine(triton=True, cudnn=True, flash_mla=True)
    stand_in = FakeFlashMLA()
    monkeypatch.setattr(sparse_mla, "flash_mla_style_fwd", stand_in)
    q, kv, idx = _sparse_inputs()
    out = ops.sparse_mla_attention(q, kv, idx, 0.05)  # backend="auto"
    out.sum().backward()
    assert len(stand_in.calls) == 1 and fakes.fwd.calls == []  # ours, not FlashMLA's
    assert fakes.dsa.calls[-1]["op"] == "backward" and stand_in.calls[0]["heads"] == 64
    assert fakes.operations == []  # the op validated the call; the seed function's checks did not run
    want_out, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.05, None, torch.ones(out.shape))
    _assert_bf16_close(out, want_out)
    _assert_bf16_close(q.grad, want_dq)
    _assert_bf16_close(kv.grad, want_dkv)
    # Without Triton, FlashMLA's forward (the seed's split path) runs instead.
    machine(triton=False, cudnn=True, flash_mla=True)
    ops.sparse_mla_attention(q.detach(), kv.detach(), idx, 0.05)
    assert len(fakes.fwd.calls) == 1 and len(stand_in.calls) == 1


def test_auto_indexer_on_cudnn_reuses_the_ops_metadata(fakes, machine, monkeypatch):  # noqa: F811
    from tests.dsa.test_cudnn_dsa import _bf16_inputs, i32

    machine(triton=False, cudnn=True)

    def checked_twice(*args, **kwargs):
        raise AssertionError("the op validates once: cudnn_indexer_topk's checks must not run")

    monkeypatch.setattr(cd, "_validate_indexer", checked_twice)
    q, keys, w = _bf16_inputs(15, 15, seed=3)
    cu = i32([0, 5, 14, 15])
    out = ops.indexer_topk(q, keys, w, cu, 3)
    want = ops.indexer_topk(q.float(), keys.float(), w, cu, 3, backend="torch")
    assert torch.equal(out, want) and [c["op"] for c in fakes.dsa.calls] == ["scores", "topk"]


def _profile_checks(fn) -> dict[str, int]:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    counts: dict[str, int] = {}
    for (filename, _line, name), (_cc, ncalls, *_rest) in pstats.Stats(prof).stats.items():
        if "longtrain" in filename and ("check" in name or "valid" in name) and "unchecked" not in name:
            counts[name] = counts.get(name, 0) + ncalls
    return counts


@pytest.mark.interpret
def test_each_call_is_validated_once_through_the_triton_kernels(triton_interpret):
    """The real kernels (interpreter, fp32): the op's boundary checks run once, the backend's public checks never."""
    pytest.importorskip("triton")
    cu = torch.tensor([0, 20, 21, 32], dtype=torch.int32)
    q, keys, w = torch.randn(32, 2, 32), torch.randn(32, 32), torch.rand(32, 2)
    counts = _profile_checks(lambda: ops.indexer_topk(q, keys, w, cu, 8, backend="triton"))
    assert counts.get("check_float") == 3, counts  # index_q, index_k, head_weights
    assert "indexer_topk_triton" not in counts
    topk = ops.indexer_topk(q, keys, w, cu, 8, backend="torch")
    query = torch.randn(32, 16, 48, requires_grad=True)
    kv = torch.randn(32, 1, 48, requires_grad=True)
    counts = _profile_checks(lambda: ops.sparse_mla_attention(query, kv, topk, 0.2, d_v=32, backend="triton"))
    assert counts.get("check_float") == 2 and counts.get("_validate_sparse_mla") == 1, counts  # q, kv
    assert "_validate" not in counts, counts  # sparse_mla_triton's own checks
    assert counts.get("check_int") == 1, counts  # topk_indices


# ---------------------------------------------------------------------------- torch.use_deterministic_algorithms


@pytest.fixture
def deterministic_mode():
    """``deterministic_mode(warn_only=False)``: torch's deterministic algorithms on for the test, restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())

    def setup(warn_only=False):
        torch.use_deterministic_algorithms(True, warn_only=warn_only)

    yield setup
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_calls_skip_the_cudnn_backward(machine):
    machine(triton=True, cudnn=True)
    plan = routes.auto_plan(glm_call(deterministic=True))
    assert (plan.fwd, plan.bwd, plan.deterministic) == ("triton", "triton", True)
    assert routes.auto_plan(glm_call())[:2] == ("triton", "cudnn")  # the flag is part of the decision
    unfit = routes.route_unfit("cudnn", glm_call(deterministic=True), 9)
    assert unfit is not None and unfit[0] is RuntimeError and "warn_only=True" in unfit[1]
    machine(triton=False, cudnn=True)
    assert routes.auto_plan(glm_call(deterministic=True))[:2] == ("torch", "torch")


@pytest.mark.interpret
def test_deterministic_mode_runs_the_triton_backward_in_a_fixed_order(triton_interpret, deterministic_mode,
                                                                      monkeypatch):  # fmt: skip
    """Under torch.use_deterministic_algorithms(True), backend="triton" / "auto" ask for the fixed-order dkv."""
    pytest.importorskip("triton")
    import longtrain.dsa.triton as backend

    seen = []
    real = backend.sparse_mla_triton_unchecked

    def spy(*args):
        seen.append(args[7])  # deterministic
        return real(*args)

    monkeypatch.setattr(backend, "sparse_mla_triton_unchecked", spy)
    q = torch.randn(6, 16, 48, requires_grad=True)
    kv = torch.randn(9, 1, 48, requires_grad=True)
    idx = torch.randint(0, 9, (6, 8), dtype=torch.int32)
    ops.sparse_mla_attention(q, kv, idx, 0.2, d_v=32, backend="triton").sum().backward()
    deterministic_mode()
    out = ops.sparse_mla_attention(q, kv, idx, 0.2, d_v=32, backend="triton")
    grads = torch.autograd.grad(out.sum(), (q, kv))
    again = torch.autograd.grad(ops.sparse_mla_attention(q, kv, idx, 0.2, d_v=32, backend="triton").sum(), (q, kv))
    assert seen == [False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_deterministic_mode_refuses_the_named_cudnn_backend(fakes, machine, deterministic_mode):  # noqa: F811
    machine(triton=True, cudnn=True)
    q, kv, idx = _sparse_inputs()
    deterministic_mode()
    with pytest.raises(RuntimeError, match=r"backend='cudnn'.*does not promise bitwise-reproducible.*'triton'"):
        ops.sparse_mla_attention(q, kv, idx, 0.05, backend="cudnn")
    deterministic_mode(warn_only=True)
    with pytest.warns(UserWarning, match="does not promise bitwise-reproducible"):
        ops.sparse_mla_attention(q, kv, idx, 0.05, backend="cudnn")
