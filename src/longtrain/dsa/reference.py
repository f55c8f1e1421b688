"""Plain-torch reference math for DSA: eligible keys, indexer scores, top-k, sparse MLA attention.

Written for clarity, not speed: every function materialises its dense intermediate (``[T_q, T_k]`` scores,
``[T_q, K, D]`` gathered keys). They run on any device in any float dtype and are exact in float64, which is
how the tests use them as oracles (on CPU). The ``"torch"`` backend of :mod:`longtrain.dsa.ops` applies them
to row chunks.

Notation: ``T_q`` query rows, ``T_k`` key rows (global padded-storage coordinates), ``H`` attention heads,
``H_I`` indexer heads, ``D_I`` indexer head dim, ``D_qk`` latent query/key width, ``d_v`` value width (the
value of key ``j`` is ``kv[j, 0, :d_v]``), ``K`` top-k width.
"""

from __future__ import annotations

import torch

from longtrain.dsa.metadata import CudnnDsaPackedMetadata

__all__ = [
    "compute_dtype",
    "FP8_E4M3_MAX",
    "eligible_key_mask",
    "fp8_pow2_scales",
    "fp8_rows",
    "indexer_fp8_operands",
    "indexer_scores",
    "indexer_topk_reference",
    "selected_rows",
    "sparse_mla_on_keys",
    "sparse_mla_reference",
]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (half-precision inputs accumulate in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _window_mask(starts: torch.Tensor, causal_lengths: torch.Tensor, total_key_tokens: int) -> torch.Tensor:
    """``[T_q, T_k] bool``: key ``s`` is in ``[starts[t], starts[t] + causal_lengths[t])``."""
    keys = torch.arange(total_key_tokens, device=starts.device, dtype=torch.int64)
    lo = starts.to(torch.int64)[:, None]
    hi = lo + causal_lengths.to(torch.int64)[:, None]
    return (keys[None, :] >= lo) & (keys[None, :] < hi)


def eligible_key_mask(metadata: CudnnDsaPackedMetadata, total_key_tokens: int) -> torch.Tensor:
    """``[T_q, T_k] bool``: True where key ``s`` is eligible for query ``t``.

    Eligible = same document, causal (self included), never a padding key; padding query rows have no
    eligible key. Derived from ``metadata.starts`` / ``metadata.causal_lengths``.
    """
    return _window_mask(metadata.starts, metadata.causal_lengths, total_key_tokens)


def indexer_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, head_weights: torch.Tensor, eligible: torch.Tensor
) -> torch.Tensor:
    """Lightning-indexer scores ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``, ``-inf`` where not eligible.

    Args:
        index_q: ``[T_q, H_I, D_I]`` float.
        index_k: ``[T_k, D_I]`` float.
        head_weights: ``[T_q, H_I]`` float, already scaled (``H_I**-0.5 * D_I**-0.5`` folded in by the caller).
        eligible: ``[T_q, T_k] bool``.

    Returns:
        ``[T_q, T_k]`` in float64 when any input is float64, else float32.
    """
    dtype = compute_dtype(index_q, index_k, head_weights)
    logits = torch.einsum("thd,sd->ths", index_q.to(dtype), index_k.to(dtype))
    scores = torch.einsum("th,ths->ts", head_weights.to(dtype), logits.clamp_min(0))
    return scores.masked_fill(~eligible, float("-inf"))


#: Largest finite ``float8_e4m3fn`` value.
FP8_E4M3_MAX = 448.0


