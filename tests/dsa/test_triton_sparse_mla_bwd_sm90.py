"""The backward's SM90 probabilities kernel (stacked logits and dO V^T): routing, forced-config validation and offline
compilation for Hopper (it cannot run without an SM90 GPU; its numerics are checked in
tests/gpu/test_dsa_triton_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longtrain.dsa.triton import KernelConfig, SparseMLAConfig
from tests.dsa._sm90_compile import GPU_TRITON, compile_sm90, cuobjdump, gpu_triton_site

pytestmark = pytest.mark.interpret


def _fake_q(H=64, D=576, dtype=torch.bfloat16):
    return SimpleNamespace(shape=(3, H, D), dtype=dtype, device=torch.device("cuda", 0), element_size=lambda: 2)


def test_forced_sm90_backward_refuses_the_interpreter(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 64, 576, generator=g, requires_grad=True)
    kv = torch.randn(8, 1, 576, generator=g, requires_grad=True)
    idx = torch.randint(0, 8, (3, 16), generator=g, dtype=torch.int32)
    cfg = SparseMLAConfig(fwd=KernelConfig(block_k=16, num_warps=4, num_stages=1), bwd=KernelConfig(impl="sm90"))
    out = sparse_mla_triton(q, kv, idx, 0.1, d_v=512, config=cfg)
    with pytest.raises(RuntimeError, match=r"backward KernelConfig\(impl='sm90'\).*interpreter.*impl='triton'"):
        out.sum().backward()


def test_default_backward_never_picks_sm90_off_gpu(triton_interpret):
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_backward_plan

    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    assert sm90_backward_plan(q, 512, None, compute_dkv=True, dkv_forced=False) is None


_FUSED = KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1)


@pytest.mark.parametrize(
    "config,D,d_v,flags,reason,expected",
    [
        (None, 576, 512, "", None, ("fused_ws", 64, 1)),  # the default on SM90: probabilities and dkv in one kernel
        (None, 576, 512, "no-dkv", None, ("ds", 64, 2)),  # no dkv wanted
        (None, 576, 512, "dkv-forced", None, ("ds", 64, 2)),  # a forced dkv config keeps the dkv kernel
        (None, 128, 64, "", None, ("ds", 64, 2)),  # d_v < 128: the [dS; P] tile does not fit the value buffer
        (None, 640, 512, "", None, None),  # a rope tail of 128: neither SM90 kernel fits shared memory
        (None, 576, 512, "", "it needs at least 64 heads", None),  # off the SM90 rules: the portable kernel
        (KernelConfig(), 576, 512, "", None, None),  # impl="triton" forces the portable kernel
        (_FUSED, 576, 512, "", None, ("fused", 64, 1)),
        (_FUSED, 576, 512, "no-dkv", None, ("ds", 64, 2)),
        (_FUSED, 128, 64, "", None, "needs d_v >= 128"),
        (_FUSED, 576, 512, "", "it needs at least 64 heads", "layout='fused'.*at least 64 heads"),
        (KernelConfig(impl="sm90", block_k=32, num_stages=2), 576, 512, "", None, ("ds", 32, 2)),
        (KernelConfig(impl="sm90", block_k=64, num_stages=2), 512, 512, "", None, ("ds", 64, 2)),  # no rope tail
        (KernelConfig(impl="sm90", block_k=16, num_stages=2), 576, 512, "", None, "64 or 32 slots per step"),
        (KernelConfig(impl="sm90", block_k=64, num_stages=3), 576, 512, "", None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90", block_k=32, num_stages=3), 576, 512, "", None, ("ds", 32, 3)),
        (KernelConfig(impl="sm90", block_k=32, num_stages=6), 576, 512, "", None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90"), 576, 512, "", "it needs at least 64 heads", "at least 64 heads.*use impl='triton'"),
    ],
    ids=[
        "default",
        "default-no-dkv",
        "default-dkv-forced",
        "default-dv64",
        "default-rope128",
        "default-heads",
        "triton",
        "fused",
        "fused-no-dkv",
        "fused-dv64",
        "fused-heads",
        "sm90-32",
        "sm90-D512",
        "bad-block",
        "64x3",
        "32x3",
        "32x6",
        "heads",
    ],  # fmt: skip
)
def test_sm90_backward_plan(monkeypatch, config, D, d_v, flags, reason, expected):
    from longtrain.dsa.triton import sparse_mla_bwd_plan as plan
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: reason)
    kwargs = dict(compute_dkv=flags != "no-dkv", dkv_forced=flags == "dkv-forced")
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            plan.sm90_backward_plan(_fake_q(D=D), d_v, config, **kwargs)
    else:
        assert plan.sm90_backward_plan(_fake_q(D=D), d_v, config, **kwargs) == expected


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(layout="fused"), "needs impl='sm90'"),
        (dict(impl="sm90", layout="fused"), "num_stages=1"),  # the default num_stages (2)
        (dict(impl="sm90", layout="fused", block_k=32, num_stages=1), "block_k=64"),
        (dict(impl="sm90", layout="stacked"), "layout='heads'"),
    ],
    ids=["portable", "stages", "block_k", "sm90-stacked"],
)
def test_fused_config_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_fused_backward_config_has_no_dkv_kernel():
    with pytest.raises(ValueError, match="no dkv kernel for bwd_dkv"):
        SparseMLAConfig(bwd=_FUSED, bwd_dkv=KernelConfig())
    with pytest.raises(ValueError, match="backward's probabilities kernel's"):
        SparseMLAConfig(fwd=_FUSED)
    dq = KernelConfig(block_k=32)
    assert SparseMLAConfig(bwd=_FUSED, bwd_dq=dq).backward_configs() == (_FUSED, dq, None)
    assert SparseMLAConfig(bwd=_FUSED).backward_configs() == (_FUSED, None, None)


def test_smem_budget_of_the_kernel():
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ds_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES

    assert sm90_ds_smem_bytes(64, 2, 576, 512, 2) == 2 * 64 * 1152 + 128 * 64 * 2 + 128 * 64 * 4  # 192 KiB
    assert sm90_ds_smem_bytes(32, 3, 576, 512, 2) <= SM90_SMEM_BYTES < sm90_ds_smem_bytes(64, 3, 576, 512, 2)


def test_smem_budget_of_the_fused_kernel():
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ds_dkv_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES

    # [Q; dO 0] (128 x 576) + one tile of 64 gathered rows = 216 KiB; a rope tail of 128 does not fit.
    assert sm90_ds_dkv_smem_bytes(576, 512, 2) == (128 + 64) * 576 * 2 <= SM90_SMEM_BYTES
    assert sm90_ds_dkv_smem_bytes(640, 512, 2) > SM90_SMEM_BYTES


_TYPES = ["*bf16", "*bf16", "*bf16", "*i32", "*i32", "*fp32", "*fp32", "*bf16", "*bf16", "i32", "i32", "i32"]


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize("block_k,num_buf,d_qk", [(64, 2, 576), (32, 3, 576), (64, 2, 512)], ids=["64", "32x3", "D512"])
def test_sm90_ds_kernel_compiles_for_hopper(block_k, num_buf, d_qk):
    """Compiled for sm_90a on this CPU-only machine: cp.async ring + wgmma, shared memory as budgeted."""
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ds_smem_bytes

    consts = dict(H=64, D_V=512, D_R=d_qk - 512, HAS_LEN=True, STORE_P=True, BLOCK_K=block_k, NUM_BUF=num_buf)
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90", "sparse_mla_bwd_sm90_kernel_ds",
                         _TYPES + ["fp32", "fp32"], consts)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["shared"] == sm90_ds_smem_bytes(block_k, num_buf, d_qk, 512, 2), stats


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    "H,d_qk,deterministic", [(64, 576, False), (128, 512, False), (128, 576, True)], ids=["glm", "H128-D512", "det"]
)
def test_sm90_fused_kernel_compiles_for_hopper(H, d_qk, deterministic):
    """The fused probabilities + dkv kernel compiled for sm_90a: shared memory as budgeted (the [dS; P] tile
    reuses the gathered tile's buffer, no compiler scratch), no register spills."""
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ds_dkv_smem_bytes

    types = _TYPES[:8] + ["*fp32", "*fp32"] + _TYPES[9:] + ["fp32", "fp32"]
    consts = dict(H=H, D_V=512, D_R=d_qk - 512, HAS_LEN=True, DETERMINISTIC=deterministic)
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90", "sparse_mla_bwd_sm90_kernel_ds_dkv", types, consts)
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["shared"] == sm90_ds_dkv_smem_bytes(d_qk, 512, 2), stats
    assert stats["local"] == 0, stats


@pytest.mark.parametrize(
    "config,H,D,reason,expected",
    [
        (None, 64, 576, None, (64, 2, 64)),  # the default on SM90
        (None, 128, 576, None, (64, 2, 64)),  # 128 heads: 64 per program too (SM90_DQ_HEADS, measured faster)
        (None, 192, 576, None, (64, 2, 64)),
        (None, 64, 576, "it needs at least 64 heads", None),  # off the SM90 rules: the portable kernel
        (KernelConfig(), 64, 576, None, None),  # impl="triton" forces the portable kernel
        (KernelConfig(impl="sm90", block_k=32, num_stages=4), 64, 576, None, (32, 4, 64)),
        (KernelConfig(impl="sm90", block_k=64, num_stages=3), 64, 576, None, (64, 3, 64)),  # 224 KiB, dS in registers
        (KernelConfig(impl="sm90", block_k=64, num_stages=4), 64, 576, None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90", block_k=16, num_stages=2), 64, 576, None, "64 or 32 slots per step"),
        (KernelConfig(impl="sm90"), 64, 576, "it needs at least 64 heads", r"dq KernelConfig.*64 heads.*impl='triton'"),
        (KernelConfig(impl="sm90", num_stages=3, block_h=128), 128, 576, None, (64, 3, 128)),
        (KernelConfig(impl="sm90", num_stages=4, block_h=128), 256, 576, None, (64, 4, 128)),
        (KernelConfig(impl="sm90", num_stages=6, block_h=128), 128, 576, None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90", block_h=128), 64, 576, None, "block_h=128 needs a multiple of 128 heads, got H=64"),
        (KernelConfig(impl="sm90", block_h=32), 64, 576, None, "64 or 128 heads per program"),
    ],
    ids=[
        "default",
        "default-H128",
        "default-H192",
        "default-heads",
        "triton",
        "32x4",
        "64x3",
        "64x4",
        "bad-block",
        "heads",
        "wide-64x3",
        "wide-H256-64x4",
        "wide-64x6",
        "wide-H64",
        "block_h-32",
    ],  # fmt: skip
)
def test_sm90_dq_plan(monkeypatch, config, H, D, reason, expected):
    from longtrain.dsa.triton import sparse_mla_bwd_plan as plan
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: reason)
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            plan.sm90_dq_plan(_fake_q(H=H, D=D), 512, config)
    else:
        assert plan.sm90_dq_plan(_fake_q(H=H, D=D), 512, config) == expected


def test_sm90_dq_plan_budgets_the_ds_ring_when_it_is_on(monkeypatch):
    """With ``SM90_DQ_DS_SMEM`` each tile's dS rides in the ring: a 64 x 3 ring of 64 heads (224 KiB with dS in
    registers) then needs 240 KiB and is refused."""
    from longtrain.dsa.triton import sparse_mla_bwd_plan as plan
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: None)
    ring = KernelConfig(impl="sm90", block_k=64, num_stages=3)
    assert plan.sm90_dq_plan(_fake_q(H=64), 512, ring) == (64, 3, 64)
    monkeypatch.setattr(plan, "SM90_DQ_DS_SMEM", True)
    with pytest.raises(RuntimeError, match="exceed the 227 KiB"):
        plan.sm90_dq_plan(_fake_q(H=64), 512, ring)


def test_sm90_dq_default_heads_follow_the_module_setting(monkeypatch):
    from longtrain.dsa.triton import sparse_mla_bwd_plan as plan
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: None)
    monkeypatch.setattr(plan, "SM90_DQ_HEADS", 128)
    assert plan.sm90_dq_plan(_fake_q(H=128), 512, None) == (*plan.SM90_DQ_RINGS[128], 128)
    assert plan.sm90_dq_plan(_fake_q(H=192), 512, None) == (64, 2, 64)  # not a multiple of 128


