"""The backward's SM90 probabilities kernel (stacked logits and dO V^T): routing, forced-config validation and offline
compilation for Hopper (it cannot run without an SM90 GPU; its numerics are checked in
tests/gpu/test_dsa_triton_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longtrain.dsa.triton import KernelConfig, SparseMLAConfig
from tests.dsa._sm90_compile import compile_sm90, cuobjdump

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
    from longtrain.dsa.triton.sparse_mla_bwd import _ds_sm90_setting

    assert _ds_sm90_setting(torch.zeros(1, 64, 576, dtype=torch.bfloat16), 512, None) is None


@pytest.mark.parametrize(
    "config,D,reason,expected",
    [
        (None, 576, None, None),  # the default is the portable kernel (the SM90 one is not yet timed)
        (KernelConfig(), 576, None, None),  # impl="triton" forces the portable kernel
        (KernelConfig(impl="sm90", block_k=32, num_stages=2), 576, None, (32, 2)),  # dO in shared memory
        (KernelConfig(impl="sm90", block_k=64, num_stages=2), 512, None, (64, 2)),  # K = V, no rope tail
        (KernelConfig(impl="sm90", block_k=16, num_stages=2), 576, None, "64 or 32 slots per step"),
        (KernelConfig(impl="sm90", block_k=64, num_stages=3), 576, None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90", block_k=32, num_stages=3), 576, None, (32, 3)),
        (KernelConfig(impl="sm90", block_k=32, num_stages=6), 576, None, "exceed the 227 KiB"),
        (KernelConfig(impl="sm90"), 576, "it needs at least 64 heads", "at least 64 heads.*use impl='triton'"),
    ],
    ids=["default", "triton", "sm90-32", "sm90-D512", "bad-block", "64x3", "32x3", "32x6", "heads"],
)
def test_ds_sm90_setting(monkeypatch, config, D, reason, expected):
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as sm90

    monkeypatch.setattr(smb, "interpreting", lambda: False)
    monkeypatch.setattr(sm90, "sm90_unsupported_reason", lambda q, d_v: reason)
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected):
            smb._ds_sm90_setting(_fake_q(D=D), 512, config)
    else:
        assert smb._ds_sm90_setting(_fake_q(D=D), 512, config) == expected


def test_smem_budget_of_the_kernel():
    from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sm90_ds_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd import _SM90_SMEM

    assert sm90_ds_smem_bytes(64, 2, 576, 512, 2) == 2 * 64 * 1152 + 128 * 64 * 2 + 128 * 64 * 4  # 192 KiB
    assert sm90_ds_smem_bytes(32, 3, 576, 512, 2) <= _SM90_SMEM < sm90_ds_smem_bytes(64, 3, 576, 512, 2)


_TYPES = ["*bf16", "*bf16", "*bf16", "*i32", "*i32", "*fp32", "*fp32", "*bf16", "*bf16", "i32", "i32", "i32"]


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize("block_k,num_buf,d_qk", [(64, 2, 576), (32, 3, 576), (64, 2, 512)], ids=["64", "32x3", "D512"])
def test_sm90_ds_kernel_compiles_for_hopper(block_k, num_buf, d_qk):
    """Compiled for sm_90a on this CPU-only machine: cp.async ring + wgmma, shared memory as budgeted."""
    from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sm90_ds_smem_bytes

    consts = dict(H=64, D_V=512, D_R=d_qk - 512, HAS_LEN=True, STORE_P=True, BLOCK_K=block_k, NUM_BUF=num_buf)
    stats = compile_sm90("longtrain.dsa.triton.sparse_mla_bwd_sm90", "sparse_mla_bwd_sm90_kernel_ds",
                         _TYPES + ["fp32", "fp32"], consts)  # fmt: skip
    assert stats["cp_async"] and stats["wgmma"], stats
    assert stats["shared"] == sm90_ds_smem_bytes(block_k, num_buf, d_qk, 512, 2), stats
