"""``fa4``: FlashAttention-4 (the flash-attn-4 package, ``flash_attn.cute``): CuTe DSL varlen kernels, SM90/SM100.

Causal attention in FlashAttention-4 is aligned bottom-right (a query row ``i`` of a document with ``Lq`` queries
and ``Lk`` keys sees the keys ``j <= i + Lk - Lq``), which is the provider contract; GQA is native. Its kernels
are JIT-compiled on first use per static shape (``longtrain.prewarm``'s ``blockdiag_autotune`` does that before
step 1). No dropout.
"""

from __future__ import annotations

import torch

from longtrain import _optional

from ..meta import VarlenMeta

__all__ = ["SUMMARY", "attention", "fa4_backward", "fa4_forward", "unavailable_reason"]

SUMMARY = "FlashAttention-4 varlen (flash-attn-4 CuTe DSL kernels; CUDA SM90/SM100, fp16/bf16, no dropout)"
_HALF = (torch.float16, torch.bfloat16)


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """dtype (fp16/bf16), then CUDA, then an SM90/SM100 GPU, then the package."""
    if dtype not in _HALF:
        return f"FlashAttention-4 needs fp16/bf16, got {dtype}"
    if device.type != "cuda":
        return f"FlashAttention-4 requires CUDA, got device={device}"
    ok, reason = _optional.cuda_sm(9, 0)
    if not ok:
        return f"FlashAttention-4 {reason}"
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FlashAttention-4 runs on SM90/SM100 here, this GPU is SM{major}x"
    ok, reason = _optional.fa4()
    return None if ok else reason


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` -> ``[n_real, Hq, D]`` (the provider contract)."""
    if dropout_p:
        raise ValueError(f"FlashAttention-4 has no attention dropout (got dropout_p={dropout_p})")
    from flash_attn.cute import flash_attn_varlen_func

    res = flash_attn_varlen_func(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=meta.cu_q, cu_seqlens_k=meta.cu_k,
        max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_k, softmax_scale=scale, causal=causal,
        deterministic=deterministic,
    )  # fmt: skip
    return res[0] if isinstance(res, tuple) else res


def fa4_forward(q, k, v, meta: VarlenMeta, *, scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-4's forward alone: ``(out [n_real, Hq, D], lse [Hq, n_real] fp32)``, natural-log log-sum-exp."""
    from flash_attn.cute.interface import _flash_attn_fwd

    res = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=meta.cu_q, cu_seqlens_k=meta.cu_k, max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_k,
        softmax_scale=float(scale), causal=causal, return_lse=True,
    )  # fmt: skip
    return res[0], res[1]


def fa4_backward(dout, q, k, v, out, lse, meta: VarlenMeta, *, scale: float, causal: bool = True,
                 deterministic: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """FlashAttention-4's backward from any forward's ``out`` and ``lse [Hq, n_real]``: ``(dq, dk, dv)``."""
    from flash_attn.cute.interface import _flash_attn_bwd

    res = _flash_attn_bwd(q, k, v, out, dout, lse.contiguous(), float(scale), causal, cu_seqlens_q=meta.cu_q,
                          cu_seqlens_k=meta.cu_k, max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_k,
                          deterministic=bool(deterministic))  # fmt: skip
    return res[0], res[1], res[2]
