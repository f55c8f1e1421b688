"""Dense and varlen block-diagonal attention kernels.

Packed documents (per-position document ids, 0 == padding, padding only as one tail, each document one
contiguous run) attend causally within their own document only; the sequence may be sharded contiguously
over context-parallel ranks, each rank holding the queries of ``[row_offset, row_offset + L)`` and the K/V
it needs. This module builds the dense mask (the fallback), the per-rank varlen segmentation and its
once-per-step precompute and validation, and drives the varlen providers of
:mod:`longtrain.blockdiag_cp.backends` (``cudnn``, ``flash``, ``te``, ``flex``, ``reference``).

Differences from the documented behaviour, all deliberate:

- ``precompute_blockdiag_varlen_meta`` validates the packed-layout preconditions (padding only as a tail,
  each document id one contiguous run) and raises ``ValueError`` instead of silently mis-segmenting.
- The all-padding zero output touches K/V through an empty slice (``k[..., :0].sum()``): exactly zero,
  attached to the autograd graph, zero gradients, and never NaN even when K/V hold inf/NaN.
- ``_cp_blockdiag_varlen`` accepts the canonical names of :data:`backends.ATTN_BACKENDS`; an unknown name is a
  ``ValueError`` (not "treated as flash"), ``"dense"``/``"sdpa"`` return None at once, ``"auto"`` resolves.
- Metadata validation compares devices with the CUDA index resolved (``cuda`` == ``cuda:0``), also checks
  ``first_q``/``first_k``/``max_tail`` when present, and keys its cache on the ``cu_q``/``cu_k`` objects too.
- The dense fallback :func:`dense_blockdiag_sdpa` infers GQA whenever ``Hq != Hkv``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from longtrain import _optional
from longtrain.blockdiag_cp import backends

__all__ = [
    "_cp_blockdiag_mask",
    "_cp_blockdiag_varlen",
    "_flash_varlen_with_long_prefix_guard",
    "_te_varlen_dpa",
    "_varlen_backend_unavailable_reason",
    "_varlen_metadata_unavailable_reason",
    "_varlen_seg_for_rank",
    "dense_blockdiag_sdpa",
    "precompute_blockdiag_varlen_meta",
]

logger = logging.getLogger(__name__)

_CP_FLASH_DETERMINISTIC = False
_CP_FLASH_ENGAGED = False
_CP_FLASH_LONG_SEGMENT_WARNED = False
_CP_FLASH_WARNED = False
_CP_TE_DROPOUT_WARNED = False
_CP_VARLEN_SHAPE_LOGGED = False
_TE_DPA_CACHE: dict = {}

_CP_FLEX_DROPOUT_WARNED = False
_CP_CUDNN_DROPOUT_WARNED = False
_META_FIELDS = ("s_first", "real_end", "cu_q", "cu_k", "max_q", "max_k")
_HALF = (torch.float16, torch.bfloat16)
_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if e
)


def _reraised_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that must pass through the varlen driver: OOM (the dense fallback needs more memory) and
    non-reentrant checkpoint's early-stop signal, which is control flow, not a kernel failure."""
    import torch.utils.checkpoint as checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return _OOM_ERRORS + ((stop,) if stop is not None else ())


def __getattr__(name: str) -> Any:
    # Import probes computed lazily so that importing this module never imports flash_attn or TE.
    if name == "HAS_FLASH_VARLEN":
        return backends.flash_attn_module() is not None
    if name == "HAS_TE":
        return _optional.transformer_engine()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has_flash_attn() -> bool:
    explicit = globals().get("HAS_FLASH_VARLEN")  # set by tests / users to force the answer
    if explicit is not None:
        return bool(explicit)
    return backends.flash_attn_module() is not None


# ----------------------------------------------------------------------------------------------------------
# dense mask
# ----------------------------------------------------------------------------------------------------------


