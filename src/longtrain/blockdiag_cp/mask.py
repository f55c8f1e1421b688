"""The dense reference of block-diagonal attention: the boolean mask and masked SDPA.

Every varlen provider is checked against this path, and it is the fallback the all-gather path takes when a
varlen kernel declines. It builds an ``[L, S]`` mask, so it is O(L·S) memory: a correctness tool, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .meta import VarlenMeta

__all__ = ["ORIGINAL_SDPA", "blockdiag_mask", "dense_blockdiag_sdpa", "repeat_kv", "segment_mask"]

# Captured once at import: every stock SDPA call of this package goes through this object, so no
# interception of ``F.scaled_dot_product_attention`` (the cp = 1 path's function mode) can recurse into itself.
ORIGINAL_SDPA = F.scaled_dot_product_attention


def blockdiag_mask(
    doc_ids: torch.Tensor, row_offset: int, local_len: int, full_len: int, batch_size: int
) -> torch.Tensor:
    """Per-document causal attention mask, bool ``[B, 1, L, full_len]`` on ``doc_ids.device``.

    ``doc_ids: [B, S] or [S]`` integer (0 == padding) on the full padded sequence; query rows are the global
    positions ``[row_offset, row_offset + L)``, key columns ``[0, full_len)``. ``allow[b, 0, i, c]`` is
    ``doc[p] == doc[c] > 0 and p >= c`` with ``p = row_offset + i``, or ``p == c``: the diagonal is always
    allowed, so no row is fully masked (a padding row attends to itself; its output is dropped by the labels).
    """
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0).expand(batch_size, -1)
    device = doc_ids.device
    rows = torch.arange(row_offset, row_offset + local_len, device=device)
    cols = torch.arange(full_len, device=device)
    q_doc = doc_ids[:, row_offset : row_offset + local_len].unsqueeze(-1)
    k_doc = doc_ids[:, :full_len].unsqueeze(1)
    same = (q_doc == k_doc) & (q_doc > 0) & (k_doc > 0)
    causal = rows.unsqueeze(-1) >= cols.unsqueeze(0)
    diag = rows.unsqueeze(-1) == cols.unsqueeze(0)
    return ((same & causal) | diag).unsqueeze(1)


def repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_dim: int = 1):
    """``key``/``value`` with their heads (dim ``head_dim``) repeated to the query's head count (GQA)."""
    hq, hkv = query.shape[head_dim], key.shape[head_dim]
    if hq == hkv:
        return key, value
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"block-diagonal attention needs query heads ({hq}) to be a positive multiple of key/value heads "
            f"({hkv}); fix the model's num_key_value_heads"
        )
    return key.repeat_interleave(hq // hkv, dim=head_dim), value.repeat_interleave(hq // hkv, dim=head_dim)


def dense_blockdiag_sdpa(
    query: torch.Tensor,
    key_full: torch.Tensor,
    value_full: torch.Tensor,
    doc_ids: torch.Tensor,
    row_offset: int,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """:func:`blockdiag_mask` + SDPA restricted to the EFFICIENT / MATH kernels.

    ``query: [B, Hq, L, D]``, ``key_full/value_full: [B, Hkv, S, D]`` (key index = global position),
    ``doc_ids: [B, S] or [S]``; returns ``[B, Hq, L, D]``. Real rows equal the varlen path; a padding row
    attends only to itself. GQA is inferred whenever ``Hq != Hkv`` (``enable_gqa`` is accepted for signature
    compatibility and not required): K/V heads are repeated so SDPA stays on the memory-efficient kernel
    instead of materialising fp32 scores in the math kernel.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    del enable_gqa
    bsz, _, local_len, _ = query.shape
    key_full, value_full = repeat_kv(query, key_full, value_full)
    mask = blockdiag_mask(doc_ids, row_offset, local_len, key_full.shape[2], bsz).to(query.device)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return ORIGINAL_SDPA(
            query, key_full, value_full, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale
        )


def segment_mask(meta: VarlenMeta, query_len: int, key_len: int, device: torch.device, causal: bool) -> torch.Tensor:
    """Bool ``[query_len, key_len]``: query row ``i`` may see key index ``j`` (same segment, bottom-right causal).

    Rows ``>= meta.n_real`` see nothing. Built on device from :meth:`VarlenMeta.row_tables` (no sync).
    """
    doc_q, doc_k, q_lim = meta.row_tables(query_len, key_len, device)
    allow = doc_q[:, None] == doc_k[None, :]
    if causal:
        allow &= torch.arange(key_len, device=device, dtype=torch.int32)[None, :] <= q_lim[:, None]
    return allow
