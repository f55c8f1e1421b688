"""Sparse MLA forward launch paths: pipelined portable configs (interpreter, vs float64) and the SM90 kernel's
routing, validation and offline compilation for Hopper (it cannot run without an SM90 GPU; its numerics are
checked in tests/gpu/test_dsa_triton_gpu.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from longtrain.dsa.reference import sparse_mla_reference
from longtrain.dsa.triton import KernelConfig
from tests.dsa._sm90_compile import compile_sm90, cuobjdump

pytestmark = pytest.mark.interpret


def _inputs(T, H, D, T_k, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(T_k, D, generator=g).to(dtype)
    idx = torch.randint(0, T_k, (T, K), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.15] = -1
    idx[1, 3:9] = torch.tensor([T_k, 2**30, -7, 2, 2, 2], dtype=torch.int32)  # out of range + duplicates
    idx[2] = -1  # no valid slot at all
    return q, kv, idx


@pytest.mark.parametrize("layout", ["heads", "keys", "keys_logits"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipelined_configs_match_reference(triton_interpret, layout, num_stages):
    """num_stages >= 2 loads the slot indices one step ahead (IDX_AHEAD); every layout must still be exact."""
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    T, H, D, d_v, T_k, K = 5, 20, 48, 32, 23, 40  # two head blocks of 16, rope tail 16, three slot blocks
    q, kv, idx = _inputs(T, H, D, T_k, K, torch.float32, seed=num_stages)
    length = torch.tensor([40, 17, 40, 0, 33], dtype=torch.int32)  # ends mid-block, and an empty row
    sink = torch.randn(H)
    cfg = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=num_stages, layout=layout)
    out, lse = sparse_mla_fwd(q, kv, idx, 0.3, d_v, length, sink, cfg)
    ref, ref_lse = sparse_mla_reference(
        q.double(), kv.double()[:, None], idx, 0.3, d_v=d_v, topk_length=length, attn_sink=sink.double()
    )
    # fp32 kernel vs float64 oracle: fp32 rounding of 48-long dot products and 40-term sums, far below 1e-4.
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for row in (2, 3):  # no valid slot / zero length: exact zeros and -inf
        assert torch.equal(out[row], torch.zeros_like(out[row]))
        assert torch.all(lse[row] == float("-inf"))


def test_pipelined_config_fp16_flash_attention_rule(triton_interpret):
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    q, kv, idx = _inputs(4, 16, 48, 30, 48, torch.float16, seed=5)
    cfg = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=2)
    out, _ = sparse_mla_fwd(q, kv, idx, 0.25, 32, None, None, cfg)
    ref64, _ = sparse_mla_reference(q.double(), kv.double()[:, None], idx, 0.25, d_v=32)
    same, _ = sparse_mla_reference(q, kv[:, None], idx, 0.25, d_v=32)
    # Flash-attention rule: at most twice the same-dtype reference's error plus one fp16 rounding step.
    bound = 2 * (same.double() - ref64).abs().max() + ref64.abs().max() * 2.0**-11
    assert (out.double() - ref64).abs().max() <= bound


def test_kernel_config_impl_validation():
    assert KernelConfig().impl == "triton"
    KernelConfig(impl="sm90", block_k=32, num_stages=4)
    with pytest.raises(ValueError, match="impl must be one of 'triton', 'sm90'"):
        KernelConfig(impl="gluon")
    for bad in (dict(num_warps=4), dict(num_stages=1), dict(layout="keys")):
        with pytest.raises(ValueError, match="impl='sm90'.*num_warps=8, num_stages >= 2 and layout='heads'"):
            KernelConfig(impl="sm90", **bad)


def test_forced_sm90_refuses_the_interpreter(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx = _inputs(3, 64, 576, 8, 16, torch.float32, seed=1)
    cfg = KernelConfig(impl="sm90", num_stages=2)
    with pytest.raises(RuntimeError, match="impl='sm90'.*interpreter.*impl='triton'"):
        sparse_mla_triton(q, kv[:, None], idx, 0.1, d_v=512, config=cfg)


def test_forced_warp_specialized_refuses_the_interpreter(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton
    from longtrain.dsa.triton.sparse_mla_fwd import sm90_forward_kind

    q, kv, idx = _inputs(3, 64, 576, 8, 16, torch.float32, seed=1)
    cfg = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, num_stages=2)
    with pytest.raises(RuntimeError, match="layout='warp_specialized'.*interpreter.*layout='heads' or impl='triton'"):
        sparse_mla_triton(q, kv[:, None], idx, 0.1, d_v=512, config=cfg)
    assert sm90_forward_kind(q.to(torch.bfloat16), 512) is None


def test_default_path_never_picks_sm90_off_gpu(triton_interpret):
    from longtrain.dsa.triton.sparse_mla_fwd import _sm90_default

    assert not _sm90_default(torch.zeros(1, 64, 576, dtype=torch.bfloat16), 512)


def _fake_q(H=64, D=576, dtype=torch.bfloat16):
    return SimpleNamespace(shape=(3, H, D), dtype=dtype, device=torch.device("cuda", 0))


@pytest.mark.parametrize(
    "cap,kwargs,d_v,match",
    [
        ((9, 0), {}, 512, None),
        ((9, 0), dict(D=512), 512, None),  # K = V, no rope tail
        ((9, 0), dict(H=128), 512, None),
        ((8, 0), {}, 512, "needs an SM90 \\(Hopper\\) GPU, cuda:0 is SM80"),
        ((10, 0), {}, 512, "SM100"),
        ((9, 0), dict(dtype=torch.float32), 512, "bf16/fp16"),
        ((9, 0), dict(H=32), 512, "at least 64 heads"),
        ((9, 0), dict(D=448), 448, "power-of-two d_v"),
        ((9, 0), dict(D=560), 512, "rope tail .* got 48"),
        ((9, 0), dict(D=1024), 512, "rope tail .* got 512"),
    ],
)
def test_sm90_support_rules(monkeypatch, cap, kwargs, d_v, match):
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    reason = sm90.sm90_unsupported_reason(_fake_q(**kwargs), d_v)
    if match is None:
        assert reason is None
    else:
        assert re.search(match, reason), reason
    assert "not on cpu" in sm90.sm90_unsupported_reason(torch.zeros(1, 64, 576, dtype=torch.bfloat16), 512)


def test_sm90_candidates_fit_shared_memory():
    from longtrain.dsa.triton.sparse_mla_fwd import _SM90_CANDIDATES, _sm90_fits

    for d_qk in (576, 512):
        assert all(_sm90_fits(bk, nb, d_qk, 2) for bk, nb in _SM90_CANDIDATES)
    assert not _sm90_fits(64, 3, 576, 2)  # 64 queries + 3 x 64 rows of 576 bf16 = 288 KiB
    assert not _sm90_fits(128, 2, 576, 2)


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
def test_sm90_kernel_compiles_for_hopper_without_spills():
    """The GLM-5.2 default candidate, compiled for sm_90a on this CPU-only machine: cp.async ring + wgmma, no
    spills to local memory, shared memory within the 227 KiB an SM90 block can have."""
    types = ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "i32", "i32", "fp32"]
    consts = dict(H=64, D_V=512, D_R=64, HAS_LEN=True, HAS_SINK=True, BLOCK_K=64, NUM_BUF=2, SPLIT_KEYS=True)
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_fwd_sm90", "sparse_mla_fwd_sm90_kernel", types, consts)
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["shared"] <= 232448, stats
    assert stats["stack"] == 0 and stats["local"] == 0, stats


@pytest.mark.parametrize(
    "cap,kwargs,d_v,match",
    [
        ((9, 0), {}, 512, None),
        ((9, 0), dict(D=512), 512, None),  # K = V, no rope tail
        ((9, 0), dict(D=320), 256, None),
        ((9, 0), dict(H=96, dtype=torch.float16), 512, None),
        ((8, 0), {}, 512, "needs an SM90 \\(Hopper\\) GPU, cuda:0 is SM80"),
        ((9, 0), dict(dtype=torch.float32), 512, "bf16/fp16"),
        ((9, 0), dict(H=32), 512, "at least 64 heads"),
        ((9, 0), dict(D=128), 64, "d_v in \\[128, 512\\]"),
        ((9, 0), dict(D=560), 512, "rope tail .* got 48"),
    ],
)
def test_warp_specialized_support_rules(monkeypatch, cap, kwargs, d_v, match):
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    reason = ws.ws_unsupported_reason(_fake_q(**kwargs), d_v)
    if match is None:
        assert reason is None
    else:
        assert re.search(match, reason), reason
    assert "not on cpu" in ws.ws_unsupported_reason(torch.zeros(1, 64, 576, dtype=torch.bfloat16), 512)


def test_warp_specialized_config_rules():
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    ws = dict(impl="sm90", layout="warp_specialized")
    KernelConfig(**ws, num_warps=4, block_k=32, num_stages=4)
    KernelConfig(**ws, num_warps=4, block_k=64, num_stages=2)
    for bad in (dict(num_warps=8), dict(num_warps=4, block_k=128)):
        with pytest.raises(ValueError, match="layout='warp_specialized' is an SM90 kernel"):
            KernelConfig(**{**ws, **bad})
    with pytest.raises(ValueError, match="needs impl='sm90'"):
        KernelConfig(layout="warp_specialized", num_warps=4)
    # One tile is the backward's ring; the forward's needs two or more.
    one_tile = KernelConfig(**ws, num_warps=4, block_k=64, num_stages=1)
    assert SparseMLAConfig(bwd=one_tile).backward_configs() == (one_tile, None, None)
    with pytest.raises(ValueError, match="the warp-specialized forward streams a ring of num_stages >= 2"):
        SparseMLAConfig(fwd=one_tile)
    with pytest.raises(ValueError, match="the warp-specialized backward gathers one tile of 64 slots"):
        SparseMLAConfig(bwd=KernelConfig(**ws, num_warps=4, block_k=64, num_stages=2))
    with pytest.raises(ValueError, match="no dkv kernel for bwd_dkv"):
        SparseMLAConfig(bwd=one_tile, bwd_dkv=KernelConfig())
    with pytest.raises(ValueError, match="layout must be one of .*'warp_specialized'"):
        KernelConfig(layout="ws")


def test_warp_specialized_default_ring_fits_shared_memory():
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_LIMIT, SM90_WS_DEFAULT
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import ws_smem_bytes

    assert ws_smem_bytes(*SM90_WS_DEFAULT, 576, 2) <= SM90_SMEM_LIMIT
    assert ws_smem_bytes(64, 2, 576, 2) <= SM90_SMEM_LIMIT
    assert ws_smem_bytes(64, 3, 576, 2) > SM90_SMEM_LIMIT  # 64 queries + 3 x 64 rows of 576 bf16 = 288 KiB
    assert ws_smem_bytes(32, 4, 640, 2) > SM90_SMEM_LIMIT  # a rope tail of 128: the default ring falls back


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    "block_k,num_buf,prefetch,d_r,run,staged",
    [
        (32, 4, True, 64, 1, False),
        (64, 2, True, 64, 0, False),
        (64, 2, False, 64, 4, False),
        (64, 2, True, 0, 3, False),
        (64, 2, True, 64, 4, False),
        (64, 2, True, 64, -1, False),
        (32, 4, True, 64, -1, False),
        (64, 2, True, 64, 4, True),
        (64, 2, True, 0, -1, True),
    ],
    ids=[
        "32x4-deferred",
        "64x2-persistent",
        "64x2-indices-after-wait-runs-of-4",
        "64x2-no-rope-runs-of-3",
        "64x2",
        "64x2-dynamic",
        "32x4-dynamic",
        "64x2-staged-out",
        "64x2-no-rope-dynamic-staged-out",
    ],
)
def test_warp_specialized_kernel_compiles_for_hopper(block_k, num_buf, prefetch, d_r, run, staged):
    """The warp-specialized forward compiled for sm_90a on this CPU-only machine: three partitions with their
    register budgets (setmaxnreg), cp.async + wgmma, no spills, no serialized wgmma (ptxas C7510-C7520), shared memory
    within 227 KiB and within what ``ws_smem_bytes`` (the launcher's fit check) counts."""
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import WS_MAXNREG, WS_NUM_REGS, ws_smem_bytes

    types = ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "i32", "i32", "i32", "fp32", "*i32"]
    consts = dict(H=64, D_V=512, D_R=d_r, HAS_LEN=True, HAS_SINK=True, BLOCK_K=block_k, NUM_BUF=num_buf,
                  REGS_RIGHT=WS_NUM_REGS[0], REGS_PRODUCER=WS_NUM_REGS[1], RUN=run, PREFETCH_IDX=prefetch,
                  PREFETCH_Q=prefetch, STAGED_OUT=staged)  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_fwd_sm90_ws", "sparse_mla_fwd_sm90_ws_kernel", types,
                         consts, num_warps=4, maxnreg=WS_MAXNREG)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"], stats
    # Triton 3.6 (the H200 machine's) allocates both rings without spills; Triton 3.9 spills at the 32 x 4 ring.
    import triton

    if block_k == 64 or triton.__version__.startswith("3.6."):
        # At most one 64-bit value on the stack: with the producer at 96 registers, ptxas keeps the persistent
        # producer's index-row base (formed before the partitions split) there, stored once per program and reloaded
        # once per item, never per tile. 112 registers remove it but leave the softmax warpgroup 232,
        # which ran slower (benchmarks/results/dsa_fwd_persistent_regs_160_112_b25c3c0_h100_2026-12-06.md
        # against ..._regs_160_96_...).
        assert stats["stack"] <= 8 and stats["local"] == 0, stats
    assert stats["wgmma_serialized"] == [], stats
    assert set(WS_NUM_REGS) <= set(stats["setmaxnreg"]), stats
    assert stats["shared"] <= ws_smem_bytes(block_k, num_buf, 512 + d_r, 2) <= 232448, stats


