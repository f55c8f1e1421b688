"""``te``: TransformerEngine ``DotProductAttention`` in ``thd`` format, bottom-right causal, cached per shape."""

from __future__ import annotations

import math
import sys

import torch

from longtrain import _optional

from ..meta import VarlenMeta

__all__ = ["SUMMARY", "TE_DPA_CACHE", "attention", "te_dpa", "unavailable_reason"]

SUMMARY = "TransformerEngine DotProductAttention, thd format (CUDA, fp16/bf16, no dropout)"
_HALF = (torch.float16, torch.bfloat16)

#: Process-lifetime cache of the TE modules, keyed ``(Hq, Hkv, D, round(scale, 10), device, dtype, mask type)``.
TE_DPA_CACHE: dict = {}


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Documented order: dtype (fp16/bf16), then CUDA, then TransformerEngine."""
    if dtype not in _HALF:
        return f"varlen CP attention needs fp16/bf16, got {dtype}"
    if device.type != "cuda":
        return f"varlen CP attention requires CUDA, got device={device}"
    if "transformer_engine" in sys.modules:
        return None
    ok, reason = _optional.transformer_engine()
    return None if ok else f"TransformerEngine varlen kernel is unavailable ({reason})"


def te_dpa(num_q_heads, num_kv_heads, head_dim, scale, device, dtype, causal: bool = True, cache: dict | None = None):
    """The cached ``DotProductAttention`` for a shape: ``attn_mask_type="padding_causal_bottom_right"`` (the local
    queries are a suffix of a straddling document's keys) or ``"padding"``, ``qkv_format="thd"``. ``scale`` must be
    a number (resolve None to ``D**-0.5`` first). ``cache`` defaults to :data:`TE_DPA_CACHE`."""
    cache = TE_DPA_CACHE if cache is None else cache
    mask_type = "padding_causal_bottom_right" if causal else "padding"
    key = (int(num_q_heads), int(num_kv_heads), int(head_dim), round(float(scale), 10), str(device), str(dtype))
    if not causal:
        key = (*key, mask_type)
    module = cache.get(key)
    if module is None:
        try:
            import transformer_engine.pytorch as te
        except ImportError as exc:
            reason = _optional.transformer_engine()[1] or str(exc)
            raise type(exc)(
                f"TransformerEngine DotProductAttention is unavailable because {reason}; pick "
                "another varlen backend (configure_cp_varlen(attn_backend=...)).",
                name=exc.name,
            ) from exc

        module = te.DotProductAttention(
            num_attention_heads=int(num_q_heads),
            kv_channels=int(head_dim),
            num_gqa_groups=int(num_kv_heads),
            attn_mask_type=mask_type,
            qkv_format="thd",
            softmax_scale=float(scale),
        )
        module = module.to(device)
        cache[key] = module
    return module


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
        raise ValueError(f"TransformerEngine THD varlen cannot apply attention dropout (got dropout_p={dropout_p})")
    hq, head_dim = q.shape[1], q.shape[2]
    te_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    dpa = te_dpa(hq, k.shape[1], head_dim, te_scale, q.device, q.dtype, causal)
    out = dpa(q, k, v, cu_seqlens_q=meta.cu_q, cu_seqlens_kv=meta.cu_k, max_seqlen_q=meta.max_q,
              max_seqlen_kv=meta.max_k)  # fmt: skip
    return out.reshape(q.shape[0], hq, head_dim)
