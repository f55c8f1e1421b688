"""Which sparse MLA backward kernels run for a call: the SM90 Gluon kernels (:mod:`.sparse_mla_bwd_sm90`) or the
portable Triton ones (:mod:`.sparse_mla_bwd`), with each SM90 kernel's shared-memory budget.

Host code, no kernels; the SM90 support rules come from the forward's Gluon module, imported on first use.
"""

from __future__ import annotations

import torch

from longtrain.dsa.triton._common import KernelConfig, interpreting
from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES, SM90_SMEM_LIMIT

__all__ = [
    "SM90_BWD_DEFAULT",
    "SM90_DQ_DS_SMEM",
    "SM90_DQ_HEADS",
    "SM90_DQ_RINGS",
    "SM90_DQ_STAGED_STORE",
    "sm90_backward_plan",
    "sm90_dq_plan",
    "sm90_dq_smem_bytes",
    "sm90_ds_dkv_smem_bytes",
    "sm90_ds_smem_bytes",
    "sm90_ws_bwd_smem_bytes",
]

# The fused SM90 kernel that config=None runs where it applies: "warp_specialized" (sparse_mla_bwd_sm90_ws.py) or
# "fused" (the two-warpgroup kernel in sparse_mla_bwd_sm90.py).
SM90_BWD_DEFAULT = "warp_specialized"
# The SM90 dq kernel that config=None runs: heads per program where the head count is a multiple of 128 (64: one
# program per 64 heads, every column; 128: two programs per 128 heads, half of the columns each) and each layout's
# ring (block_k, num_buf). 64: on the H200 the 128-head layout (dS in registers) took 1.42 ms against 1.23 at
# T = 4096, H = 128, K = 512 and 14.78 against 14.39 at T = 16384, K = 2048, its best ring 64 x 2
# (benchmarks/results/dsa_bwd_dq_2026-12-04.md). Read at each call.
SM90_DQ_HEADS = 64
SM90_DQ_RINGS = {64: (64, 2), 128: (64, 2)}
# Whether the SM90 dq kernel stages dS through its ring in shared memory (the wgmma's A operand from there; where K
# is a multiple of 8) instead of loading it one step ahead into registers. Off until it has run on a GPU: compiled
# and checked for sm_90a here; its GPU test is tests/gpu/test_dsa_triton_gpu.py -k ds_ring. Read at each
# call.
SM90_DQ_DS_SMEM = False
# Whether the SM90 dq kernel stores dq through its ring (free by then) as whole 16-byte row segments per thread,
# instead of straight from the wgmma accumulator (4-byte pairs, each 32-byte sector written in two halves). True: on an
# H100 the dq kernel took 1.01-1.03 ms against 1.20-1.22 at T = 4096, H = 128, K = 512 and the whole backward 5.43-5.45
# against 5.62-5.64 (39.94-39.98 against 40.42-40.43 at T = 16384, H = 64, K = 2048; 79.63 against 81.27-81.33 at
# H = 128), dq equal bit for bit (benchmarks/results/dsa_bwd_dq_staged_8736276_h100_2026-12-06.md, python
# benchmarks/dsa_bwd_dq.py --staged-store; tests/gpu/test_dsa_triton_gpu.py -k staged_store). Read at each call.
SM90_DQ_STAGED_STORE = True
# Heads per program of the SM90 kernels, and gathered slots per step of the fused one.
_STACK_H = 64
_DKV_BLOCK_K = 64


