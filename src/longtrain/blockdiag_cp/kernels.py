"""Dense and varlen block-diagonal attention kernels (the documented module).

Packed documents (per-position document ids, 0 == padding, padding only as one tail, each document one
contiguous run) attend causally within their own document only; the sequence may be sharded contiguously
over context-parallel ranks, each rank holding the queries of ``[row_offset, row_offset + L)`` and the K/V
it needs. Every documented name lives here with its documented behaviour, as a thin facade over
:mod:`.mask` (the dense mask), :mod:`.meta` (segmentation and validation) and :mod:`.providers` (one module per
varlen backend, one registry); the training runtime (:mod:`.runtime`) uses those directly.

Differences from the documented behaviour, all deliberate:

- ``precompute_blockdiag_varlen_meta`` validates the packed-layout preconditions (padding only as a tail,
  each document id one contiguous run) and raises ``ValueError`` instead of silently mis-segmenting.
- The all-padding zero output touches K/V through an empty slice: exactly zero, attached to the autograd graph,
  zero gradients, and never NaN even when K/V hold inf/NaN.
- ``_cp_blockdiag_varlen`` accepts every provider name and synonym (``cudnn``, ``fa4``, ``flash``, ``te``,
  ``flex``, ``reference``, ``auto``); an unknown name is a ``ValueError`` (not "treated as flash"),
  ``"dense"``/``"sdpa"`` return None at once.
- Metadata validation compares devices with the CUDA index resolved (``cuda`` == ``cuda:0``), also checks
  ``first_q``/``first_k``/``max_tail`` when present, and keys its cache on the ``cu_q``/``cu_k`` objects (and
  their in-place versions) too; a ``meta`` whose real rows do not end at ``row_offset + n_real`` over a full-sequence
  K/V (built for another chunk) is unsafe: None.
- ``_cp_blockdiag_mask`` raises ``ValueError`` for query rows or key columns outside the ``doc_ids`` row.
- The dense fallback :func:`dense_blockdiag_sdpa` infers GQA whenever ``Hq != Hkv``.
- ``_CP_FLASH_DETERMINISTIC`` is honoured by every backend with a deterministic mode, and so is
  ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from longtrain import _optional

from . import exchange, providers, runtime
from .mask import blockdiag_mask, dense_blockdiag_sdpa
from .meta import check_packed_layout as _check_packed_layout
from .meta import empty_meta, meta_from_dict, segment_rank, validate_meta_dict
from .providers import flash, te

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
_TE_DPA_CACHE: dict = te.TE_DPA_CACHE

_CP_NO_DROPOUT_WARNED = False
_HALF = (torch.float16, torch.bfloat16)


def __getattr__(name: str) -> Any:
    # Import probes computed lazily so that importing this module never imports flash_attn or TE.
    if name == "HAS_FLASH_VARLEN":
        return flash.flash_attn_module() is not None
    if name == "HAS_TE":
        return _optional.transformer_engine()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has_flash_attn() -> bool:
    explicit = globals().get("HAS_FLASH_VARLEN")  # set by tests / users to force the answer
    if explicit is not None:
        return bool(explicit)
    return flash.flash_attn_module() is not None


def _cp_blockdiag_mask(
    doc_ids: torch.Tensor, row_offset: int, local_len: int, full_len: int, batch_size: int
) -> torch.Tensor:
    """Per-document causal attention mask for block-diagonal CP, shape [B, 1, L, S].

    See :func:`longtrain.blockdiag_cp.mask.blockdiag_mask`: ``allow[b, 0, i, c]`` is ``doc[p] == doc[c] > 0 and
    p >= c`` with ``p = row_offset + i``, or ``p == c`` (the diagonal is always allowed).
    """
    return blockdiag_mask(doc_ids, row_offset, local_len, full_len, batch_size)


# ----------------------------------------------------------------------------------------------------------
# segmentation, precompute, validation
# ----------------------------------------------------------------------------------------------------------


def _varlen_seg_for_rank(dids: torch.Tensor, row_offset: int, local_len: int, dev) -> dict | None:
    """Per-rank block-diagonal varlen segmentation for ONE packed sequence.

    ``dids: [S_full]`` integer ids (0 == pad) on any device; the query chunk is ``[row_offset,
    row_offset + local_len)``. Copies ``dids[:row_offset + local_len]`` to the host once and returns the documented
    dict (``n_real, s_first, real_end, cu_q, cu_k, max_q, max_k, first_q, first_k, max_tail``, ``cu_*`` int32 on
    ``dev``), or None for an all-padding chunk. A real row after padding inside the chunk raises ``ValueError``.
    """
    row_offset, local_len = int(row_offset), int(local_len)
    host = dids.detach()[: row_offset + local_len].to("cpu", torch.int64)
    meta = segment_rank(host, row_offset, local_len, dev)
    return None if meta.n_real == 0 else meta.as_dict()


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
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.device.type == "meta":
        raise ValueError("doc_ids are on the meta device (no data); pass the real ids of the row")
    row = doc_ids if doc_ids.dim() == 1 else doc_ids[0]
    row_offset, local_len = int(row_offset), int(local_len)
    if row_offset < 0 or local_len < 0 or row_offset + local_len > row.numel():
        raise ValueError(
            f"query chunk [{row_offset}, {row_offset + local_len}) is outside the doc_ids row of length {row.numel()}"
        )
    host = row.detach().to("cpu", torch.int64)
    _check_packed_layout(host)
    meta = segment_rank(host, row_offset, local_len, device)
    return meta.as_dict()


def _varlen_metadata_unavailable_reason(meta: dict | None, query_len: int, key_len: int, device) -> str | None:
    """Validate every index consumed by a varlen CUDA kernel; a reason string when unsafe, else None.

    Never raises. The first full check of a meta copies ``cu_q``/``cu_k`` to the host (one sync); the result
    is cached in ``meta["_validation_cache"]`` (shared by shallow copies made after it exists) so later
    layers and activation-checkpoint recompute pay nothing. Devices compare with the index resolved.
    """
    return validate_meta_dict(meta, query_len, key_len, device)


def _varlen_backend_unavailable_reason(backend: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Return a cheap, non-kernel-launching reason a varlen kernel cannot run (None when it can).

    Order for ``flash``/``te``: dtype (fp16/bf16), CUDA, then the library (``flash`` is available with
    flash-attn or with torch's bundled FA2 on SM80+). ``reference`` runs any float dtype anywhere; ``flex``
    needs CUDA to train; ``auto`` is available when anything is; an unknown name gets the dtype and CUDA
    reasons first, then "unsupported varlen backend=<name> (valid: ...)". Every CP rank calls this before a
    needed-only K/V exchange. Never raises.
    """
    try:
        try:
            name = providers.resolve_backend(backend, dtype, device)
        except ValueError:
            # The documented order: dtype, then CUDA, then the name (so an unknown name on a CPU or fp32 call gets
            # the first of those reasons, as ``flash``/``te`` would).
            if dtype not in _HALF:
                return f"varlen CP attention needs fp16/bf16, got {dtype}"
            if torch.device(device).type != "cuda":
                return f"varlen CP attention requires CUDA, got device={device}"
            return f"unsupported varlen backend={backend} (valid: {', '.join(providers.PROVIDERS)})"
        if name == "dense":
            return "dense is not a varlen backend (it builds the [L, S] mask; use the dense fallback)"
        reason = providers.unavailable_reason(name, dtype, device)
        # An explicitly set HAS_FLASH_VARLEN / HAS_TE (tests, users forcing the answer) overrides the probe,
        # after the dtype and device checks.
        flag = {"flash": "HAS_FLASH_VARLEN", "te": "HAS_TE"}.get(name)
        explicit = globals().get(flag) if flag else None
        if explicit is None or dtype not in _HALF or torch.device(device).type != "cuda":
            return reason
        if explicit or (name == "flash" and flash.torch_flash_reason() is None):
            return None
        return (
            "flash_attn varlen kernel is unavailable"
            if name == "flash"
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
    first_q = int(meta.get("first_q", 0) or 0) or int(cu_q[1])
    first_k = int(meta.get("first_k", 0) or 0) or int(cu_k[1])
    if first_k > first_q and not _CP_FLASH_LONG_SEGMENT_WARNED:
        _CP_FLASH_LONG_SEGMENT_WARNED = True
        logger.warning(
            "block-diagonal CP: first local document straddles in from the left (first_q=%d, first_k=%d, "
            "local length %d); running it through fixed-length flash_attn_func and the rest through one varlen call",
            first_q, first_k, local_query_len,
        )  # fmt: skip
    return flash.flash_attn_long_prefix_guard(
        q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, first_q=first_q, first_k=first_k,
        max_tail=int(meta.get("max_tail", 0) or 0), scale=scale, dropout_p=dropout_p,
        deterministic=_CP_FLASH_DETERMINISTIC,
    )  # fmt: skip


def _te_varlen_dpa(num_q_heads, num_kv_heads, head_dim, scale, device, dtype):
    """Cached TE DotProductAttention module for thd/varlen block-diagonal CP attention.

    Key ``(Hq, Hkv, D, round(scale, 10), str(device), str(dtype))``; built with
    ``attn_mask_type="padding_causal_bottom_right"`` (the local queries are a suffix of a straddling
    document's keys) and ``qkv_format="thd"``. ``scale`` must be a number (resolve None to ``D**-0.5``).
    """
    return te.te_dpa(num_q_heads, num_kv_heads, head_dim, scale, device, dtype, cache=_TE_DPA_CACHE)


# ----------------------------------------------------------------------------------------------------------
# the varlen driver
# ----------------------------------------------------------------------------------------------------------


def _warn_once(flag: str, msg: str, *args) -> None:
    if not globals()[flag]:
        globals()[flag] = True
        logger.warning(msg, *args)
    else:
        logger.debug(msg, *args)


def _gate(backend: str, dtype: torch.dtype, dropout_p: float, device: torch.device) -> bool:
    """The documented pre-work gates; True when the call may proceed (warns once otherwise)."""
    library = backend not in ("reference", "flex", "dense")  # needs fp16/bf16 and a library
    if library and dtype not in _HALF:
        _warn_once("_CP_FLASH_WARNED", "block-diagonal CP varlen (%s) needs fp16/bf16, got %s; reporting the "
                   "unavailable varlen path", backend, dtype)  # fmt: skip
        return False
    if backend == "te" and dropout_p > 0:
        _warn_once("_CP_TE_DROPOUT_WARNED", "TransformerEngine THD varlen cannot apply attention dropout (p=%s); "
                   "using the dense path", dropout_p)  # fmt: skip
        return False
    if dropout_p > 0 and not providers.get(backend).dropout:
        _warn_once("_CP_NO_DROPOUT_WARNED", "the %s varlen kernel has no attention dropout (p=%s); using the dense "
                   "path (pick backend 'flash' or 'auto' to keep a varlen kernel with dropout)", backend,
                   dropout_p)  # fmt: skip
        return False
    if backend == "flash" and not _has_flash_attn() and flash.torch_flash_reason() is not None:
        _warn_once("_CP_FLASH_WARNED", "flash varlen kernel is unavailable (flash_attn not installed, torch's FA2: "
                   "%s); using the dense path", flash.torch_flash_reason())  # fmt: skip
        return False
    if library and backend not in ("flash", "te"):
        reason = providers.unavailable_reason(backend, dtype, device)
        if reason is not None:
            _warn_once("_CP_FLASH_WARNED", "%s varlen backend unavailable (%s); using the dense path", backend,
                       reason)  # fmt: skip
            return False
    return True


def _cp_blockdiag_varlen(
    query, key_full, value_full, doc_ids, row_offset, scale=None, backend="flash", dropout_p=0.0, meta=None
):
    """Block-diagonal CP attention via varlen kernels — no dense ``[B, 1, L, S]`` mask.

    ``query: [B, Hq, L, D]``; ``key_full/value_full: [B, Hkv, S_k, D]`` covering the K/V range the meta's
    ``[s_first, real_end)`` slice indexes (full sequence for all-gather; the needed range with a rebased meta);
    ``doc_ids: [B, S_full] or [S_full]`` (0 == padding); ``row_offset``: global position of the first local query
    row; ``scale`` (None -> ``D**-0.5``); ``backend``: a provider name or synonym (``"auto"`` resolves per
    dtype/device; ``"dense"``/``"sdpa"`` return None at once; anything else raises ``ValueError``); ``dropout_p``;
    ``meta`` from :func:`precompute_blockdiag_varlen_meta` (used when B == 1: zero host syncs per call after the
    first validation; rebuilt inline, with syncs, otherwise).

    Returns ``[B, Hq, L, D]`` equal to :func:`_cp_blockdiag_mask` + SDPA on every real row, with padding rows
    exactly zero (an all-padding row's zeros stay attached to K/V), or None to signal "fall back to the dense
    path" (gate failed, or the kernel raised; warned once). CUDA out-of-memory is re-raised.
    """
    global _CP_FLASH_ENGAGED, _CP_VARLEN_SHAPE_LOGGED
    name = providers.resolve_backend(backend, query.dtype, query.device, dropout_p=dropout_p)
    if name == "dense":
        return None
    if not _gate(name, query.dtype, float(dropout_p), query.device):
        return None
    deterministic = _CP_FLASH_DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
    try:
        bsz, _, local_len, _ = query.shape
        key_len = key_full.shape[2]
        ids = doc_ids.unsqueeze(0).expand(bsz, -1) if doc_ids.dim() == 1 else doc_ids
        rows = []
        # B == 1 (the CP contract): squeeze instead of index, so the backward adds no zero-fill copies
        q_rows = [query.squeeze(0)] if bsz == 1 else list(query.unbind(0))
        k_rows = [key_full.squeeze(0)] if bsz == 1 else list(key_full.unbind(0))
        v_rows = [value_full.squeeze(0)] if bsz == 1 else list(value_full.unbind(0))
        for b in range(bsz):
            if meta is not None and bsz == 1:
                reason = validate_meta_dict(meta, query_len=local_len, key_len=key_len, device=query.device)
                if reason is not None:
                    raise ValueError(f"unsafe varlen metadata: {reason}")
                m = meta_from_dict(meta)
                # Real rows are a prefix of the chunk, so a meta over the full sequence ends at row_offset + n_real;
                # one precomputed for another row_offset would attend other rows' documents (host ints, no sync).
                if m.n_real and key_len == ids.shape[-1] and m.real_end != int(row_offset) + m.n_real:
                    raise ValueError(
                        f"varlen metadata was built for another chunk: its real rows end at {m.real_end}, but "
                        f"row_offset={int(row_offset)} with n_real={m.n_real} ends at {int(row_offset) + m.n_real}"
                    )
            else:
                if int(row_offset) + local_len > ids.shape[-1]:  # else the slice below would silently stop short
                    raise ValueError(
                        f"query rows [{int(row_offset)}, {int(row_offset) + local_len}) run past the doc_ids row of "
                        f"length {ids.shape[-1]}"
                    )
                host = ids[b].detach()[: int(row_offset) + local_len].to("cpu", torch.int64)
                # As precompute_blockdiag_varlen_meta does: an id in two runs would be split into two documents
                # here but is one document in the dense mask (ValueError -> None: the dense path, documented result)
                _check_packed_layout(host)
                m = segment_rank(host, row_offset, local_len, query.device) if host.numel() else empty_meta()
            if m.n_real == 0:
                rows.append(exchange.zero_touch(q_rows[b], k_rows[b], v_rows[b]))
                continue
            q_t, k_t, v_t = (t.transpose(0, 1) for t in (q_rows[b], k_rows[b], v_rows[b]))
            runtime.check_qkv(q_t, k_t, v_t, "_cp_blockdiag_varlen")
            if not _CP_VARLEN_SHAPE_LOGGED:
                _CP_VARLEN_SHAPE_LOGGED = True
                logger.info(
                    "block-diagonal CP varlen: backend=%s q_tokens=%d k_tokens=%d segments=%d max_q=%d max_k=%d "
                    "Hq=%d Hkv=%d D=%d kv_slice=[%d, %d)", name, m.n_real, m.kv_len, m.n_docs, m.max_q, m.max_k,
                    q_t.shape[1], k_t.shape[1], q_t.shape[2], m.s_first, m.real_end,
                )  # fmt: skip
            out = runtime.attend(q_t, k_t, v_t, m, name, scale=scale, dropout_p=float(dropout_p),
                                 deterministic=deterministic)  # fmt: skip
            rows.append(out.transpose(0, 1))
        out = rows[0].unsqueeze(0) if bsz == 1 else torch.stack(rows)
    except runtime.reraised_errors():
        raise
    except Exception as exc:
        _warn_once("_CP_FLASH_WARNED", "block-diagonal CP varlen backend=%s failed (%s: %s); falling back to the "
                   "dense path", name, type(exc).__name__, str(exc)[:100])  # fmt: skip
        return None
    if not _CP_FLASH_ENGAGED:
        _CP_FLASH_ENGAGED = True
        logger.info("block-diagonal CP varlen engaged: backend=%s, no dense mask is built", name)
    return out