def fp8_pow2_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)`` float32 for row maxima ``amax >= 0``: the smallest power of two with
    ``amax / scale <= 448`` (at least ``2**-126``; 1 for ``amax == 0``), read off the float32 bits exactly.

    With ``amax = f * 2**e`` (``1 <= f < 2``) and ``448 = 1.75 * 2**8``, that power is ``2**(e - 8)`` when
    ``f <= 1.75`` and ``2**(e - 7)`` otherwise: integer arithmetic on the exponent and mantissa bits, the same on
    every device (the FP8 kernels compute it so too).
    """
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    k = torch.where(mantissa <= 0x600000, exponent - 8, exponent - 7).clamp(-126, 127)
    scale = ((k + 127) << 23).view(torch.float32)
    inverse = ((127 - k) << 23).view(torch.float32)
    zero = ~(amax > 0)
    return scale.masked_fill(zero, 1.0), inverse.masked_fill(zero, 1.0)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of ``x`` with one power-of-two scale per row of its last dimension: ``x ~ codes * scale``.

    ``scale``: :func:`fp8_pow2_scales` of the row's ``max |x|``, so every ``x / scale`` lies in ``[-448, 448]`` and
    the rescale is exact: the only error is the rounding of ``x / scale`` to E4M3 (round to nearest even; 3
    mantissa bits). A power of two also keeps ``codes * scale`` exact in float32 (and in bf16).

    Returns:
        ``(codes`` like ``x`` in ``torch.float8_e4m3fn``, ``scale`` ``x.shape[:-1]`` float32``)``.
    """
    xf = x.detach().to(torch.float32)
    scale, inverse = fp8_pow2_scales(xf.abs().amax(dim=-1))
    return (xf * inverse[..., None]).to(torch.float8_e4m3fn), scale


def indexer_fp8_operands(
    index_q: torch.Tensor, index_k: torch.Tensor, head_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 indexer's operands: ``(q8 [T_q, H_I, D_I], k8 [T_k, D_I])`` E4M3 codes (:func:`fp8_rows`: a scale per
    query row and head, one per key row), ``weights [T_q, H_I]`` float32 = ``head_weights`` times the query scales,
    and ``k_scale [T_k]`` float32.

    The FP8 scores are ``I8[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q8[t, h] . k8[s])``: the indexer scores
    of the dequantized inputs (the scales are positive, so they pass through ``relu``), as DeepSeek-V3.2 computes its
    indexer. :func:`indexer_topk_reference` of ``(q8, k8 * k_scale, weights)`` in float32 or float64 is their
    reference selection.
    """
    q8, q_scale = fp8_rows(index_q)
    k8, k_scale = fp8_rows(index_k)
    return q8, k8, head_weights.to(torch.float32) * q_scale, k_scale


def indexer_topk_reference(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    index_topk: int,
) -> torch.Tensor:
    """Indexer top-k in the canonical form: ``[T_q, K] int32``.

    Row ``t`` selects the ``min(K, causal_lengths[t])`` keys with the largest :func:`indexer_scores` among
    ``[starts[t], starts[t] + causal_lengths[t])`` (clipped to the key rows ``[0, T_k)``); equal scores are broken
    toward the smaller key index. The row holds the selected global key indices in ascending order followed by
    ``-1``.
    """
    total_keys = index_k.shape[0]
    eligible = _window_mask(starts, causal_lengths, total_keys)
    scores = indexer_scores(index_q, index_k, head_weights, eligible)
    # A stable descending sort keeps equal scores in increasing key order; eligible keys have finite scores
    # and therefore precede every ineligible (-inf) column.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    width = min(index_topk, total_keys)
    chosen = order[:, :width]
    # The row's keys that exist: a window reaching past the key rows is clipped to them (as the kernels clip it).
    count = torch.clamp(eligible.sum(dim=1), max=index_topk)[:, None]
    slot = torch.arange(width, device=chosen.device)[None, :]
    # Sort the selected prefix ascending; unselected slots get a key larger than any index, then -1.
    chosen = torch.where(slot < count, chosen, total_keys).sort(dim=1).values
    chosen = torch.where(chosen < total_keys, chosen, -1)
    out = torch.full((chosen.shape[0], index_topk), -1, dtype=torch.int32, device=chosen.device)
    out[:, :width] = chosen.to(torch.int32)
    return out


def sparse_mla_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention over selected keys, differentiable by autograd in ``q``, ``kv`` and ``attn_sink``.

    For row ``t``, head ``h`` and the slot list ``S_t`` (slots ``< topk_length[t]`` holding an index in
    ``[0, T_k)``; duplicates count with multiplicity): ``z_j = scale * q[t, h] . kv[j]``,
    ``lse = log sum_j exp(z_j)`` (natural log, sink excluded), ``p_j = exp(z_j - log(exp(lse) + exp(sink_h)))``
    and ``out[t, h] = sum_j p_j * kv[j, :d_v]``. A row with no valid slot gives ``out = 0`` exactly,
    ``lse = -inf`` and zero gradients (never NaN).

    Args:
        q: ``[T_q, H, D_qk]`` float.
        kv: ``[T_k, 1, D_qk]`` float (one latent head shared by every query head).
        topk_indices: ``[T_q, K]`` or ``[T_q, 1, K]`` integer global key rows; ``-1`` (or any value outside
            ``[0, T_k)``) marks an unused slot.
        softmax_scale: the logit scale.
        d_v: value width, ``<= D_qk``.
        topk_length: optional ``[T_q]`` integer count of leading slots to use; later slots are ignored.
        attn_sink: optional ``[H]`` per-head sink logit (an extra logit with a zero value); ``-inf`` = none.

    Returns:
        ``(out [T_q, H, d_v]`` in ``q.dtype``, ``lse [T_q, H]`` float32, or float64 for float64 inputs).
    """
    rows, valid = selected_rows(topk_indices, kv.shape[0], topk_length)
    keys = kv[:, 0].to(compute_dtype(q, kv))[rows]  # [T_q, K, D_qk]
    return sparse_mla_on_keys(q, keys, valid, softmax_scale, d_v=d_v, attn_sink=attn_sink)


