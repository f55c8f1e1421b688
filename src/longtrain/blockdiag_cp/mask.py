"""The dense reference of block-diagonal attention: the boolean mask and masked SDPA.

Every varlen provider is checked against this path, and it is the fallback the all-gather path takes when a
varlen kernel declines. It builds an ``[L, S]`` mask, so it is O(L·S) memory: a correctness tool, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .meta import VarlenMeta

__all__ = [
    "ORIGINAL_SDPA",
    "blockdiag_mask",
    "dense_blockdiag_sdpa",
    "finite_or_zero",
    "masked_sdpa",
    "nonfinite_tokens",
    "repeat_kv",
    "rows_seeing",
    "segment_mask",
]

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
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be a [B, S] or [S] tensor, got shape {tuple(doc_ids.shape)}")
    seq_len = doc_ids.shape[-1]
    # Plain ints only (a tensor offset would sync the host); a chunk past the end would otherwise broadcast a
    # one-row slice over every query row and return a wrong mask without an error.
    if isinstance(row_offset, int) and isinstance(local_len, int) and isinstance(full_len, int):
        if row_offset < 0 or local_len < 0 or row_offset + local_len > seq_len:
            raise ValueError(
                f"query rows [{row_offset}, {row_offset + local_len}) must lie inside the doc_ids row of length "
                f"{seq_len}; pass the full padded row's ids and this rank's row_offset/local_len"
            )
        if not 0 <= full_len <= seq_len:
            raise ValueError(f"full_len={full_len} key columns must be in [0, {seq_len}] (the doc_ids row length)")
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


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every non-finite element replaced by 0 (identity, bit for bit, on finite input)."""
    return torch.where(torch.isfinite(x), x, x.new_zeros(()))


def nonfinite_tokens(x: torch.Tensor, token_dim: int) -> torch.Tensor:
    """Bool ``[T]`` (the sizes of ``x`` up to ``token_dim``): token ``t`` holds a non-finite value in any head/dim."""
    return ~torch.isfinite(x).flatten(token_dim + 1).all(-1)


def rows_seeing(meta: VarlenMeta, bad_keys: torch.Tensor, query_len: int, causal: bool) -> torch.Tensor:
    """Bool ``[query_len]``: query row ``i`` attends (under ``meta``, bottom-right causal or not) a key flagged in
    ``bad_keys [key_len]``. Device ops on the cached row tables, no sync."""
    key_len = bad_keys.numel()
    doc_q, doc_k, q_lim = meta.row_tables(query_len, key_len, bad_keys.device)
    big = key_len + 1
    first = torch.full((meta.n_docs + 1,), big, dtype=torch.int64, device=bad_keys.device)
    pos = torch.arange(key_len, device=bad_keys.device)
    in_doc = doc_k >= 0
    # the first flagged key of every segment (slot n_docs collects keys outside every segment)
    first.scatter_reduce_(0, torch.where(in_doc, doc_k.long(), meta.n_docs), torch.where(bad_keys, pos, big), "amin")
    seen = first[doc_q.long().clamp(min=0)]
    hit = seen <= q_lim if causal else seen < big
    return hit & (doc_q >= 0)


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

    A non-finite value never crosses a document: SDPA runs on inputs whose non-finite elements are zeroed (a
    masked-out NaN would otherwise reach every row through ``0 · NaN``), and every row that attends a non-finite
    query, key or value is NaN in the output (its gradients are zero).
    """
    del enable_gqa
    if query.dim() != 4 or key_full.dim() != 4 or key_full.shape != value_full.shape:
        raise ValueError(
            f"dense block-diagonal attention takes query [B, Hq, L, D] and key/value [B, Hkv, S, D] of equal shape, "
            f"got {tuple(query.shape)}, {tuple(key_full.shape)}, {tuple(value_full.shape)}"
        )
    if query.shape[-1] != key_full.shape[-1]:
        raise ValueError(f"query and key head dims differ: {query.shape[-1]} vs {key_full.shape[-1]}")
    bsz, _, local_len, _ = query.shape
    mask = blockdiag_mask(doc_ids, row_offset, local_len, key_full.shape[2], bsz).to(query.device)
    return masked_sdpa(query, key_full, value_full, mask, scale=scale, dropout_p=dropout_p)


def masked_sdpa(query, key_full, value_full, mask, *, scale=None, dropout_p=0.0) -> torch.Tensor:
    """SDPA under a boolean ``mask [B, 1, L, S]`` (EFFICIENT / MATH kernels, GQA by repeating K/V heads) that keeps
    a non-finite value inside the rows that attend it: SDPA runs on inputs whose non-finite elements are zeroed,
    and every row that attends a non-finite query, key or value is NaN (zero gradient)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key_full, value_full = repeat_kv(query, key_full, value_full)
    bad_keys = nonfinite_tokens(key_full.transpose(1, 2), 1) | nonfinite_tokens(value_full.transpose(1, 2), 1)
    bad_rows = (mask[:, 0] & bad_keys[:, None, :]).any(-1) | nonfinite_tokens(query.transpose(1, 2), 1)  # [B, L]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = ORIGINAL_SDPA(
            finite_or_zero(query), finite_or_zero(key_full), finite_or_zero(value_full), attn_mask=mask,
            dropout_p=dropout_p, is_causal=False, scale=scale,
        )  # fmt: skip
    return out.masked_fill(bad_rows[:, None, :, None], float("nan"))


def segment_mask(meta: VarlenMeta, query_len: int, key_len: int, device: torch.device, causal: bool) -> torch.Tensor:
    """Bool ``[query_len, key_len]``: query row ``i`` may see key index ``j`` (same segment, bottom-right causal).

    Rows ``>= meta.n_real`` see nothing. Built on device from :meth:`VarlenMeta.row_tables` (no sync).
    """
    doc_q, doc_k, q_lim = meta.row_tables(query_len, key_len, device)
    allow = doc_q[:, None] == doc_k[None, :]
    if causal:
        allow &= torch.arange(key_len, device=device, dtype=torch.int32)[None, :] <= q_lim[:, None]
    return allow