def test_sm90_dq_is_never_picked_off_gpu(triton_interpret):
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_dq_plan

    assert sm90_dq_plan(torch.zeros(1, 64, 576, dtype=torch.bfloat16), 512, None) is None


def test_a_forced_sm90_dq_config_is_accepted():
    dq = KernelConfig(impl="sm90", block_k=32, num_stages=4)
    assert SparseMLAConfig(bwd_dq=dq).backward_configs() == (None, dq, None)
    with pytest.raises(ValueError, match="bwd_dkv: the dkv kernel has one layout"):
        SparseMLAConfig(bwd_dkv=dq)


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    "block_k,num_buf,d_qk,d_v,heads,ds_smem,staged",
    [(64, 2, 576, 512, 64, True, False), (64, 2, 576, 512, 64, False, False), (32, 4, 576, 512, 64, True, False),
     (64, 2, 512, 512, 64, True, False), (64, 4, 576, 512, 128, True, False), (64, 4, 576, 512, 128, False, False),
     (32, 2, 512, 512, 128, True, False), (64, 2, 320, 256, 128, True, False), (64, 2, 576, 512, 64, False, True),
     (32, 4, 576, 512, 64, False, True), (64, 2, 576, 512, 128, False, True), (64, 2, 320, 256, 128, True, True),
     (32, 2, 576, 512, 128, False, True)],
    ids=["64", "64-ds-regs", "32x4", "D512", "wide-64x4", "wide-64x4-ds-regs", "wide-D512-32x2", "wide-dv256",
         "64-ds-regs-staged", "32x4-staged", "wide-staged", "wide-dv256-staged", "wide-32x2-too-small-to-stage"],
)  # fmt: skip
def test_sm90_dq_kernel_compiles_for_hopper(block_k, num_buf, d_qk, d_v, heads, ds_smem, staged):
    """The SM90 dq kernel compiled for sm_90a: cp.async ring + wgmma, shared memory as budgeted, no spills, no
    serialized wgmma; with 128 heads per program each program gathers half of the columns; with ``DS_SMEM`` dS rides
    in the ring, copied 16 bytes at a time; with ``STAGED_STORE`` dq goes out through the ring (no more shared
    memory)."""
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_dq_smem_bytes

    types = ["*bf16", "*i32", "*i32", "*bf16", "*bf16", "i32", "i32", "i32"]
    consts = dict(H=heads, D_V=d_v, D_R=d_qk - d_v, HAS_LEN=True, BLOCK_K=block_k, NUM_BUF=num_buf, HEADS=heads,
                  DS_SMEM=ds_smem, STAGED_STORE=staged)  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90", "sparse_mla_bwd_sm90_kernel_dq", types, consts)
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["shared"] == sm90_dq_smem_bytes(block_k, num_buf, d_qk, 2, heads, ds_smem), stats
    assert stats["local"] == 0, stats
    assert not stats["wgmma_serialized"], stats


