"""The ping-pong SM90 sparse MLA forward (``sparse_mla_fwd_sm90_pp.py``): its config rules, support rules, routing
and offline compilation for Hopper. Gluon kernels do not run in the interpreter; its numerics are checked on the GPU
(``tests/gpu/test_dsa_triton_gpu.py -k sm90pp``)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from longtrain.dsa.triton import KernelConfig, SparseMLAConfig
from tests.dsa._sm90_compile import compile_sm90, cuobjdump

pytestmark = pytest.mark.interpret

PP = dict(impl="sm90", layout="ping_pong", num_warps=4, block_k=64, num_stages=2)


def _fake_q(H=64, D=576, dtype=torch.bfloat16):
    return SimpleNamespace(shape=(3, H, D), dtype=dtype, device=torch.device("cuda", 0), element_size=lambda: 2)


def test_ping_pong_config_rules():
    SparseMLAConfig(fwd=KernelConfig(**PP))
    for bad in (dict(num_warps=8), dict(block_k=32), dict(num_stages=3), dict(impl="triton")):
        with pytest.raises(ValueError, match="layout='ping_pong' is the SM90 forward.*num_stages=2"):
            KernelConfig(**{**PP, **bad})
    with pytest.raises(ValueError, match="layout='ping_pong' is the forward's"):
        SparseMLAConfig(bwd=KernelConfig(**PP))
    with pytest.raises(ValueError, match="layout must be one of .*'ping_pong'"):
        KernelConfig(layout="pingpong")


@pytest.mark.parametrize(
    "cap,kwargs,d_v,match",
    [
        ((9, 0), {}, 512, None),  # GLM-5.2: P_0 in tile 0's rope block
        ((9, 0), dict(D=512), 512, None),  # no rope tail: P_0 in a block of its own
        ((9, 0), dict(D=544), 512, None),  # a rope tail of 32
        ((9, 0), dict(D=320), 256, None),
        ((9, 0), dict(H=96, dtype=torch.float16), 512, None),
        ((9, 0), dict(D=640), 512, "two tiles of 64 rows of D_qk=640 .* exceed the 227 KiB"),
        ((8, 0), {}, 512, "needs an SM90 \\(Hopper\\) GPU, cuda:0 is SM80"),
        ((9, 0), dict(H=32), 512, "at least 64 heads"),
        ((9, 0), dict(D=128), 64, "d_v in \\[128, 512\\]"),
    ],
)
def test_ping_pong_support_rules(monkeypatch, cap, kwargs, d_v, match):
    from longtrain.dsa.triton import sparse_mla_fwd as fwd

    monkeypatch.setattr(fwd, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    reason = fwd._pp_reason(_fake_q(**kwargs), d_v)
    if match is None:
        assert reason is None
    else:
        assert re.search(match, reason), reason


def test_ping_pong_smem_budget():
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_LIMIT
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_pp import pp_smem_bytes

    # 64 query heads and two 64-row tiles of 576 bf16 (216 KiB) and P_1: P_0 shares tile 0's rope block.
    assert pp_smem_bytes(576, 512, 2) == 216 * 1024 + 8192 + 512 + 512 <= SM90_SMEM_LIMIT
    assert pp_smem_bytes(512, 512, 2) == 192 * 1024 + 2 * 8192 + 512 + 512  # P_0 needs its own block
    assert pp_smem_bytes(640, 512, 2) > SM90_SMEM_LIMIT


def test_forced_ping_pong_refuses_the_interpreter(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    q = torch.randn(3, 64, 576)
    kv = torch.randn(16, 1, 576)
    idx = torch.randint(0, 16, (3, 8), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="layout='ping_pong'.*interpreter.*layout='warp_specialized' or impl="):
        sparse_mla_triton(q, kv, idx, 0.1, d_v=512, config=SparseMLAConfig(fwd=KernelConfig(**PP)))


@pytest.mark.parametrize(
    "default,pp_reason,ws_reason,expected",
    [
        ("ping_pong", None, None, "ping_pong"),
        ("ping_pong", "too big", None, "warp_specialized"),  # where it does not fit: the next kernel
        ("ping_pong", "too big", "too big", "heads"),
        ("warp_specialized", None, None, "warp_specialized"),
        ("heads", None, None, "heads"),
    ],
)
def test_the_default_forward_follows_the_module_setting(monkeypatch, default, pp_reason, ws_reason, expected):
    from longtrain.dsa.triton import sparse_mla_fwd as fwd

    monkeypatch.setattr(fwd, "SM90_FWD_DEFAULT", default)
    monkeypatch.setattr(fwd, "_sm90_default", lambda q, d_v: True)
    monkeypatch.setattr(fwd, "_pp_reason", lambda q, d_v: pp_reason)
    monkeypatch.setattr(fwd, "_ws_reason", lambda q, d_v, block_k, num_buf: ws_reason)
    assert fwd.sm90_forward_kind(_fake_q(), 512) == expected


_TYPES = ["*bf16", "*bf16", "*i32", "*i32", "*fp32", "*bf16", "*fp32", "i32", "i32", "fp32"]


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize("d_r", [64, 0, 32], ids=["glm", "no-rope", "rope32"])
def test_ping_pong_kernel_compiles_for_hopper(d_r):
    """Compiled for sm_90a on this CPU-only machine: three partitions at their register budgets (setmaxnreg),
    cp.async + wgmma, no serialized wgmma (ptxas C7510-C7520), shared memory within what ``pp_smem_bytes`` (the
    launcher's fit check) counts."""
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_pp import PP_MAXNREG, PP_NUM_REGS, pp_smem_bytes

    consts = dict(H=64, D_V=512, D_R=d_r, HAS_LEN=True, HAS_SINK=True, REGS_WG1=PP_NUM_REGS[0],
                  REGS_PRODUCER=PP_NUM_REGS[1])  # fmt: skip
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_fwd_sm90_pp", "sparse_mla_fwd_sm90_pp_kernel", _TYPES,
                         consts, num_warps=4, maxnreg=PP_MAXNREG)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["wgmma_serialized"] == [], stats
    assert set(PP_NUM_REGS) <= set(stats["setmaxnreg"]), stats
    assert stats["shared"] <= pp_smem_bytes(512 + d_r, 512, 2) <= 232448, stats
