"""Sparse MLA attention on the Triton kernels: the checked public function, its unchecked body, autograd wiring."""

from __future__ import annotations

import dataclasses
import math

import torch

from longtrain._autograd import differentiable_once
from longtrain.dsa._checks import check_float, check_int, check_same_device
from longtrain.dsa.triton._common import (
    TRITON_DTYPES,
    KernelConfig,
    SparseMLAConfig,
    require_available,
    sparse_mla_unfit,
)

__all__ = ["SparseMLAFunction", "flash_mla_style_fwd", "sparse_mla_triton", "sparse_mla_triton_unchecked"]


class SparseMLAFunction(torch.autograd.Function):
    """Autograd wrapper: forward keeps ``(q, kv, idx, topk_length, sink, out, lse)`` for the backward."""

    @staticmethod
    def forward(ctx, q, kv2d, idx, softmax_scale, d_v, topk_length, attn_sink, deterministic, config):
        from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

        out, lse = sparse_mla_fwd(q, kv2d, idx, softmax_scale, d_v, topk_length, attn_sink, config.fwd)
        ctx.save_for_backward(q, kv2d, idx, topk_length, attn_sink, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.d_v = d_v
        ctx.deterministic = deterministic
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @differentiable_once("sparse_mla_attention (triton backend)")
    def backward(ctx, dout, _dlse):
        from longtrain.dsa.triton.sparse_mla_bwd import sparse_mla_bwd

        q, kv2d, idx, topk_length, attn_sink, out, lse = ctx.saved_tensors
        dq, dkv, dsink = sparse_mla_bwd(
            q,
            kv2d,
            out,
            dout,
            lse,
            idx,
            ctx.softmax_scale,
            ctx.d_v,
            topk_length,
            attn_sink,
            deterministic=ctx.deterministic,
            compute_dkv=ctx.needs_input_grad[1],
            configs=ctx.config.backward_configs(),
        )
        if not ctx.needs_input_grad[6]:
            dsink = None
        return dq, dkv, None, None, None, None, dsink, None, None


def _validate(q, kv, topk_indices, softmax_scale, d_v, topk_length, attn_sink, config):
    """The checks of :func:`sparse_mla_triton` when it is called directly (``longtrain.dsa.ops`` runs its own, once,
    and calls :func:`sparse_mla_triton_unchecked`); returns ``(indices [T, K], config)``."""
    check_float("q", q, "[T, H, D_qk]", TRITON_DTYPES)
    check_float("kv", kv, "[T_k, 1, D_qk]", TRITON_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D_qk], got shape {tuple(q.shape)}")
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv must have one latent head [T_k, 1, D_qk], got shape {tuple(kv.shape)}")
    elif kv.dim() != 2:
        raise ValueError(f"kv must be [T_k, 1, D_qk] (or [T_k, D_qk]), got shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"q and kv must share a dtype, got q {q.dtype} and kv {kv.dtype}")
    num_tokens, num_heads, d_qk = q.shape
    if kv.shape[-1] != d_qk:
        raise ValueError(f"kv's last dim must equal q's D_qk={d_qk}, got kv shape {tuple(kv.shape)}")
    unfit = sparse_mla_unfit(q.dtype, num_heads, d_qk, d_v)
    if unfit is not None:
        raise unfit[0](unfit[1])
    check_int("topk_indices", topk_indices, "[T, K]")
    if topk_indices.dim() == 3 and topk_indices.shape[1] == 1:
        topk_indices = topk_indices[:, 0]
    if topk_indices.dim() != 2 or topk_indices.shape[0] != num_tokens:
        raise ValueError(f"topk_indices must be [T={num_tokens}, K] (or [T, 1, K]), got {tuple(topk_indices.shape)}")
    if topk_indices.shape[1] < 1:
        raise ValueError("topk_indices must have at least one slot per row (K >= 1)")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a finite positive float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise TypeError(f"softmax_scale must be a finite positive float, got {softmax_scale!r}")
    if topk_length is not None:
        check_int("topk_length", topk_length, f"[T={num_tokens}]")
        if topk_length.shape != (num_tokens,):
            raise ValueError(f"topk_length must be [T={num_tokens}], got {tuple(topk_length.shape)}")
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or not attn_sink.dtype.is_floating_point:
            raise TypeError(
                f"attn_sink must be a float tensor [H={num_heads}], got {getattr(attn_sink, 'dtype', None)}"
            )
        if attn_sink.shape != (num_heads,):
            raise ValueError(f"attn_sink must be [H={num_heads}], got {tuple(attn_sink.shape)}")
    check_same_device(q.device, kv=kv, topk_indices=topk_indices, topk_length=topk_length, attn_sink=attn_sink)
    if config is not None and not isinstance(config, (SparseMLAConfig, KernelConfig)):
        raise TypeError(f"config must be a SparseMLAConfig, a KernelConfig or None, got {type(config).__name__}")
    return topk_indices, config


def sparse_mla_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    deterministic: bool = False,
    config: SparseMLAConfig | KernelConfig | None = None,
) -> torch.Tensor:
    """Sparse MLA attention over each row's selected keys (Triton), differentiable in q, kv and attn_sink.

    For row ``t`` and head ``h`` over the slot list ``S_t`` (slots ``< topk_length[t]`` whose index lies in
    ``[0, T_k)``; duplicates count with multiplicity): ``z_j = softmax_scale * q[t, h] . kv[j]``,
    ``p_j = exp(z_j) / (sum_i exp(z_i) + exp(attn_sink[h]))``, ``out[t, h] = sum_j p_j * kv[j, :d_v]``.
    Rows without a valid slot give exact zeros (output and gradients). Softmax and accumulation in fp32.

    Args:
        q: ``[T, H, D_qk]`` bf16/fp16/fp32 (D_qk = 576 for GLM-5.2, 512 for K=V models).
        kv: ``[T_k, 1, D_qk]`` (or ``[T_k, D_qk]``), same dtype; the value is ``kv[..., :d_v]``.
        topk_indices: ``[T, K]`` (or ``[T, 1, K]``) int32/int64 global key rows; ``-1`` or out of range = unused.
        softmax_scale: logit scale (a finite positive float).
        d_v: value width, a multiple of 16, ``<= D_qk``.
        topk_length: optional ``[T]`` int count of leading slots to use per row.
        attn_sink: optional ``[H]`` float per-head sink logit (``-inf`` = none), read in fp32.
        deterministic: reduce ``dkv`` in a fixed order (bitwise reproducible, slower) instead of atomics.
        config: forced launch configuration(s); ``None`` = autotuned on first use per static shape. A bare
            ``KernelConfig`` forces every kernel (its ``layout`` and ``impl`` are the forward's: the backward runs
            the portable kernels); ``SparseMLAConfig`` sets them one by one.

    Returns:
        ``out: [T, H, d_v]`` in q's dtype.
    """
    topk_indices, config = _validate(q, kv, topk_indices, softmax_scale, d_v, topk_length, attn_sink, config)
    require_available(q.device)
    return sparse_mla_triton_unchecked(
        q, kv, topk_indices, softmax_scale, d_v, topk_length, attn_sink, bool(deterministic), config
    )


_DEFAULT_CONFIG = SparseMLAConfig()


def sparse_mla_triton_unchecked(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    deterministic: bool = False,
    config: SparseMLAConfig | KernelConfig | None = None,
) -> torch.Tensor:
    """:func:`sparse_mla_triton` without its checks, for callers that validated the call already (the public op).

    Takes what :func:`sparse_mla_triton` documents, with ``topk_indices: [T, K]`` and every input on a device where
    the kernels run; runs no check (a bad shape is an error from inside the kernel launch, or worse).
    """
    kv2d = kv.reshape(kv.shape[0], kv.shape[-1]).contiguous()
    if topk_indices.dtype == torch.int64:
        # Out-of-range int64 values must stay invalid after narrowing, not wrap into a real row.
        bad = (topk_indices < 0) | (topk_indices >= kv2d.shape[0])
        topk_indices = topk_indices.masked_fill(bad, -1)
    idx = topk_indices.to(torch.int32).contiguous()
    length = None
    if topk_length is not None:
        length = topk_length.clamp(0, idx.shape[1]).to(torch.int32).contiguous()
    # The kernels read the sink in fp32; autograd casts its gradient back to the caller's dtype.
    sink = attn_sink.to(torch.float32).contiguous() if attn_sink is not None else None
    if config is None:
        config = _DEFAULT_CONFIG
    elif isinstance(config, KernelConfig):
        # One config for every kernel: its layout and impl are the forward's; the backward runs the portable kernels.
        config = SparseMLAConfig(fwd=config, bwd=dataclasses.replace(config, layout="heads", impl="triton"))
    out, _ = SparseMLAFunction.apply(
        q.contiguous(), kv2d, idx, float(softmax_scale), d_v, length, sink, deterministic, config
    )
    return out


def flash_mla_style_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    d_v: int,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    indexer_topk: int = 0,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """Our sparse MLA forward behind FlashMLA's ``flash_mla_sparse_fwd`` call convention (no autograd).

    Args:
        q: ``[T, H, D_qk]`` bf16/fp16; kv: ``[T_k, 1, D_qk]``; indices: ``[T, 1, K]`` int32 (``-1`` = unused);
        attn_sink: ``[H]`` fp32 (``-inf`` = none) or None; topk_length: ``[T]`` int32 or None;
        indexer_topk: unused (FlashMLA's fused-indexer switch; must be 0).

    Returns:
        ``(out [T, H, d_v], None, lse [T, H] fp32)``: natural-log, sink-excluded log-sum-exp, ``+inf`` for rows
        without keys (FlashMLA's convention; their ``out`` is zero). No max-logits output.
    """
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    if indexer_topk:
        raise ValueError(f"flash_mla_style_fwd has no fused indexer: indexer_topk must be 0, got {indexer_topk}")
    kv2d = kv.reshape(kv.shape[0], kv.shape[-1]).contiguous()
    out, lse = sparse_mla_fwd(
        q.contiguous(), kv2d, indices[:, 0].contiguous(), float(sm_scale), d_v, topk_length, attn_sink, None
    )
    return out, None, torch.where(torch.isneginf(lse), math.inf, lse)