_WS = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1)


@pytest.mark.parametrize(
    "default,config,D,d_v,flags,reason,expected",
    [
        ("warp_specialized", None, 576, 512, "", None, ("fused_ws", 64, 1)),
        ("warp_specialized", None, 576, 512, "no-dkv", None, ("ds", 64, 2)),
        ("warp_specialized", None, 576, 512, "dkv-forced", None, ("ds", 64, 2)),
        ("warp_specialized", None, 512, 512, "", None, ("fused_ws", 64, 1)),  # no rope tail
        ("warp_specialized", None, 128, 64, "", None, ("ds", 64, 2)),  # d_v < 128: neither fused kernel
        ("warp_specialized", None, 640, 512, "", None, None),  # a rope tail of 128: nothing SM90 fits
        ("warp_specialized", None, 576, 512, "", "it needs at least 64 heads", None),
        ("fused", None, 576, 512, "", None, ("fused", 64, 1)),  # the other default: the two-warpgroup kernel
        ("fused", _WS, 576, 512, "", None, ("fused_ws", 64, 1)),
        ("fused", _WS, 576, 512, "no-dkv", None, ("ds", 64, 2)),
        ("fused", _WS, 128, 64, "", None, "layout='warp_specialized'.*needs d_v >= 128.*layout='fused'"),
        ("fused", _WS, 640, 512, "", None, "warp-specialized kernel's 2.* bytes .* exceed 227 KiB"),
        ("fused", _WS, 576, 512, "", "it needs at least 64 heads", "warp_specialized'.*at least 64 heads"),
    ],
    ids=[
        "default",
        "no-dkv",
        "dkv-forced",
        "D512",
        "dv64",
        "rope128",
        "heads",
        "other-default",
        "forced",
        "forced-no-dkv",
        "forced-dv64",
        "forced-rope128",
        "forced-heads",
    ],  # fmt: skip
)
def test_sm90_backward_plan_warp_specialized(monkeypatch, default, config, D, d_v, flags, reason, expected):
    from longtrain.dsa.triton import sparse_mla_bwd_plan as plan
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(plan, "interpreting", lambda: False)
    monkeypatch.setattr(plan, "SM90_BWD_DEFAULT", default)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: reason)
    kwargs = dict(compute_dkv=flags != "no-dkv", dkv_forced=flags == "dkv-forced")
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            plan.sm90_backward_plan(_fake_q(D=D), d_v, config, **kwargs)
    else:
        assert plan.sm90_backward_plan(_fake_q(D=D), d_v, config, **kwargs) == expected