def test_warp_specialized_schedule(monkeypatch):
    """The warp-specialized launch: one program per run of ``WS_RUN`` consecutive items (the last run shorter), or one
    program per SM (never more programs than items) taking every G-th item (``RUN = 0``) or items from a counter
    (``RUN = -1``); the GPU tests check every schedule gives the same output bit for bit."""
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws

    monkeypatch.setattr(ws, "sm_count", lambda device: 132)
    dev = torch.device("cuda", 0)
    for schedule, run in (("persistent", 0), ("dynamic", -1)):
        monkeypatch.setattr(ws, "WS_SCHEDULE", schedule)
        assert [ws.ws_schedule(n, dev) for n in (0, 1, 131, 132, 133, 32768)] == [
            (1, run), (1, run), (131, run), (132, run), (132, run), (132, run)
        ]  # fmt: skip
    monkeypatch.setattr(ws, "WS_SCHEDULE", "runs")
    for run, expected in ((1, [1, 1, 133, 32768]), (4, [1, 1, 34, 8192]), (3, [1, 1, 45, 10923])):
        monkeypatch.setattr(ws, "WS_RUN", run)
        assert [ws.ws_schedule(n, dev) for n in (0, 1, 133, 32768)] == [(e, run) for e in expected]
    for bad in (0, -2, 2.0, True):
        monkeypatch.setattr(ws, "WS_RUN", bad)
        with pytest.raises(ValueError, match="WS_RUN must be a positive int"):
            ws.ws_schedule(10, dev)
    monkeypatch.setattr(ws, "WS_SCHEDULE", "static")
    with pytest.raises(ValueError, match=r"WS_SCHEDULE must be one of \('runs', 'persistent', 'dynamic'\)"):
        ws.ws_schedule(10, dev)