def _cp_blockdiag_mask(
    doc_ids: torch.Tensor, row_offset: int, local_len: int, full_len: int, batch_size: int
) -> torch.Tensor:
    """Per-document causal attention mask for block-diagonal CP, shape [B, 1, L, S].

    ``doc_ids: [B, S] or [S]`` integer (0 == padding) on the full padded sequence; query rows are the global
    positions ``[row_offset, row_offset + L)``, key columns ``[0, full_len)``. ``allow[b, 0, i, c]`` is
    ``doc[p] == doc[c] > 0 and p >= c`` with ``p = row_offset + i``, or ``p == c``: the diagonal is always
    allowed so no row is fully masked (a padding row attends to itself; its output is dropped by the
    labels). Returns a bool ``[B, 1, L, full_len]`` tensor on ``doc_ids.device``.
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
    """The dense fallback: :func:`_cp_blockdiag_mask` + SDPA restricted to the EFFICIENT / MATH kernels.

    ``query: [B, Hq, L, D]``, ``key_full/value_full: [B, Hkv, S, D]`` (key index = global position),
    ``doc_ids: [B, S] or [S]``; returns ``[B, Hq, L, D]``. Real rows equal the varlen path; a padding row
    attends only to itself. GQA is inferred whenever ``Hq != Hkv`` (``enable_gqa`` is accepted for
    signature compatibility and not required): K/V heads are repeated so SDPA stays on the memory-efficient
    kernel instead of materialising fp32 scores in the math kernel. Calls the SDPA captured at import, so
    a patched ``F.scaled_dot_product_attention`` cannot recurse.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    del enable_gqa
    bsz, hq, local_len, _ = query.shape
    hkv, full_len = key_full.shape[1], key_full.shape[2]
    if hq != hkv:
        if hq % hkv:
            raise ValueError(
                f"dense block-diagonal attention needs query heads ({hq}) to be a multiple of key/value heads "
                f"({hkv}); fix the model's num_key_value_heads"
            )
        key_full = key_full.repeat_interleave(hq // hkv, dim=1)
        value_full = value_full.repeat_interleave(hq // hkv, dim=1)
    mask = _cp_blockdiag_mask(doc_ids, row_offset, local_len, full_len, bsz).to(query.device)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return backends.ORIGINAL_SDPA(
            query, key_full, value_full, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale
        )


# ----------------------------------------------------------------------------------------------------------
# segmentation, precompute, validation
# ----------------------------------------------------------------------------------------------------------


def _check_packed_layout(ids: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the host row ``ids: [S] int64`` satisfies P1 (padding only as a tail) and
    P2/P3 (each document id one contiguous run; ids >= 0)."""
    if ids.numel() == 0:
        return
    if bool((ids < 0).any()):
        pos = int((ids < 0).nonzero()[0])
        raise ValueError(f"doc_ids must be >= 0 (0 == padding); position {pos} holds {int(ids[pos])}")
    real = ids != 0
    n_real = int(real.sum())
    if n_real and not bool(real[:n_real].all()):
        pad = int((~real[:n_real]).nonzero()[0])
        late = n_real + int(real[n_real:].nonzero()[0])
        raise ValueError(
            "packed doc_ids must put padding (id 0) only as one contiguous tail: position "
            f"{pad} is padding but position {late} after it holds document {int(ids[late])}; "
            "pack documents first and pad at the end"
        )
    if n_real > 1:
        docs = ids[:n_real]
        starts = torch.cat([torch.ones(1, dtype=torch.bool), docs[1:] != docs[:-1]])
        run_ids = docs[starts]
        uniq, counts = torch.unique(run_ids, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            where = (starts & (docs == dup)).nonzero().flatten().tolist()
            raise ValueError(
                f"document id {dup} appears in {len(where)} separate runs (starting at positions {where[:8]}); "
                "each document must be one contiguous run and adjacent documents must have different ids"
            )


def _varlen_seg_for_rank(dids: torch.Tensor, row_offset: int, local_len: int, dev) -> dict | None:
    """Per-rank block-diagonal varlen segmentation for ONE packed sequence.

    ``dids: [S_full]`` integer ids (0 == pad) on any device; the query chunk is ``[row_offset,
    row_offset + local_len)``. Copies the prefix ``dids[:row_offset + local_len]`` to the host once (one sync
    when it lives on a GPU), run-length encodes the real rows and returns the metadata dict of the
    module docstring (``n_real, s_first, real_end, cu_q, cu_k, max_q, max_k, first_q, first_k, max_tail``,
    ``cu_*`` int32 on ``dev``), or None for an all-padding chunk. The rows it reads must satisfy the packed
    layout (real rows a prefix of the chunk); a violation there raises ``ValueError``.
    """
    row_offset, local_len = int(row_offset), int(local_len)
    host = dids.detach()[: row_offset + local_len].to("cpu", torch.int64)
    local = host[row_offset : row_offset + local_len]
    real = local > 0
    n_real = int(real.sum())
    if n_real == 0:
        return None
    if not bool(real[:n_real].all()):
        raise ValueError(
            f"packed layout violated in rows [{row_offset}, {row_offset + local_len}): padding (id 0) occurs "
            "before a real token; padding must be one contiguous tail"
        )
    docs = local[:n_real]
    bounds = [0, *((docs[1:] != docs[:-1]).nonzero().flatten() + 1).tolist(), n_real]
    seg_q = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    back = 0
    if row_offset > 0:
        differs = (host[:row_offset] != docs[0]).nonzero()
        back = row_offset if differs.numel() == 0 else row_offset - 1 - int(differs[-1])
    seg_k = list(seg_q)
    seg_k[0] += back
    cu_q, cu_k = [0], [0]
    for a, b in zip(seg_q, seg_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    return {
        "n_real": n_real,
        "s_first": row_offset - back,
        "real_end": row_offset + n_real,
        "cu_q": torch.tensor(cu_q, dtype=torch.int32, device=dev),
        "cu_k": torch.tensor(cu_k, dtype=torch.int32, device=dev),
        "max_q": max(seg_q),
        "max_k": max(seg_k),
        "first_q": seg_q[0],
        "first_k": seg_k[0],
        "max_tail": max(seg_q[1:], default=0),
    }


def precompute_blockdiag_varlen_meta(doc_ids: torch.Tensor, row_offset: int, local_len: int, device) -> dict:
    """Precompute this rank's varlen segmentation once per step.

    ``doc_ids: [B, S] (row 0 used: one packed sequence per rank) or [S]`` integer ids covering the full
    padded sequence. Copies the row to the host once, validates the packed layout (padding only as a
    tail, each document id one contiguous run; ``ValueError`` otherwise) and segments
    ``[row_offset, row_offset + local_len)`` with ``cu_q``/``cu_k`` on ``device``. Returns the dict consumed by
    :func:`_cp_blockdiag_varlen` (zero host syncs per layer), or ``{"n_real": 0}`` for an all-padding chunk.
    """
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"doc_ids must be a [B, S] or [S] tensor, got {got}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    row = doc_ids if doc_ids.dim() == 1 else doc_ids[0]
    row_offset, local_len = int(row_offset), int(local_len)
    if row_offset < 0 or local_len < 0 or row_offset + local_len > row.numel():
        raise ValueError(
            f"query chunk [{row_offset}, {row_offset + local_len}) is outside the doc_ids row of length {row.numel()}"
        )
    host = row.detach().to("cpu", torch.int64)
    _check_packed_layout(host)
    seg = _varlen_seg_for_rank(host, row_offset, local_len, device)
    return seg if seg is not None else {"n_real": 0}


def _varlen_metadata_unavailable_reason(meta: dict | None, query_len: int, key_len: int, device) -> str | None:
    """Validate every index consumed by a varlen CUDA kernel; a reason string when unsafe, else None.

    Never raises. The first full check of a meta copies ``cu_q``/``cu_k`` to the host (one sync); the result
    is cached in ``meta["_validation_cache"]`` (shared by shallow copies made after it exists) under
    ``(n_real, query_len, key_len, s_first, real_end, max_q, max_k, device, id(cu_q), id(cu_k))`` so later
    layers and activation-checkpoint recompute pay nothing. Devices compare with the index resolved.
    """
    if not isinstance(meta, dict):
        return "missing varlen metadata"
    try:
        n_real = int(meta["n_real"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"invalid n_real ({type(exc).__name__})"
    query_len, key_len = int(query_len), int(key_len)
    if not 0 <= n_real <= query_len:
        return f"n_real={n_real} is outside query length {query_len}"
    if n_real == 0:
        return None
    missing = [name for name in _META_FIELDS if name not in meta]
    if missing:
        return f"missing varlen metadata fields: {missing}"
    try:
        s_first, real_end, max_q, max_k = (int(meta[k]) for k in ("s_first", "real_end", "max_q", "max_k"))
    except (TypeError, ValueError) as exc:
        return f"non-integral varlen scalar metadata ({type(exc).__name__})"
    try:
        dev = backends.resolve_device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"invalid device {device!r} ({type(exc).__name__})"
    sig = (n_real, query_len, key_len, s_first, real_end, max_q, max_k, str(dev), id(meta["cu_q"]), id(meta["cu_k"]))
    cache = meta.setdefault("_validation_cache", {})
    if sig in cache:
        return cache[sig]
    reason = _validate_meta_uncached(meta, n_real, query_len, key_len, s_first, real_end, max_q, max_k, dev)
    cache[sig] = reason
    return reason


def _validate_meta_uncached(meta, n_real, query_len, key_len, s_first, real_end, max_q, max_k, dev) -> str | None:
    if not 0 <= s_first <= real_end <= key_len:
        return f"K/V slice [{s_first}, {real_end}) is outside key length {key_len}"
    for name in ("cu_q", "cu_k"):
        cu = meta[name]
        if not isinstance(cu, torch.Tensor):
            return f"{name} is not a tensor"
        if cu.dtype != torch.int32:
            return f"{name} must be int32, got {cu.dtype}"
        if backends.resolve_device(cu.device) != dev:
            return f"{name} is on {cu.device}, expected {dev}"
        if cu.dim() != 1 or cu.numel() < 2:
            return f"{name} must be a 1D tensor with at least two entries"
        if not cu.is_contiguous():
            return f"{name} must be contiguous"
    cu_q_t, cu_k_t = meta["cu_q"], meta["cu_k"]
    if cu_q_t.numel() != cu_k_t.numel():
        return f"cu_q/cu_k segment counts differ: {cu_q_t.numel() - 1} vs {cu_k_t.numel() - 1}"
    host = torch.cat([cu_q_t, cu_k_t]).tolist()  # the one sync per (step, signature)
    cu_q, cu_k = host[: cu_q_t.numel()], host[cu_q_t.numel() :]
    first_q, first_k, max_tail = (int(meta.get(k, 0) or 0) for k in ("first_q", "first_k", "max_tail"))
    meta["_validation_snapshot"] = {
        "n_real": n_real,
        "query_len": query_len,
        "key_len": key_len,
        "s_first": s_first,
        "real_end": real_end,
        "max_q": max_q,
        "max_k": max_k,
        "first_q": first_q,
        "first_k": first_k,
        "max_tail": max_tail,
        "cu_q": cu_q,
        "cu_k": cu_k,
    }
    if cu_q[0] != 0 or cu_k[0] != 0:
        return "cu_q and cu_k must start at zero"
    q_lens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    if min(q_lens) <= 0 or min(k_lens) <= 0:
        return "cu_q/cu_k must be strictly increasing"
    if cu_q[-1] != n_real:
        return f"cu_q[-1]={cu_q[-1]} does not equal n_real={n_real}"
    if cu_k[-1] != real_end - s_first:
        return f"cu_k[-1]={cu_k[-1]} does not equal K/V slice length {real_end - s_first}"
    if k_lens[0] < q_lens[0] or k_lens[1:] != q_lens[1:]:
        return "only the first local document may have more K/V than Q tokens"
    if max_q != max(q_lens) or max_k != max(k_lens):
        return f"max_seqlen mismatch: supplied q/k={max_q}/{max_k}, actual={max(q_lens)}/{max(k_lens)}"
    tail = max(q_lens[1:], default=0)
    if (first_q > 0 and first_q != q_lens[0]) or (first_k > 0 and first_k != k_lens[0]) or max_tail > tail:
        return (
            f"first segment metadata mismatch: supplied first_q/first_k/max_tail={first_q}/{first_k}/{max_tail}, "
            f"actual={q_lens[0]}/{k_lens[0]}/{tail}"
        )
    if 0 < max_tail < tail:
        return f"max_seqlen mismatch: supplied max_tail={max_tail}, actual={tail}"
    return None


def _varlen_backend_unavailable_reason(backend: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Return a cheap, non-kernel-launching reason a varlen kernel cannot run (None when it can).

    Order for ``flash``/``te``: dtype (fp16/bf16), CUDA, then the library (``flash`` is available with
    flash-attn or with torch's bundled FA2 on SM80+). ``reference`` runs any float dtype anywhere; ``flex``
    needs CUDA to train; ``auto`` is available when anything is; an unknown name gets "unsupported varlen
    backend=...". Every CP rank calls this before a needed-only K/V exchange. Never raises.
    """
    try:
        if backend == "auto":
            backend = backends.resolve_varlen_backend("auto", dtype, device)
        reason = backends.varlen_backend_unavailable_reason(backend, dtype, device)
        # An explicitly set HAS_FLASH_VARLEN / HAS_TE (tests, users forcing the answer) overrides the probe,
        # after the dtype and device checks.
        flag = {"flash": "HAS_FLASH_VARLEN", "te": "HAS_TE"}.get(backend)
        explicit = globals().get(flag) if flag else None
        if explicit is None or dtype not in _HALF or torch.device(device).type != "cuda":
            return reason
        if explicit or (backend == "flash" and backends._torch_flash_reason() is None):
            return None
        return (
            "flash_attn varlen kernel is unavailable"
            if backend == "flash"
            else "TransformerEngine varlen kernel is unavailable"
        )
    except Exception as exc:  # documented to never raise
        return f"cannot evaluate backend {backend!r}: {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------------------
# kernels: flash (with the long-prefix guard) and TransformerEngine
# ----------------------------------------------------------------------------------------------------------


def _flash_varlen_with_long_prefix_guard(
    q_packed: torch.Tensor,
    k_packed: torch.Tensor,
    v_packed: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    local_query_len: int,
    scale,
    dropout_p: float,
    meta: dict,
):
    """Run FlashAttention without an asymmetric-prefix varlen launch.

    ``q_packed: [n_real, Hq, D]``, ``k_packed/v_packed: [T_k, Hkv, D]``, ``cu_q/cu_k: [n_docs+1] int32``.
    Only the first local document can have more keys than queries (its start lives on a lower rank).
    When it does (``first_k > first_q``), that segment runs through fixed-length ``flash_attn_func``
    (bottom-right causal for ``seqlen_k > seqlen_q``, flash-attn >= 2.1) and the remaining documents through
    one ``flash_attn_varlen_func`` call: at most one extra launch, whatever the number of documents.
    Otherwise one varlen call, whose output object is returned unchanged. ``flash_attn`` is imported at
    call time. Returns ``[n_real, Hq, D]``.
    """
    global _CP_FLASH_LONG_SEGMENT_WARNED
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    first_q = int(meta.get("first_q", 0) or 0)
    first_k = int(meta.get("first_k", 0) or 0)
    if first_q <= 0:
        first_q = int(cu_q[1])
    if first_k <= 0:
        first_k = int(cu_k[1])
    common = {"dropout_p": dropout_p, "softmax_scale": scale, "causal": True, "deterministic": _CP_FLASH_DETERMINISTIC}
    if first_k <= first_q:
        return flash_attn_varlen_func(
            q_packed,
            k_packed,
            v_packed,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            **common,
        )
    if not _CP_FLASH_LONG_SEGMENT_WARNED:
        _CP_FLASH_LONG_SEGMENT_WARNED = True
        logger.warning(
            "block-diagonal CP: first local document straddles in from the left (first_q=%d, first_k=%d, "
            "local length %d); running it through fixed-length flash_attn_func and the rest through one varlen call",
            first_q,
            first_k,
            local_query_len,
        )
    head = flash_attn_func(
        q_packed[:first_q].unsqueeze(0), k_packed[:first_k].unsqueeze(0), v_packed[:first_k].unsqueeze(0), **common
    ).squeeze(0)
    if cu_q.numel() == 2:
        return head
    max_tail = int(meta.get("max_tail", 0) or 0)
    tail_cu_q = (cu_q[1:] - first_q).contiguous()
    tail_cu_k = (cu_k[1:] - first_k).contiguous()
    if max_tail <= 0:
        max_tail = int((tail_cu_q[1:] - tail_cu_q[:-1]).max())
    tail = flash_attn_varlen_func(
        q_packed[first_q:],
        k_packed[first_k:],
        v_packed[first_k:],
        cu_seqlens_q=tail_cu_q,
        cu_seqlens_k=tail_cu_k,
        max_seqlen_q=max_tail,
        max_seqlen_k=max_tail,
        **common,
    )
    return torch.cat([head, tail], dim=0)


def _te_varlen_dpa(num_q_heads, num_kv_heads, head_dim, scale, device, dtype):
    """Cached TE DotProductAttention module for thd/varlen block-diagonal CP attention.

    Key ``(Hq, Hkv, D, round(scale, 10), str(device), str(dtype))``; built with
    ``attn_mask_type="padding_causal_bottom_right"`` (the local queries are a suffix of a straddling
    document's keys) and ``qkv_format="thd"``. ``scale`` must be a number (resolve None to ``D**-0.5``).
    """
    key = (int(num_q_heads), int(num_kv_heads), int(head_dim), round(float(scale), 10), str(device), str(dtype))
    module = _TE_DPA_CACHE.get(key)
    if module is None:
        import transformer_engine.pytorch as te

        module = te.DotProductAttention(
            num_attention_heads=int(num_q_heads),
            kv_channels=int(head_dim),
            num_gqa_groups=int(num_kv_heads),
            attn_mask_type="padding_causal_bottom_right",
            qkv_format="thd",
            softmax_scale=float(scale),
        )
        module = module.to(device)
        _TE_DPA_CACHE[key] = module
    return module


# ----------------------------------------------------------------------------------------------------------
# the varlen driver
# ----------------------------------------------------------------------------------------------------------


def _warn_once(flag: str, msg: str, *args) -> None:
    if not globals()[flag]:
        globals()[flag] = True
        logger.warning(msg, *args)
    else:
        logger.debug(msg, *args)


def _canonical_backend(backend: str) -> str:
    if backend not in backends.ATTN_BACKENDS:
        raise ValueError(
            f"unknown block-diagonal varlen backend {backend!r}; valid: {', '.join(backends.ATTN_BACKENDS)}"
        )
    return "dense" if backend == "sdpa" else backend


def _gate(backend: str, dtype: torch.dtype, dropout_p: float, device: torch.device) -> bool:
    """The documented pre-work gates; True when the call may proceed (warns once otherwise)."""
    if backend in ("flash", "te", "cudnn") and dtype not in _HALF:
        _warn_once(
            "_CP_FLASH_WARNED",
            "block-diagonal CP varlen (%s) needs fp16/bf16, got %s; reporting the unavailable varlen path",
            backend,
            dtype,
        )
        return False
    if backend == "te" and dropout_p > 0:
        _warn_once(
            "_CP_TE_DROPOUT_WARNED",
            "TransformerEngine THD varlen cannot apply attention dropout (p=%s); using the dense path",
            dropout_p,
        )
        return False
    if backend == "cudnn" and dropout_p > 0:
        _warn_once(
            "_CP_CUDNN_DROPOUT_WARNED",
            "cuDNN has no dropout with a bottom-right causal mask (p=%s); using the dense path (pick backend "
            "'flash' or 'auto' to keep a varlen kernel with dropout)",
            dropout_p,
        )
        return False
    if backend == "flex" and dropout_p > 0:
        _warn_once(
            "_CP_FLEX_DROPOUT_WARNED", "FlexAttention has no attention dropout (p=%s); using the dense path", dropout_p
        )
        return False
    if backend == "flash" and not _has_flash_attn() and backends._torch_flash_reason() is not None:
        _warn_once(
            "_CP_FLASH_WARNED",
            "flash varlen kernel is unavailable (flash_attn not installed, torch's FA2: %s); using the dense path",
            backends._torch_flash_reason(),
        )
        return False
    if backend == "cudnn":
        reason = backends.varlen_backend_unavailable_reason("cudnn", dtype, device)
        if reason is not None:
            _warn_once("_CP_FLASH_WARNED", "cuDNN varlen backend unavailable (%s); using the dense path", reason)
            return False
    return True


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query/key/value devices differ: {query.device}, {key.device}, {value.device}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query/key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")


def _zero_touch(query_b: torch.Tensor, key_b: torch.Tensor, value_b: torch.Tensor) -> torch.Tensor:
    """Zeros ``[Hq, L, D]`` attached to K/V (so the backward K/V collective fires) with zero gradients.

    The touch sums an *empty* slice of K and V: exactly 0 whatever K/V hold (inf, NaN), nothing read.
    """
    touch = key_b[..., :0].sum() + value_b[..., :0].sum()
    return query_b.new_zeros(query_b.shape) + touch.to(query_b.dtype)


def _rows(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``x[:, lo:hi]`` without a slice node when the range is the whole dim (its backward would copy)."""
    return x if lo == 0 and hi == x.shape[1] else x[:, lo:hi]


def _run_packed(name, q_b, k_b, v_b, m, scale, dropout_p, local_len):
    """One row through a packed (THD) provider; returns ``[Hq, L, D]`` with zero padding rows."""
    n_real, s_first, real_end = int(m["n_real"]), int(m["s_first"]), int(m["real_end"])
    hq, _, head_dim = q_b.shape
    q = _rows(q_b, 0, n_real).transpose(0, 1).contiguous()
    k = _rows(k_b, s_first, real_end).transpose(0, 1).contiguous()
    v = _rows(v_b, s_first, real_end).transpose(0, 1).contiguous()
    cu_q, cu_k, max_q, max_k = m["cu_q"], m["cu_k"], int(m["max_q"]), int(m["max_k"])
    if name == "flash":
        if _has_flash_attn():
            res = _flash_varlen_with_long_prefix_guard(
                q, k, v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, local_query_len=local_len,
                scale=scale, dropout_p=dropout_p, meta=m,
            )  # fmt: skip
        else:
            res = backends.torch_flash_varlen(
                q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, dropout_p=dropout_p,
                deterministic=_CP_FLASH_DETERMINISTIC,
            )  # fmt: skip
    elif name == "cudnn":
        res = backends.cudnn_varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, dropout_p=dropout_p,
            deterministic=_CP_FLASH_DETERMINISTIC, meta=m,
        )  # fmt: skip
    elif name == "te":
        te_scale = scale if scale is not None else backends.default_scale(head_dim)
        dpa = _te_varlen_dpa(hq, k.shape[1], head_dim, te_scale, q.device, q.dtype)
        res = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k)
    else:
        res = backends.reference_varlen_attention(q, k, v, cu_q, cu_k, scale=scale, dropout_p=dropout_p)
    res = res.reshape(n_real, hq, head_dim)
    if n_real < local_len:
        res = F.pad(res, (0, 0, 0, 0, 0, local_len - n_real))
    return res.transpose(0, 1)


def _cp_blockdiag_varlen(
    query, key_full, value_full, doc_ids, row_offset, scale=None, backend="flash", dropout_p=0.0, meta=None
):
    """Block-diagonal CP attention via varlen kernels — no dense ``[B, 1, L, S]`` mask.

    ``query: [B, Hq, L, D]``; ``key_full/value_full: [B, Hkv, S_k, D]`` covering the K/V range the meta's
    ``[s_first, real_end)`` slice indexes (full sequence for all-gather; the needed range for halo/a2a with a
    rebased meta); ``doc_ids: [B, S_full] or [S_full]`` (0 == padding); ``row_offset``: global position of the
    first local query row; ``scale`` (None -> ``D**-0.5``); ``backend``: one of
    :data:`backends.ATTN_BACKENDS` (``"auto"`` resolves per dtype/device; ``"dense"``/``"sdpa"`` return None
    at once; anything else raises ``ValueError``); ``dropout_p``; ``meta`` from
    :func:`precompute_blockdiag_varlen_meta` (used when B == 1: zero host syncs per call after the first
    validation; rebuilt inline, with syncs, otherwise).

    Returns ``[B, Hq, L, D]`` equal to :func:`_cp_blockdiag_mask` + SDPA on every real row, with padding rows
    exactly zero (an all-padding row's zeros stay attached to K/V), or None to signal "fall back to the dense
    path" (gate failed, or the kernel raised; warned once). CUDA out-of-memory is re-raised.
    """
    global _CP_FLASH_ENGAGED, _CP_VARLEN_SHAPE_LOGGED
    name = _canonical_backend(backend)
    if name == "dense":
        return None
    if name == "auto":
        name = backends.resolve_varlen_backend("auto", query.dtype, query.device, dropout_p=dropout_p)
    if not _gate(name, query.dtype, float(dropout_p), query.device):
        return None
    try:
        bsz, hq, local_len, head_dim = query.shape
        key_len = key_full.shape[2]
        ids = doc_ids.unsqueeze(0).expand(bsz, -1) if doc_ids.dim() == 1 else doc_ids
        rows = []
        # B == 1 (the CP contract): squeeze instead of index, so the backward adds no zero-fill copies
        q_rows = [query.squeeze(0)] if bsz == 1 else list(query.unbind(0))
        k_rows = [key_full.squeeze(0)] if bsz == 1 else list(key_full.unbind(0))
        v_rows = [value_full.squeeze(0)] if bsz == 1 else list(value_full.unbind(0))
        for b in range(bsz):
            if meta is not None and bsz == 1:
                m = meta
            else:
                m = _varlen_seg_for_rank(ids[b], row_offset, local_len, query.device) or {"n_real": 0}
            if int(m["n_real"]) == 0:
                rows.append(_zero_touch(q_rows[b], k_rows[b], v_rows[b]))
                continue
            reason = _varlen_metadata_unavailable_reason(m, query_len=local_len, key_len=key_len, device=query.device)
            if reason is not None:
                raise ValueError(f"unsafe varlen metadata: {reason}")
            _check_inputs(query, key_full, value_full)
            if not _CP_VARLEN_SHAPE_LOGGED:
                _CP_VARLEN_SHAPE_LOGGED = True
                logger.info(
                    "block-diagonal CP varlen: backend=%s q_tokens=%d k_tokens=%d segments=%d max_q=%d max_k=%d "
                    "Hq=%d Hkv=%d D=%d kv_slice=[%d, %d)",
                    name, int(m["n_real"]), int(m["real_end"]) - int(m["s_first"]), m["cu_q"].numel() - 1,
                    int(m["max_q"]), int(m["max_k"]), hq, key_full.shape[1], head_dim, int(m["s_first"]),
                    int(m["real_end"]),
                )  # fmt: skip
            if name == "flex":
                flex_out = backends.flex_blockdiag_attention(
                    q_rows[b].unsqueeze(0), k_rows[b].unsqueeze(0), v_rows[b].unsqueeze(0), m, scale=scale
                )
                rows.append(flex_out.squeeze(0))
            else:
                rows.append(_run_packed(name, q_rows[b], k_rows[b], v_rows[b], m, scale, dropout_p, local_len))
        out = rows[0].unsqueeze(0) if bsz == 1 else torch.stack(rows)
    except _reraised_errors():
        raise
    except Exception as exc:
        _warn_once(
            "_CP_FLASH_WARNED",
            "block-diagonal CP varlen backend=%s failed (%s: %s); falling back to the dense path",
            name,
            type(exc).__name__,
            str(exc)[:100],
        )
        return None
    if not _CP_FLASH_ENGAGED:
        _CP_FLASH_ENGAGED = True
        logger.info("block-diagonal CP varlen engaged: backend=%s, no dense mask is built", name)
    return out