def test_forced_warp_specialized_backward_refuses_the_interpreter(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 64, 576, generator=g, requires_grad=True)
    kv = torch.randn(8, 1, 576, generator=g, requires_grad=True)
    idx = torch.randint(0, 8, (3, 16), generator=g, dtype=torch.int32)
    cfg = SparseMLAConfig(fwd=KernelConfig(block_k=16, num_warps=4, num_stages=1), bwd=_WS)
    out = sparse_mla_triton(q, kv, idx, 0.1, d_v=512, config=cfg)
    with pytest.raises(RuntimeError, match=r"layout='warp_specialized'\) cannot run here.*interpreter"):
        out.sum().backward()


def test_smem_budget_of_the_warp_specialized_backward():
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ws_bwd_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_LIMIT

    # [Q_v; dO] 128 KiB, Q_r 8 KiB, one tile of 64 rows 72 KiB, [dS; P] 16 KiB, delta 256 bytes, the scaled fp16
    # pieces' head maxima 1 KiB, barriers.
    assert sm90_ws_bwd_smem_bytes(576, 512, 2) == (128 + 8 + 72 + 16 + 1 + 1) * 1024 + 256 <= SM90_SMEM_LIMIT
    assert sm90_ws_bwd_smem_bytes(640, 512, 2) > SM90_SMEM_LIMIT


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    "H,d_qk,d_v,deterministic,prefetch,staged,run",
    [(64, 576, 512, False, True, False, 1), (64, 576, 512, False, False, False, 1),
     (128, 512, 512, False, True, False, 1), (64, 576, 512, True, True, False, 1),
     (64, 320, 256, False, True, False, 1), (64, 384, 256, False, True, False, 1),
     (64, 576, 512, False, False, True, 1), (96, 320, 256, True, False, True, 1),
     (64, 576, 512, False, False, True, 4), (128, 576, 512, False, False, True, 0),
     (64, 384, 256, True, False, True, 0)],
    ids=["glm", "glm-indices-after-wait", "H128-D512", "det", "dv256", "rope128", "glm-staged-ds", "dv256-det-staged",
         "glm-runs-of-4", "H128-persistent", "rope128-det-persistent"],
)  # fmt: skip
def test_warp_specialized_backward_compiles_for_hopper(H, d_qk, d_v, deterministic, prefetch, staged, run):
    """The warp-specialized fused kernel compiled for sm_90a: cp.async + wgmma, shared memory within the budget (the
    compiler adds nothing of its own beyond it), no spills, no serialized wgmma, the worker partitions' register
    budgets as set."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ws_bwd_smem_bytes

    # q kv dO O idx len lse2 delta dS dkv (dkv's scales), row_offset n_rows T_k K_slots, the two scales
    types = _TYPES[:3] + ["*bf16"] + _TYPES[3:8] + ["*fp32", "*fp32"] + _TYPES[9:] + ["i32", "fp32", "fp32"]
    consts = dict(H=H, D_V=d_v, D_R=d_qk - d_v, HAS_LEN=True, DETERMINISTIC=deterministic, PREFETCH_IDX=prefetch,
                  REGS_PROB=ws.WS_BWD_NUM_REGS[0], REGS_PRODUCER=ws.WS_BWD_NUM_REGS[1], STAGED_DS=staged,
                  RUN=run)  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90_ws", "sparse_mla_bwd_sm90_ws_kernel", types, consts,
                         num_warps=4, maxnreg=ws.WS_BWD_MAXNREG)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"] and not stats["wgmma_serialized"], stats
    assert stats["shared"] <= sm90_ws_bwd_smem_bytes(d_qk, d_v, 2), stats
    assert stats["local"] == 0, stats
    assert set(ws.WS_BWD_NUM_REGS) <= set(stats["setmaxnreg"]), stats


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    "staged,pieces", [(True, "bf16"), (False, "bf16"), (True, "fp16"), (False, "fp16")],
    ids=["staged-ds", "direct-ds", "staged-ds-fp16", "direct-ds-fp16"],
)  # fmt: skip
def test_deterministic_two_byte_pieces_compile_for_hopper(staged, pieces):
    """``DET_PIECES = "bf16"`` / ``"fp16"``: the warp-specialized and the two-warpgroup fused kernels compiled with a
    bf16 piece scratch (each fp32 piece converted as it is stored) or a scaled fp16 one (each row's scale formed and
    stored beside it): within their shared-memory budgets, no spills."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_ds_dkv_smem_bytes, sm90_ws_bwd_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES

    piece, scaled = f"*{pieces}", pieces == "fp16"
    types = _TYPES[:3] + ["*bf16"] + _TYPES[3:8] + [piece, "*fp32"] + _TYPES[9:] + ["i32", "fp32", "fp32"]
    consts = dict(H=64, D_V=512, D_R=64, HAS_LEN=True, DETERMINISTIC=True, PREFETCH_IDX=True, STAGED_DS=staged,
                  REGS_PROB=ws.WS_BWD_NUM_REGS[0], REGS_PRODUCER=ws.WS_BWD_NUM_REGS[1], RUN=1,
                  SCALED=scaled)  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90_ws", "sparse_mla_bwd_sm90_ws_kernel", types, consts,
                         num_warps=4, maxnreg=ws.WS_BWD_MAXNREG)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"] and not stats["wgmma_serialized"], stats
    assert stats["shared"] <= sm90_ws_bwd_smem_bytes(576, 512, 2), stats
    assert stats["local"] == 0, stats
    if staged:
        return
    types = _TYPES[:8] + [piece, "*fp32"] + _TYPES[9:] + ["fp32", "fp32"]
    consts = dict(H=64, D_V=512, D_R=64, HAS_LEN=True, DETERMINISTIC=True, SCALED=scaled)
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90", "sparse_mla_bwd_sm90_kernel_ds_dkv", types, consts)
    assert stats["cp_async"] and stats["wgmma"], stats
    # The scales' row maxima cross the two warpgroups through the compiler's scratch, within the 227 KiB.
    budget = sm90_ds_dkv_smem_bytes(576, 512, 2)
    assert stats["shared"] == budget if not scaled else budget <= stats["shared"] <= SM90_SMEM_BYTES, stats
    assert stats["local"] == 0, stats


