"""fla GDN prewarm with stub fla modules and fake Triton kernels (CPU)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

import longtrain.prewarm as prewarm
from longtrain.prewarm.fla_gdn import _l2norm_bucket_seq_len
from tests.prewarm import fakes


@pytest.fixture
def cpu_device(monkeypatch):
    """Drive the CUDA-only entry points on CPU: the resolver hands back the CPU device (late-bound lookup)."""
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))


@pytest.fixture
def gdn_op(monkeypatch):
    op = fakes.GDNOpStub()
    fakes.install_modules(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": op}})
    return op


# ---------------------------------------------------------------------------------------------- discovery


def test_protocol_matches_on_presence_only():
    gdn = fakes.ToyGDN()
    assert isinstance(gdn, prewarm._GDNAttention)
    plain = types.SimpleNamespace(num_v_heads=None, head_k_dim="x", head_v_dim=1, chunk_gated_delta_rule=object())
    assert isinstance(plain, prewarm._GDNAttention)  # values are not type-checked; None still counts
    for attr in ("num_v_heads", "head_k_dim", "head_v_dim", "chunk_gated_delta_rule"):
        other = fakes.ToyGDN()
        delattr(other, attr)
        assert not isinstance(other, prewarm._GDNAttention), attr


def test_collect_shapes_dedupes_first_name_wins_and_keeps_order():
    model = fakes.ToyModel()
    extra = nn.Sequential(fakes.ToyGDN(2, 8, 8, dtype=torch.bfloat16), fakes.ToyGDN(6, 64, 64, dtype=torch.float16))
    shapes = prewarm._collect_gdn_autotune_shapes([model, extra])
    assert list(shapes.items()) == [
        ((4, 16, 32, torch.float32), "layers.0"),
        ((2, 8, 8, torch.bfloat16), "layers.2"),
        ((6, 64, 64, torch.float16), "1"),
    ]


def test_collect_shapes_dtype_rules():
    class NoParams(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_v_heads, self.head_k_dim, self.head_v_dim = 3, 8, 8
            self.chunk_gated_delta_rule = None

    class IntOnly(NoParams):
        def __init__(self):
            super().__init__()
            self.num_v_heads = 5
            self.idx = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

    explicit = fakes.ToyGDN(7, 8, 8)
    explicit.prewarm_dtype = torch.bfloat16  # autocast training: fp32 parameters, bf16 kernels
    shapes = prewarm._collect_gdn_autotune_shapes([nn.ModuleList([NoParams(), IntOnly(), explicit])])
    assert list(shapes) == [(3, 8, 8, torch.bfloat16), (5, 8, 8, torch.bfloat16), (7, 8, 8, torch.bfloat16)]


def test_collect_shapes_uses_fsdp_mixed_precision_param_dtype():
    class FakeFSDPState:
        _mp_policy = types.SimpleNamespace(param_dtype=torch.bfloat16)

    block = nn.Sequential(fakes.ToyGDN(4, 16, 16))  # stored parameters are fp32 master weights
    block._get_fsdp_state = lambda: FakeFSDPState()
    root = nn.Sequential(block, fakes.ToyGDN(4, 16, 16, dtype=torch.float32))
    shapes = prewarm._collect_gdn_autotune_shapes([root])
    assert list(shapes.items()) == [((4, 16, 16, torch.bfloat16), "0.0"), ((4, 16, 16, torch.float32), "1")]


def test_collect_shapes_int_conversion_error_propagates():
    bad = fakes.ToyGDN()
    bad.num_v_heads = "many"
    with pytest.raises(ValueError):
        prewarm._collect_gdn_autotune_shapes([bad])


# ---------------------------------------------------------------------------------------------- kernel signatures


def test_kernel_accepts_unwraps_autotuner_and_heuristics(caplog):
    outer, jit = fakes.wrapped(fakes.chunk_cp_bwd_kernel_dh, heuristics=("USE_G",))
    assert outer.fn.fn is jit  # two .fn hops
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        assert prewarm._triton_kernel_accepts(outer, prewarm._FLA_CP_BWD_DH_KERNEL_ARGS, "dh")
        assert prewarm._triton_kernel_accepts(jit, frozenset({"q", "HV"}), "dh")
    assert not caplog.records


def test_kernel_accepts_rejects_missing_names_sorted(caplog):
    outer, _ = fakes.wrapped(fakes.chunk_cp_bwd_kernel_dh)
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        assert not prewarm._triton_kernel_accepts(outer, prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS, "pre_kernel")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "pre_kernel" in record.getMessage() and "['BK1', 'BLOCK_SIZE', 'USE_EXP2']" in record.getMessage()


def test_kernel_accepts_rejects_objects_without_parameter_list(caplog):
    deep = object()
    for _ in range(9):  # deeper than the 8-hop limit
        deep = types.SimpleNamespace(fn=deep)
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        assert not prewarm._triton_kernel_accepts(object(), frozenset({"q"}), "bare")
        assert not prewarm._triton_kernel_accepts(deep, frozenset({"q"}), "deep")
    assert [r.getMessage() for r in caplog.records] == [
        "Cannot determine the parameter list of fla kernel bare; skipping its prewarm.",
        "Cannot determine the parameter list of fla kernel deep; skipping its prewarm.",
    ]


def test_contract_constants():
    assert len(prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS) == 18
    assert len(prewarm._FLA_MERGE_FWD_BWD_KERNEL_ARGS) == 15
    assert {"h", "ag_hm", "pre_or_post_num_ranks", "rank"} <= prewarm._FLA_MERGE_FWD_BWD_KERNEL_ARGS
    assert {"q", "k", "w", "g", "gk", "do", "dhm", "dv", "cu_seqlens", "scale"} <= (
        prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS
    )
    # The contracts match the real parameter lists (the fakes copy them) minus heuristics/autotune names.
    for fn, contract in (
        (fakes.pre_process_bwd_kernel_merged, prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS),
        (fakes.merge_fwd_bwd_kernel, prewarm._FLA_MERGE_FWD_BWD_KERNEL_ARGS),
        (fakes.chunk_cp_bwd_kernel_dh, prewarm._FLA_CP_BWD_DH_KERNEL_ARGS),
        (fakes.chunk_cp_fwd_bwd_kernel_merge, prewarm._FLA_CP_MERGE_KERNEL_ARGS),
    ):
        assert contract <= set(fakes.FakeJIT(fn).arg_names)


# ---------------------------------------------------------------------------------------------- CP kernels

SHAPES = {(4, 16, 32, torch.float32): "layers.0", (2, 128, 64, torch.bfloat16): "layers.2"}


def _install_cp(monkeypatch, layout: str, **override):
    fakes.install_fake_triton(monkeypatch)
    if layout == "0.4.2":
        pre, pre_jit, merge, merge_jit = fakes.fla_v042_kernels()
        mods = {"fla.ops.cp.chunk_delta_h": {"pre_process_bwd_kernel_merged": pre, "merge_fwd_bwd_kernel": merge}}
    else:
        pre, pre_jit, merge, merge_jit = fakes.fla_v060_kernels()
        mods = {
            "fla.ops.cp.chunk_bwd": {"chunk_cp_bwd_kernel_dh": pre},
            "fla.ops.cp.chunk_merge": {"chunk_cp_fwd_bwd_kernel_merge": merge},
        }
    for module, attrs in override.items():
        mods[module] = attrs
    fakes.install_modules(monkeypatch, mods)
    return pre_jit, merge_jit


def test_cp_kernels_fla_042_launch_contract(monkeypatch):
    pre_jit, merge_jit = _install_cp(monkeypatch, "0.4.2")
    prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert len(pre_jit.launches) == 2 and len(merge_jit.launches) == 4
    grid, kw = pre_jit.launches[1]  # H=2, K=128, V=64: BLOCK_SIZE 64
    assert grid == (1 + 2, 2)
    assert set(kw) == prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS
    assert (kw["BLOCK_SIZE"], kw["BK1"], kw["BT"], kw["T"], kw["USE_EXP2"], kw["gk"]) == (64, 128, 64, 64, False, None)
    assert kw["q"].shape == (1, 64, 2, 128) and kw["q"].dtype == torch.bfloat16
    assert kw["dhm"].shape == (2, 128, 192) and kw["dhm"].dtype == torch.float32
    assert kw["cu_seqlens"].tolist() == [0, 64] and kw["cu_seqlens"].dtype == torch.int64
    first = [kw for _, kw in merge_jit.launches[:2]]
    assert [(k["FORWARD"], k["rank"]) for k in first] == [(False, 0), (True, 1)]
    assert set(first[0]) == prewarm._FLA_MERGE_FWD_BWD_KERNEL_ARGS
    assert first[0]["ag_hm"].shape == (8, 16, 48) and first[0]["pre_or_post_num_ranks"] == 1
    grid = merge_jit.launches[0][0]
    assert grid({"BV": 16}) == (2, 4)


def test_cp_kernels_fla_060_launch_contract(monkeypatch):
    pre_jit, merge_jit = _install_cp(monkeypatch, "0.6.0")
    prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert len(pre_jit.launches) == 2 and len(merge_jit.launches) == 4
    grid, kw = pre_jit.launches[0]  # H=4, K=16, V=32: BV 32
    assert grid == (1 + 1, 4)
    assert set(kw) == prewarm._FLA_CP_BWD_DH_KERNEL_ARGS
    assert (kw["H"], kw["HV"], kw["BV"], kw["BK"], kw["BT"], kw["USE_BG"]) == (4, 4, 32, 16, 64, False)
    assert kw["g"].dtype == torch.float32 and kw["cu_seqlens"].dtype == torch.int32
    assert kw["scale"] == pytest.approx(16**-0.5)
    kws = [kw for _, kw in merge_jit.launches[:2]]
    assert [(k["FORWARD"], k["rank"], k["num_ranks"]) for k in kws] == [(False, 0, 1), (True, 1, 1)]
    assert set(kws[0]) == prewarm._FLA_CP_MERGE_KERNEL_ARGS
    assert kws[0]["ag_hm"].shape == (2, 4, 16, 48) and kws[0]["IS_INTRACARD"] is False


def test_cp_kernels_signature_drift_launches_nothing(monkeypatch, caplog):
    # fla 0.5.x-like: the 0.4.2 module exists but its kernels renamed H -> HV and dropped USE_EXP2.
    def drifted_pre(q, k, w, g, gk, do, dhm, dv, cu_seqlens, scale, T, H, HV, K, V, BT, BK1, BLOCK_SIZE): ...
    def drifted_merge(h, ag_hm, pre_or_post_num_ranks, rank, seq_offsets, init_offsets, h0_seq_ids, h0,
                      HV, K, V, BK, FORWARD, INTRACARD_MODE, NUM_SEQ_ENTRIES): ...  # fmt: skip

    pre, pre_jit = fakes.wrapped(drifted_pre)
    merge, merge_jit = fakes.wrapped(drifted_merge)
    fakes.install_fake_triton(monkeypatch)
    fakes.install_modules(
        monkeypatch,
        {"fla.ops.cp.chunk_delta_h": {"pre_process_bwd_kernel_merged": pre, "merge_fwd_bwd_kernel": merge}},
    )
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert pre_jit.launches == [] and merge_jit.launches == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "pre_process_bwd_kernel_merged" in warnings[0] and "['USE_EXP2']" in warnings[0]
    assert "merge_fwd_bwd_kernel" in warnings[1] and "['H']" in warnings[1]


def test_cp_kernels_required_parameter_drift_launches_nothing(monkeypatch, caplog):
    # The contract's names are all there, but the kernel grew a required parameter the launch does not pass.
    def grown(q, k, w, g, gk, do, dhm, dv, cu_seqlens, scale, T, H, HV, K, V, BT, BV, BK, USE_BG, NEW_FLAG): ...

    dh, dh_jit = fakes.wrapped(grown)
    _, merge_jit = _install_cp(monkeypatch, "0.6.0", **{"fla.ops.cp.chunk_bwd": {"chunk_cp_bwd_kernel_dh": dh}})
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert dh_jit.launches == [] and len(merge_jit.launches) == 4  # the merge kernel is still warmed
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "chunk_cp_bwd_kernel_dh" in warning and "['NEW_FLAG']" in warning


def test_cp_kernels_not_importable_and_missing_merge(monkeypatch, caplog):
    fakes.install_fake_triton(monkeypatch)
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert "fla CP kernels not importable" in caplog.text
    caplog.clear()
    pre, pre_jit, _, _ = fakes.fla_v042_kernels()
    fakes.install_modules(monkeypatch, {"fla.ops.cp.chunk_delta_h": {"pre_process_bwd_kernel_merged": pre}})
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert "merge_fwd_bwd_kernel not present" in caplog.text
    assert len(pre_jit.launches) == 2


def test_cp_kernels_skipped_without_triton(monkeypatch, caplog):
    _install_cp(monkeypatch, "0.6.0")
    monkeypatch.setattr(prewarm, "safe_import", lambda name: (False, None))
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert "not importable" in caplog.text


def test_cp_kernels_one_failing_launch_does_not_stop_the_rest(monkeypatch, caplog):
    pre_jit, merge_jit = _install_cp(monkeypatch, "0.6.0")
    calls = []

    def flaky(grid):
        def launch(**kw):
            calls.append(kw["H"])
            if kw["H"] == 4:
                raise RuntimeError("launch failed")

        return launch

    monkeypatch.setattr(fakes.FakeJIT, "__getitem__", lambda self, grid: flaky(grid) if self is pre_jit else
                        (lambda **kw: self.launches.append((grid, kw))))  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        prewarm._prewarm_fla_gdn_cp_kernels(SHAPES, torch.device("cpu"), 64)
    assert calls == [4, 2] and len(merge_jit.launches) == 4
    assert "fla CP GDN pre-process prewarm failed for layers.0; continuing." in caplog.text
    assert caplog.records[0].exc_info is not None


# ---------------------------------------------------------------------------------------------- end to end


def test_end_to_end_dense_and_packed_calls(gdn_op):
    ran = prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 64, batch_size=3)
    assert ran
    assert len(gdn_op.calls) == 6  # per shape: dense, packed (int64), packed (int32)
    dense, packed, packed32 = gdn_op.calls[:3]
    assert dense["q"] == (3, 64, 4, 16) and dense["v"] == (3, 64, 4, 32) and dense["g"] == (3, 64, 4)
    assert dense["cu_seqlens"] is None
    assert packed["q"] == (1, 64, 4, 16) and packed["cu_seqlens"] == ([0, 64], torch.int64)
    assert packed32["cu_seqlens"] == ([0, 64], torch.int32)
    assert dense["dtypes"] == (torch.float32, torch.float32, torch.float32, torch.float32, torch.float32)
    assert gdn_op.calls[3]["dtypes"] == (torch.bfloat16,) * 3 + (torch.float32, torch.bfloat16)
    for call in gdn_op.calls:
        assert call["use_qk_l2norm_in_kernel"] is True and call["kwargs"] == {}
        assert call["grad_enabled"] and call["requires_grad"]


def test_end_to_end_runs_backward_under_no_grad_and_is_rng_neutral(gdn_op):
    before = fakes.rng_state()
    with torch.no_grad():
        assert prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 16)
    assert torch.equal(before, fakes.rng_state())
    assert all(call["grad_enabled"] for call in gdn_op.calls)


def test_end_to_end_failing_mode_is_isolated_and_rng_still_restored(monkeypatch, caplog):
    op = fakes.GDNOpStub(fail_on=lambda call: call["cu_seqlens"] is None)
    fakes.install_modules(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": op}})
    before = fakes.rng_state()
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        assert prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 16)
    assert torch.equal(before, fakes.rng_state())
    assert len(op.calls) == 6
    assert caplog.text.count("fla GDN dense end-to-end prewarm failed for") == 2

    always = fakes.GDNOpStub(fail_on=lambda call: True)
    fakes.install_modules(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": always}})
    assert not prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 16)
    assert torch.equal(before, fakes.rng_state())


def test_end_to_end_without_fla(caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert not prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 16)
    assert "Skipping fla GDN end-to-end prewarm: fla is not importable." in caplog.text


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_end_to_end_rejects_bad_batch_size(gdn_op, bad):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        prewarm._prewarm_fla_gdn_end_to_end(SHAPES, torch.device("cpu"), 16, batch_size=bad)


# ---------------------------------------------------------------------------------------------- the worker


def test_autotune_on_cpu_skips_with_reason(caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_fla_gdn_autotune([fakes.ToyModel()], "cpu") is False
        assert prewarm._prewarm_fla_gdn_autotune([fakes.ToyModel()], None) is False
        assert prewarm._prewarm_fla_gdn_autotune([fakes.ToyModel()], 0) is False
    assert "Skipping fla GDN autotune prewarm: device=cpu cuda_available=False" in caplog.text
    assert "Skipping fla GDN autotune prewarm: no device assigned." in caplog.text
    assert "Skipping fla GDN autotune prewarm: device=cuda:0 cuda_available=" in caplog.text


def test_autotune_full_flow_with_late_bound_parts(monkeypatch, cpu_device, gdn_op, caplog):
    pre_jit, merge_jit = _install_cp(monkeypatch, "0.6.0")
    seen = []
    real_e2e = prewarm._prewarm_fla_gdn_end_to_end
    monkeypatch.setattr(
        prewarm, "_prewarm_fla_gdn_end_to_end", lambda *a, **kw: seen.append((a, kw)) or real_e2e(*a, **kw)
    )
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_fla_gdn_autotune([fakes.ToyModel()], "cuda:0", batch_size=2) is True
    assert len(pre_jit.launches) == 2 and len(merge_jit.launches) == 4  # both shapes, CP kernels
    assert len(gdn_op.calls) == 6 and gdn_op.calls[0]["q"][0] == 2
    (args, kwargs) = seen[0]
    assert args[2:] == (64, 2)
    assert "Prewarming fla GDN autotune caches for 2 unique shape(s)" in caplog.text


def test_autotune_cp_failure_does_not_skip_end_to_end(monkeypatch, cpu_device, gdn_op, caplog):
    def boom(*args):
        raise MemoryError("CP allocation")

    monkeypatch.setattr(prewarm, "_prewarm_fla_gdn_cp_kernels", boom)
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        assert prewarm._prewarm_fla_gdn_autotune([fakes.ToyModel()], "cuda")
    assert "fla CP GDN kernel prewarm failed" in caplog.text and len(gdn_op.calls) == 6


def test_autotune_no_gdn_modules_warns(cpu_device, caplog):
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        assert prewarm._prewarm_fla_gdn_autotune([nn.Linear(2, 2)], "cuda") is False
    assert "no gated-delta-net modules were found" in caplog.text


# ---------------------------------------------------------------------------------------------- l2norm bucket


@pytest.mark.parametrize(
    ("heads", "batch", "seq_len", "expected"),
    [(16, 1, 4096, None), (16, 1, 4097, 4097), (16, 1, 32768, 28673), (16, 2, 32768, 30721), (1, 1, 65537, 65537)],
)
def test_l2norm_bucket_len_lands_in_the_training_bucket(heads, batch, seq_len, expected):
    got = _l2norm_bucket_seq_len(heads, batch, seq_len)
    assert got == expected
    if got is not None:
        rows_per_bucket = 2048 * 32
        train_bucket = -(-batch * seq_len * heads // rows_per_bucket)
        assert -(-batch * got * heads // rows_per_bucket) == train_bucket
        assert -(-batch * (got - 1) * heads // rows_per_bucket) == train_bucket - 1  # the shortest such T


def test_l2norm_bucket_worker(cpu_device, gdn_op):
    model = nn.Sequential(fakes.ToyGDN(16, 16, 16))
    assert prewarm._prewarm_fla_gdn_l2norm_bucket([model], "cuda", 1, 8192)
    (call,) = gdn_op.calls
    assert call["q"] == (1, 4097, 16, 16) and call["cu_seqlens"] is None
    gdn_op.calls.clear()
    assert not prewarm._prewarm_fla_gdn_l2norm_bucket([model], "cuda", 1, 4096)  # bucket 1: nothing to do
    assert gdn_op.calls == []


def test_contracts_against_real_triton_wrappers(triton_interpret):
    """Real ``triton.heuristics(triton.autotune(triton.jit(...)))`` objects with fla 0.6.0's parameter lists:
    every wrapper carries ``arg_names`` and the required-parameter check sees through all of them."""
    import triton
    import triton.language as tl

    from longtrain.prewarm.fla_cp import _kernel_launchable

    def decorate(fn, heuristics, autotuned):
        configs = [triton.Config(dict.fromkeys(autotuned, bv), num_warps=2) for bv in (32, 64)]
        inner = triton.autotune(configs=configs, key=["K"])(triton.jit(fn))
        return triton.heuristics({name: (lambda args: False) for name in heuristics})(inner)

    def dh(q, k, w, g, gk, do, dhm, dv, cu_seqlens, scale, T, H: tl.constexpr, HV: tl.constexpr,
           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
           USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_BG: tl.constexpr, IS_VARLEN: tl.constexpr):  # fmt: skip
        pass

    def merge(h, ag_hm, num_ranks, rank, seq_offsets, init_offsets, h0_seq_ids, h0, h_seq_idx,
              HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
              FORWARD: tl.constexpr, IS_INTRACARD: tl.constexpr, N, USE_INITIAL_STATE: tl.constexpr,
              USE_H_SEQ_IDX: tl.constexpr, STATE_V_FIRST: tl.constexpr = False,
              NUM_RANKS_ON_DEVICE: tl.constexpr = False):  # fmt: skip
        pass

    def merge_grown(h, ag_hm, num_ranks, rank, seq_offsets, init_offsets, h0_seq_ids, h0, h_seq_idx,
                    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                    FORWARD: tl.constexpr, IS_INTRACARD: tl.constexpr, N, USE_INITIAL_STATE: tl.constexpr,
                    USE_H_SEQ_IDX: tl.constexpr, STATE_V_FIRST: tl.constexpr, NUM_RANKS_ON_DEVICE: tl.constexpr,
                    CHUNK_OFFSETS: tl.constexpr):  # fmt: skip
        pass

    dh_kernel = decorate(dh, ("USE_G", "USE_GK", "IS_VARLEN"), ())
    merge_kernel = decorate(merge, ("USE_INITIAL_STATE", "USE_H_SEQ_IDX"), ("BV",))
    assert _kernel_launchable(dh_kernel, prewarm._FLA_CP_BWD_DH_KERNEL_ARGS, "chunk_cp_bwd_kernel_dh")
    assert _kernel_launchable(merge_kernel, prewarm._FLA_CP_MERGE_KERNEL_ARGS, "chunk_cp_fwd_bwd_kernel_merge")
    assert not _kernel_launchable(dh_kernel, prewarm._FLA_PRE_PROCESS_BWD_KERNEL_ARGS, "pre")  # 0.4.2 contract
    grown = decorate(merge_grown, ("USE_INITIAL_STATE", "USE_H_SEQ_IDX"), ("BV",))
    assert not _kernel_launchable(grown, prewarm._FLA_CP_MERGE_KERNEL_ARGS, "grown")


def test_collect_shapes_dtype_ignores_small_fp32_parameters_registered_first():
    """A GDN layer's own fp32 ``A_log`` comes before its bf16 projections in ``parameters()``: the kernels see bf16."""
    layer = fakes.ToyGDN(4, 16, 16, dtype=torch.bfloat16)
    layer.A_log = nn.Parameter(torch.zeros(4, dtype=torch.float32))
    assert next(layer.parameters()).dtype == torch.float32  # the trap
    assert list(prewarm._collect_gdn_autotune_shapes([layer])) == [(4, 16, 16, torch.bfloat16)]