def sm90_ds_smem_bytes(block_k: int, num_buf: int, d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory of the SM90 stacked probabilities kernel: the ring of gathered tiles, the stacked rope operand
    and the fp32 tile the two halves meet in."""
    return (num_buf * block_k * d_qk + 128 * (d_qk - d_v)) * itemsize + 128 * block_k * 4


def sm90_ds_dkv_smem_bytes(d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory of the fused probabilities + dkv kernel: the stacked ``[Q; dO]`` operand (128 rows of ``D_qk``)
    and one gathered tile of 64 rows (the ``[dS; P]`` tile lives in the tile's buffer)."""
    return (2 * _STACK_H + _DKV_BLOCK_K) * d_qk * itemsize


def sm90_ws_bwd_smem_bytes(d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory of the warp-specialized fused kernel: the stacked ``[Q_v; dO]`` operand (128 rows of ``d_v``), the
    rope queries (64 rows), one gathered tile of 64 rows, the ``[dS; P]`` tile (128 x 64), delta (64 fp32), the
    scaled fp16 pieces' head maxima (two items' 128 fp32), the barriers and the compiler's layout-conversion scratch."""
    elements = 2 * _STACK_H * d_v + _STACK_H * (d_qk - d_v) + _DKV_BLOCK_K * d_qk + 2 * _STACK_H * _DKV_BLOCK_K
    return elements * itemsize + _STACK_H * 4 + 2 * 2 * _STACK_H * 4 + 1024


def sm90_dq_smem_bytes(
    block_k: int, num_buf: int, d_qk: int, itemsize: int, heads: int = 64, ds_smem: bool = True
) -> int:
    """Shared memory of the SM90 dq kernel with ``heads`` per program (64: every column; 128: half of them): the ring
    of gathered tiles, each with its ``dS`` tile (``ds_smem``), or with one tile for turning ``dS`` into the wgmma's
    register operand."""
    ds_tiles = num_buf if ds_smem else 1
    return (num_buf * block_k * d_qk * 64 // heads + ds_tiles * heads * block_k) * itemsize


def sm90_backward_plan(
    q: torch.Tensor,
    d_v: int,
    config: KernelConfig | None,
    *,
    compute_dkv: bool,
    dkv_forced: bool,
) -> tuple[str, int, int] | None:
    """``(kernel, block_k, num_buf)`` of the SM90 probabilities kernel for this call, or None for the portable one.

    ``kernel`` is ``"fused"`` (probabilities and dkv in one kernel, the dkv kernel skipped; deterministic: it stores
    per-slot pieces for the fixed-order reduction), ``"fused_ws"`` (the same, warp-specialized:
    :mod:`.sparse_mla_bwd_sm90_ws`) or ``"ds"`` (the stacked probabilities kernel). ``config=None`` takes the fused
    kernel of ``SM90_BWD_DEFAULT`` on an SM90 GPU wherever it applies (dkv wanted, no forced dkv config, shape within
    its support rules; else the other fused kernel), else the stacked probabilities kernel where that applies, else
    the portable kernel. A forced ``KernelConfig(impl="sm90")`` (``layout="fused"`` or ``"warp_specialized"`` for a
    fused kernel) takes it or raises saying why it cannot run here; with no dkv wanted a fused kernel's
    probabilities half runs (the stacked kernel, 64 slots x 2 tiles). ``impl="triton"`` keeps the portable kernel.
    """
    from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sm90_unsupported_reason

    if config is not None and config.impl != "sm90":
        return None
    reason = "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)" if interpreting() else None
    reason = reason or sm90_unsupported_reason(q, d_v)
    d_qk, size = q.shape[2], q.element_size()
    fused_reason = reason
    if fused_reason is None and d_v < 128:
        fused_reason = f"the fused kernel needs d_v >= 128, got d_v={d_v}"
    fused_smem = sm90_ds_dkv_smem_bytes(d_qk, d_v, size)
    if fused_reason is None and fused_smem > SM90_SMEM_BYTES:
        fused_reason = f"the fused kernel's {fused_smem} bytes of shared memory at D_qk={d_qk} exceed 227 KiB"
    ws_reason = reason
    if ws_reason is None and d_v < 128:
        ws_reason = f"the warp-specialized kernel needs d_v >= 128, got d_v={d_v}"
    ws_smem = sm90_ws_bwd_smem_bytes(d_qk, d_v, size)
    if ws_reason is None and ws_smem > SM90_SMEM_LIMIT:
        ws_reason = f"the warp-specialized kernel's {ws_smem} bytes of shared memory at D_qk={d_qk} exceed 227 KiB"
    if config is None:
        fused_kinds = {"fused_ws": ws_reason, "fused": fused_reason}
        order = ("fused_ws", "fused") if SM90_BWD_DEFAULT == "warp_specialized" else ("fused", "fused_ws")
        for kind in order if compute_dkv and not dkv_forced else ():
            if fused_kinds[kind] is None:
                return kind, 64, 1
        if reason is None and sm90_ds_smem_bytes(64, 2, d_qk, d_v, size) <= SM90_SMEM_BYTES:
            return "ds", 64, 2
        return None
    if config.layout == "warp_specialized":
        if ws_reason is not None:
            raise RuntimeError(
                f"backward KernelConfig(impl='sm90', layout='warp_specialized') cannot run here: {ws_reason}; use "
                "layout='fused' or impl='triton'"
            )
        return ("fused_ws", 64, 1) if compute_dkv else ("ds", 64, 2)
    if config.layout == "fused":
        if fused_reason is not None:
            raise RuntimeError(f"backward KernelConfig(impl='sm90', layout='fused') cannot run here: {fused_reason}")
        return ("fused", 64, 1) if compute_dkv else ("ds", 64, 2)
    if reason is None and config.block_k not in (32, 64):
        reason = f"its probabilities kernel gathers 64 or 32 slots per step, got block_k={config.block_k}"
    smem = sm90_ds_smem_bytes(config.block_k, config.num_stages, d_qk, d_v, size)
    if reason is None and smem > SM90_SMEM_BYTES:
        reason = (
            f"{config.num_stages} tiles of {config.block_k} rows of D_qk={d_qk} ({smem} bytes with the rest) "
            "exceed the 227 KiB of shared memory; lower num_stages or block_k"
        )
    if reason is not None:
        raise RuntimeError(f"backward KernelConfig(impl='sm90') cannot run here: {reason}; use impl='triton'")
    return "ds", config.block_k, config.num_stages


def sm90_dq_plan(q: torch.Tensor, d_v: int, config: KernelConfig | None) -> tuple[int, int, int] | None:
    """``(block_k, num_buf, heads)`` of the SM90 dq kernel for this call, or None for the portable one.

    ``config=None`` takes it on an SM90 GPU wherever it applies: ``SM90_DQ_HEADS`` heads per program where ``H`` is a
    multiple of 128 (128: two programs per 128 heads, each half of the columns), else 64 with every column, at that
    layout's ring in ``SM90_DQ_RINGS``. A forced ``KernelConfig(impl="sm90")`` takes it with its
    ``block_k``, ``num_stages`` and ``block_h`` (64, or 128 where ``H`` is a multiple of 128) or raises saying why it
    cannot run here."""
    from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sm90_unsupported_reason

    if config is not None and config.impl != "sm90":
        return None
    reason = "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)" if interpreting() else None
    reason = reason or sm90_unsupported_reason(q, d_v)
    num_heads = q.shape[1]
    if config is None:
        heads = SM90_DQ_HEADS if num_heads % 128 == 0 else 64
        block_k, num_buf = SM90_DQ_RINGS[heads]
    else:
        block_k, num_buf, heads = config.block_k, config.num_stages, config.block_h
    if reason is None and block_k not in (32, 64):
        reason = f"its dq kernel gathers 64 or 32 slots per step, got block_k={block_k}"
    if reason is None and heads not in (64, 128):
        reason = f"its dq kernel takes 64 or 128 heads per program (block_h), got block_h={heads}"
    if reason is None and heads == 128 and num_heads % 128:
        reason = f"block_h=128 needs a multiple of 128 heads, got H={num_heads}"
    # Budgeted the way the launch will run it (with SM90_DQ_DS_SMEM, dS in the ring whatever K is: the larger), against
    # the whole 227 KiB: the kernel holds exactly this (tests/dsa/test_triton_sparse_mla_bwd_sm90.py compiles it), no
    # barriers or scratch beside it.
    smem = sm90_dq_smem_bytes(block_k, num_buf, q.shape[2], q.element_size(), heads, SM90_DQ_DS_SMEM)
    if reason is None and smem > SM90_SMEM_LIMIT:
        reason = (
            f"{num_buf} tiles of {block_k} rows of D_qk={q.shape[2]} ({smem} bytes with the rest) exceed the 227 "
            "KiB of shared memory; lower num_stages or block_k"
        )
    if reason is None:
        return block_k, num_buf, heads
    if config is None:
        return None
    raise RuntimeError(f"backward dq KernelConfig(impl='sm90') cannot run here: {reason}; use impl='triton'")