@pytest.mark.parametrize(
    "run,head_blocks,deterministic,expected",
    [(None, 1, False, (500, 2)), (None, 2, False, (1000, 1)), (None, 1, True, (1000, 1)), (1, 1, False, (1000, 1)),
     (3, 2, False, (334, 3)), (4, 1, False, (250, 4)), (2, 1, True, (500, 2))],
    ids=["default-64-heads", "default-128-heads", "default-deterministic", "one-item", "runs-of-3", "runs-of-4",
         "forced-deterministic"],
)  # fmt: skip
def test_ws_backward_schedule(monkeypatch, run, head_blocks, deterministic, expected):
    """Programs and items per program of a warp-specialized backward launch over 1000 items: the measured default
    (runs of 2 where a row is one item, else one item per program; one item per program in deterministic mode, whose
    row chunks are whole waves of one-item programs) or the forced count, the last run shorter."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    monkeypatch.setattr(ws, "WS_BWD_RUN", run)
    assert ws.ws_bwd_schedule(1000, head_blocks, torch.device("cpu"), deterministic=deterministic) == expected


@pytest.mark.parametrize(
    "name,expected",
    [("NVIDIA H200", (132, 0)), ("NVIDIA H100 80GB HBM3", (1000, 1)), ("NVIDIA A100-SXM4-80GB", (1000, 1))],
    ids=["h200-one-program-per-sm", "h100-one-item", "other-one-item"],
)  # fmt: skip
def test_ws_backward_schedule_default_for_several_head_blocks_follows_the_gpu(monkeypatch, name, expected):
    """Where a row has several head blocks, the default (``WS_BWD_RUN = None``) takes the GPU's entry of the measured
    table ``WS_BWD_RUN_MULTI_BLOCK_BY_GPU`` (one program per SM on an H200), one item per program on any other GPU;
    a row of one head block keeps runs of 2 and deterministic mode one item per program on every GPU."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    monkeypatch.setattr(ws, "WS_BWD_RUN", None)
    monkeypatch.setattr(ws, "gpu_name", lambda device: name)
    monkeypatch.setattr(ws, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert ws.ws_bwd_schedule(1000, 2, dev) == expected
    assert ws.ws_bwd_schedule(100, 2, dev) == ((100, 0) if expected[1] == 0 else (100, 1))
    assert ws.ws_bwd_schedule(1000, 1, dev) == (500, 2)
    assert ws.ws_bwd_schedule(1000, 2, dev, deterministic=True) == (1000, 1)


@pytest.mark.parametrize("run", [None, 3])
def test_ws_backward_schedule_leaves_the_partitions_sms(monkeypatch, run):
    """With SMs reserved (``sparse_mla_bwd.DQ_PARTITION_SMS``), one program per SM on the others (``RUN = 0``), never
    more programs than items, whatever ``WS_BWD_RUN`` says."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    monkeypatch.setattr(ws, "WS_BWD_RUN", run)
    monkeypatch.setattr(ws, "sm_count", lambda device: 132)
    assert ws.ws_bwd_schedule(1000, 1, torch.device("cpu"), reserve_sms=32) == (100, 0)
    assert ws.ws_bwd_schedule(1000, 2, torch.device("cpu"), deterministic=True, reserve_sms=16) == (116, 0)
    assert ws.ws_bwd_schedule(40, 1, torch.device("cpu"), reserve_sms=32) == (40, 0)


@pytest.mark.parametrize("sms", [0, 132, -1, True, 8.0, "8"])
def test_partition_refuses_a_bad_sm_count(monkeypatch, sms):
    from longtrain.dsa.triton import sparse_mla_bwd as smb

    monkeypatch.setattr(smb, "sm_count", lambda device: 132)
    monkeypatch.setattr(smb, "DQ_PARTITION_SMS", sms)
    with pytest.raises(ValueError, match=r"DQ_PARTITION_SMS must be an int from 1 to 131 \(this GPU has 132 SMs\)"):
        smb._partition_sms(torch.device("cpu"))
    monkeypatch.setattr(smb, "DQ_PARTITION_SMS", 131)
    assert smb._partition_sms(torch.device("cpu")) == 131


@pytest.mark.parametrize("run", [-1, True, 2.0, "2"])
def test_ws_backward_schedule_refuses_a_bad_run(monkeypatch, run):
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    monkeypatch.setattr(ws, "WS_BWD_RUN", run)
    with pytest.raises(ValueError, match="WS_BWD_RUN must be None"):
        ws.ws_bwd_schedule(1000, 1, torch.device("cpu"))


@pytest.mark.skipif(gpu_triton_site() is None, reason=f"needs Triton {GPU_TRITON} (the GPU machine's) in "
                    "<env>/triton-gpu: `make install` puts it there, or set LONGTRAIN_GPU_TRITON_SITE")  # fmt: skip
@pytest.mark.parametrize(
    "H,deterministic,run,pieces",
    [(64, False, 2, "fp32"), (64, True, 2, "fp32"), (128, False, 1, "fp32"), (128, False, 0, "fp32"),
     (64, True, 1, "fp16"), (128, True, 1, "fp16")],
    ids=["glm-runs-of-2", "glm-det-runs-of-2", "H128", "H128-persistent", "glm-det-fp16", "H128-det-fp16"],
)  # fmt: skip
def test_warp_specialized_backward_does_not_spill_with_the_gpus_triton(H, deterministic, run, pieces):
    """Compiled by the Triton the GPU machine runs, the warp-specialized backward keeps its registers: with its item
    loop Triton 3.6 once hoisted every wgmma descriptor of the probabilities warpgroup out of it and spilled them
    (720 bytes of stack, the backward 22 % slower on an H100) where Triton 3.9 showed no spill. The kernel before the
    item loop had 80 bytes of stack there."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    piece = f"*{pieces}"
    types = _TYPES[:3] + ["*bf16"] + _TYPES[3:8] + [piece, "*fp32"] + _TYPES[9:] + ["i32", "fp32", "fp32"]
    consts = dict(H=H, D_V=512, D_R=64, HAS_LEN=True, DETERMINISTIC=deterministic, PREFETCH_IDX=False,
                  REGS_PROB=ws.WS_BWD_NUM_REGS[0], REGS_PRODUCER=ws.WS_BWD_NUM_REGS[1], STAGED_DS=True,
                  RUN=run, SCALED=pieces == "fp16")  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90_ws", "sparse_mla_bwd_sm90_ws_kernel", types, consts,
                         triton_site=gpu_triton_site(), num_warps=4, maxnreg=ws.WS_BWD_MAXNREG)  # fmt: skip
    assert stats["stack"] <= 80 and stats["local"] == 0, stats
    assert stats["wgmma"] and not stats["wgmma_serialized"], stats