def selected_rows(
    topk_indices: torch.Tensor, total_keys: int, topk_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [T_q, K] int64, valid [T_q, K] bool)``: each slot's key row (an unused slot clamped into range) and
    whether the slot is used (an index in ``[0, total_keys)`` within the row's ``topk_length``)."""
    idx = topk_indices.reshape(topk_indices.shape[0], topk_indices.shape[-1]).to(torch.int64)
    valid = (idx >= 0) & (idx < total_keys)
    if topk_length is not None:
        slot = torch.arange(idx.shape[1], device=idx.device)
        valid &= slot[None, :] < topk_length.to(torch.int64)[:, None]
    return idx.clamp(0, total_keys - 1), valid


def sparse_mla_on_keys(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    softmax_scale: float,
    *,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_reference` on keys already gathered per slot: ``keys: [T_q, K, D_qk]`` in the compute dtype
    (float32, or float64), ``valid: [T_q, K] bool`` (:func:`selected_rows`); differentiable in ``q``, ``keys`` and
    ``attn_sink`` (the gradient of an unused slot's key is exactly 0)."""
    dtype = keys.dtype
    # An ignored slot contributes nothing, whatever the row it clamps to holds (0 * NaN would be NaN).
    keys = torch.where(valid[..., None], keys, keys.new_zeros(()))
    logits = softmax_scale * torch.einsum("thd,tkd->thk", q.to(dtype), keys)
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    # Any finite shift gives the same result; a detached one keeps exp() in range without affecting gradients.
    shift = logits.amax(dim=-1).detach()
    if attn_sink is not None:
        shift = torch.maximum(shift, attn_sink.detach().to(dtype)[None, :])
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weights = torch.exp(logits - shift[..., None])  # exactly 0 on unused slots
    kv_mass = weights.sum(dim=-1)
    denominator = kv_mass
    if attn_sink is not None:
        denominator = kv_mass + torch.exp(attn_sink.to(dtype)[None, :] - shift)
    # Only an exact 0 (no key, no sink) is replaced: a NaN sink leaves a NaN denominator, so its head's rows are NaN
    # (as in sparse_mla_attention) rather than the unnormalized weighted sum.
    empty = denominator == 0
    probs = weights / torch.where(empty, torch.ones_like(denominator), denominator)[..., None]
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :d_v])
    has_keys = kv_mass > 0
    lse = torch.where(
        has_keys, shift + torch.log(torch.where(has_keys, kv_mass, torch.ones_like(kv_mass))), float("-inf")
    )
    return out.to(q.dtype), lse