@pytest.mark.parametrize(
    "tokens,rows,per_row,sms,expected",
    [
        (16384, 1024, 1, 132, 1056),  # 16 launches, 15 of them 8 whole waves
        (16384, 1024, 2, 132, 1056),
        (4096, 2048, 2, 132, 2112),  # still 2 launches (a chunk of 2046 rows would leave a third of 4)
        (4096, 113, 1, 132, 132),  # chunks smaller than a wave (the deterministic scratch's): one wave each
        (1000, 4096, 3, 78, 1014),  # one launch
    ],
    ids=["glm", "H128", "T4096-K512", "few-rows", "one-chunk"],
)
def test_sm90_row_chunks_fill_whole_waves(monkeypatch, tokens, rows, per_row, sms, expected):
    """The SM90 backward's row chunk (one program per row and head block, one program per SM): as many chunks as the
    scratch gives, each rounded up to whole waves of the GPU's SMs."""
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    monkeypatch.setattr(mb, "sm_count", lambda device: sms)
    chunk = mb._whole_waves(tokens, rows, per_row, torch.device("cuda", 0))
    assert chunk == expected and chunk * per_row % sms == 0
    if rows * per_row >= sms:
        assert -(-tokens // chunk) == -(-tokens // rows)


@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
def test_lse_only_preprocess_and_the_sink_gradient_from_a_kernels_delta(triton_interpret, with_sink):
    """Before the warp-specialized kernel (which forms delta itself) the preprocess reads lse alone: its lse2 equals
    the full preprocess's bit for bit, delta stays as the caller left it, and ``sink_grad`` from (lse2, delta) equals
    the full preprocess's per-row dsink terms summed. Rows without keys (lse = -inf) included."""
    from longtrain.dsa.triton.sparse_mla_bwd import sink_grad, sparse_mla_bwd_kernel_preprocess

    T, H, d_v = 5, 3, 16
    out, dout = torch.randn(T, H, d_v), torch.randn(T, H, d_v)
    lse = torch.randn(T, H)
    lse[1] = float("-inf")
    sink = torch.randn(H)

    def run(with_delta):
        delta, lse2, dsink_rows = torch.zeros(T, H), torch.full((T, H), float("nan")), torch.zeros(T, H)
        sparse_mla_bwd_kernel_preprocess[(T,)](
            out, dout, lse, sink if with_sink else lse, delta, lse2, dsink_rows,
            H=H, D_V=d_v, BLOCK_H=16, BLOCK_DV=16, HAS_SINK=with_sink, WITH_DELTA=with_delta, num_warps=4,
        )  # fmt: skip
        return delta, lse2, dsink_rows

    delta, lse2, dsink_rows = run(True)
    torch.testing.assert_close(delta, (out.double() * dout.double()).sum(-1).float())
    delta_lse_only, lse2_lse_only, _ = run(False)
    assert torch.equal(lse2_lse_only, lse2) and bool((lse2[1] == float("inf")).all())
    assert torch.equal(delta_lse_only, torch.zeros(T, H))
    if with_sink:
        # fp32 terms summed over 5 rows in two orders.
        torch.testing.assert_close(sink_grad(sink, lse2, delta), dsink_rows.sum(0))
