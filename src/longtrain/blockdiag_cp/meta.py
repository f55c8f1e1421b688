"""Varlen metadata of packed documents: segmentation, layout validation, and the typed :class:`VarlenMeta`.

A packed row holds per-position document ids (``0`` == padding; padding only as one tail, each document one
contiguous run). Sharded over context-parallel ranks, rank ``r`` holds the queries of global positions
``[row_offset, row_offset + L)``; attention needs, for every document those queries touch, one *segment*: its
local queries and the keys ``[doc_start, last_local_query]``. Only the first segment can hold more keys than
queries (the part of a straddling document that lives on lower ranks), and the causal diagonal is aligned
bottom-right. :class:`VarlenMeta` carries that segmentation: host ints (segment lengths, slice bounds) plus the
device ``cu_q`` / ``cu_k`` offsets every kernel reads, and a per-step ``cache`` dict that providers fill (mask
plans, graphs, row tables) so that every layer of a step after the first does no host work.

Everything here is built from a host copy of the ids (one device-to-host copy per step, made by the caller) or
validated once from device offsets (:func:`meta_from_cu_seqlens`, one copy per new offsets tensor), so nothing
untrusted reaches a kernel.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = [
    "VarlenMeta",
    "VarlenPlan",
    "check_packed_layout",
    "empty_meta",
    "meta_from_cu_seqlens",
    "meta_from_segments",
    "resolve_device",
    "segment_rank",
    "tensor_cache_key",
    "validate_meta_dict",
]

#: Keys of the documented metadata dict (``precompute_blockdiag_varlen_meta``) that every non-empty meta holds.
META_FIELDS = ("s_first", "real_end", "cu_q", "cu_k", "max_q", "max_k")


def resolve_device(device: Any) -> torch.device:
    """``torch.device`` with the CUDA index resolved (``cuda`` -> ``cuda:<current>``) and ``cpu:0`` -> ``cpu``."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    if dev.type == "cpu":
        return torch.device("cpu")
    return dev


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    """One rank's (or one call's) segmentation of packed documents, host ints plus device offsets.

    Query row ``i`` is a row of the local chunk; key index ``j`` is a position in the key coordinate system of the
    K/V tensor the call receives (global positions for the all-gather path; rebased by :meth:`rebased` for the
    needed-only exchanges). Segment ``s`` pairs local query rows ``[cu_q[s], cu_q[s+1])`` with key indices
    ``[s_first + cu_k[s], s_first + cu_k[s+1])``; with causal attention aligned bottom-right, query ``j`` of the
    segment sees the segment's first ``j + 1 + seg_k[s] - seg_q[s]`` keys.
    """

    n_real: int
    """Real (non-padding) local query rows: the prefix ``[0, n_real)``; ``0`` for an all-padding chunk."""
    s_first: int = 0
    """First key index the segments read."""
    real_end: int = 0
    """One past the last key index the segments read."""
    seg_q: tuple[int, ...] = ()
    """Query count of each segment (every entry >= 1)."""
    seg_k: tuple[int, ...] = ()
    """Key count of each segment (every entry >= its query count under causal attention)."""
    cu_q: torch.Tensor | None = None
    """``[N+1] int32`` cumulative query offsets on the compute device (``None`` when ``n_real == 0``)."""
    cu_k: torch.Tensor | None = None
    """``[N+1] int32`` cumulative key offsets on the compute device."""
    cache: dict = field(default_factory=dict, repr=False)
    """Per-step caches of the providers (mask plans, cuDNN layouts, row tables), shared by :meth:`rebased` copies."""

    @property
    def n_docs(self) -> int:
        return len(self.seg_q)

    @property
    def max_q(self) -> int:
        return max(self.seg_q, default=0)

    @property
    def max_k(self) -> int:
        return max(self.seg_k, default=0)

    @property
    def first_q(self) -> int:
        return self.seg_q[0] if self.seg_q else 0

    @property
    def first_k(self) -> int:
        return self.seg_k[0] if self.seg_k else 0

    @property
    def max_tail(self) -> int:
        """The largest query segment after the first (0 with one segment)."""
        return max(self.seg_q[1:], default=0)

    @property
    def kv_len(self) -> int:
        """Keys the segments read: ``real_end - s_first``."""
        return self.real_end - self.s_first

    @property
    def all_square(self) -> bool:
        """Every segment has as many keys as queries (then top-left and bottom-right causal coincide)."""
        return self.seg_q == self.seg_k

    @property
    def only_first_longer(self) -> bool:
        """Only the first segment may hold more keys than queries (the CP layout invariant)."""
        return self.seg_q[1:] == self.seg_k[1:]

    def rebased(self, s_first: int, real_end: int, *, share_cache: bool = True) -> VarlenMeta:
        """The same segmentation over a K/V tensor whose index 0 is global position ``self.s_first - s_first``.

        Used by the needed-only exchanges (the received block starts at the first needed key). The copy shares the
        offset tensors and, unless ``share_cache=False``, ``cache`` (a copy that is itself stored in this cache
        takes its own, so that no reference cycle outlives the step).
        """
        if real_end - s_first != self.kv_len:
            raise ValueError(f"rebased slice [{s_first}, {real_end}) must keep the key count {self.kv_len}")
        if share_cache:
            return replace(self, s_first=int(s_first), real_end=int(real_end))
        return replace(self, s_first=int(s_first), real_end=int(real_end), cache={})

    def as_dict(self) -> dict:
        """The documented metadata dict (``precompute_blockdiag_varlen_meta``'s return), ``{"n_real": 0}`` if empty."""
        if self.n_real == 0:
            return {"n_real": 0}
        return {
            "n_real": self.n_real,
            "s_first": self.s_first,
            "real_end": self.real_end,
            "cu_q": self.cu_q,
            "cu_k": self.cu_k,
            "max_q": self.max_q,
            "max_k": self.max_k,
            "first_q": self.first_q,
            "first_k": self.first_k,
            "max_tail": self.max_tail,
        }

    def row_tables(self, query_len: int, key_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per-position tables for mask-based providers, built on ``device`` without a sync and cached.

        Returns ``(doc_q [query_len] int32, doc_k [key_len] int32, q_lim [query_len] int32)``: the segment of each
        query row (``-1`` for rows ``>= n_real``), of each key index (``-2`` outside ``[s_first, real_end)``), and
        the last key index each query row may see under bottom-right causal alignment.
        """
        key = ("row_tables", query_len, key_len, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        doc_q = torch.full((query_len,), -1, dtype=torch.int32, device=device)
        doc_k = torch.full((key_len,), -2, dtype=torch.int32, device=device)
        q_lim = torch.full((query_len,), -1, dtype=torch.int32, device=device)
        if self.n_real:
            ids = torch.arange(self.n_docs, dtype=torch.int32, device=device)
            sq = torch.tensor(self.seg_q, dtype=torch.int64, device=device)
            sk = torch.tensor(self.seg_k, dtype=torch.int64, device=device)
            dq = torch.repeat_interleave(ids, sq, output_size=self.n_real)
            doc_q[: self.n_real] = dq
            doc_k[self.s_first : self.real_end] = torch.repeat_interleave(ids, sk, output_size=self.kv_len)
            excess = (torch.cumsum(sk, 0) - torch.cumsum(sq, 0)).to(torch.int32)  # keys minus queries up to doc end
            rows = torch.arange(self.n_real, dtype=torch.int32, device=device)
            q_lim[: self.n_real] = self.s_first + rows + excess[dq.long()]
        hit = (doc_q, doc_k, q_lim)
        self.cache[key] = hit
        return hit


def empty_meta() -> VarlenMeta:
    """The metadata of an all-padding chunk."""
    return VarlenMeta(n_real=0)


def _offsets(lengths: tuple[int, ...], device: Any) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _meta(n_real: int, s_first: int, real_end: int, seg_q: list[int], seg_k: list[int], device: Any) -> VarlenMeta:
    return VarlenMeta(
        n_real=n_real,
        s_first=s_first,
        real_end=real_end,
        seg_q=tuple(seg_q),
        seg_k=tuple(seg_k),
        cu_q=_offsets(tuple(seg_q), device),
        cu_k=_offsets(tuple(seg_k), device),
    )


def meta_from_segments(seg_q: list[int], seg_k: list[int], device: Any) -> VarlenMeta:
    """The segmentation of compacted query rows and compacted keys: segment ``s`` pairs query rows
    ``[cu_q[s], cu_q[s+1])`` with keys ``[cu_k[s], cu_k[s+1])`` (bottom-right causal; ``seg_k[s] >= seg_q[s] >= 1``)."""
    if not seg_q:
        return empty_meta()
    return _meta(sum(seg_q), 0, sum(seg_k), list(seg_q), list(seg_k), device)


def check_packed_layout(ids: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the host row ``ids: [S] int64`` holds ids >= 0, padding (0) only as one tail,
    and each document id as one contiguous run."""
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
        uniq, counts = torch.unique(docs[starts], return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            where = (starts & (docs == dup)).nonzero().flatten().tolist()
            raise ValueError(
                f"document id {dup} appears in {len(where)} separate runs (starting at positions {where[:8]}); "
                "each document must be one contiguous run and adjacent documents must have different ids"
            )


def segment_rank(ids: torch.Tensor, row_offset: int, local_len: int, device: Any) -> VarlenMeta:
    """Segment the query chunk ``[row_offset, row_offset + local_len)`` of the host row ``ids: [S] int64``.

    Reads only ``ids[:row_offset + local_len]`` (host work, no device sync). Raises ``ValueError`` when padding
    occurs before a real token inside the chunk. Returns :func:`empty_meta` for an all-padding chunk.
    """
    row_offset, local_len = int(row_offset), int(local_len)
    local = ids[row_offset : row_offset + local_len]
    real = local > 0
    n_real = int(real.sum())
    if n_real == 0:
        return empty_meta()
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
        differs = (ids[:row_offset] != docs[0]).nonzero()
        back = row_offset if differs.numel() == 0 else row_offset - 1 - int(differs[-1])
    seg_k = list(seg_q)
    seg_k[0] += back
    return _meta(n_real, row_offset - back, row_offset + n_real, seg_q, seg_k, device)


# ----------------------------------------------------------------------------------------------------------
# the documented dict: validation (for dicts we did not build) and conversion
# ----------------------------------------------------------------------------------------------------------


def validate_meta_dict(meta: Any, query_len: int, key_len: int, device: Any) -> str | None:
    """Validate every index of a metadata dict a varlen kernel would consume; a reason string, or None when safe.

    Never raises. The first full check of a dict copies ``cu_q``/``cu_k`` to the host (one sync); the result is
    cached in ``meta["_validation_cache"]`` (shared by shallow copies made after it exists) under
    ``(n_real, query_len, key_len, s_first, real_end, max_q, max_k, device)`` and the identity and version of
    ``cu_q``/``cu_k`` (the entry keeps the tensors it judged, so a reused id never hits a stale verdict).
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
    missing = [name for name in META_FIELDS if name not in meta]
    if missing:
        return f"missing varlen metadata fields: {missing}"
    try:
        s_first, real_end, max_q, max_k = (int(meta[k]) for k in ("s_first", "real_end", "max_q", "max_k"))
    except (TypeError, ValueError) as exc:
        return f"non-integral varlen scalar metadata ({type(exc).__name__})"
    try:
        dev = resolve_device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"invalid device {device!r} ({type(exc).__name__})"
    cu_q, cu_k = meta["cu_q"], meta["cu_k"]
    sig = (n_real, query_len, key_len, s_first, real_end, max_q, max_k, str(dev), *_identity(cu_q), *_identity(cu_k))
    cache = meta.setdefault("_validation_cache", {})
    hit = cache.get(sig)
    # The entry holds the tensors it judged: an id is only unique while its object lives, and a freed cu_q's id
    # can be reused by a different tensor in a shallow copy sharing this cache.
    if hit is not None and hit[0] is cu_q and hit[1] is cu_k:
        return hit[2]
    reason = _validate_uncached(meta, n_real, query_len, key_len, s_first, real_end, max_q, max_k, dev)
    cache[sig] = (cu_q, cu_k, reason)
    return reason


def _identity(cu: Any) -> tuple:
    """``(id, version)`` of a cu_seqlens object: an in-place change is a new version (an inference tensor tracks
    none, so it is keyed by id only)."""
    if isinstance(cu, torch.Tensor) and not cu.is_inference():
        return id(cu), cu._version
    return id(cu), None


def _validate_uncached(meta, n_real, query_len, key_len, s_first, real_end, max_q, max_k, dev) -> str | None:
    if not 0 <= s_first <= real_end <= key_len:
        return f"K/V slice [{s_first}, {real_end}) is outside key length {key_len}"
    for name in ("cu_q", "cu_k"):
        cu = meta[name]
        if not isinstance(cu, torch.Tensor):
            return f"{name} is not a tensor"
        if cu.dtype != torch.int32:
            return f"{name} must be int32, got {cu.dtype}"
        if resolve_device(cu.device) != dev:
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
        "n_real": n_real, "query_len": query_len, "key_len": key_len, "s_first": s_first, "real_end": real_end,
        "max_q": max_q, "max_k": max_k, "first_q": first_q, "first_k": first_k, "max_tail": max_tail,
        "cu_q": cu_q, "cu_k": cu_k,
    }  # fmt: skip
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
    meta["_segments"] = (tuple(q_lens), tuple(k_lens))
    return None


def meta_from_dict(meta: dict) -> VarlenMeta:
    """The :class:`VarlenMeta` of a documented metadata dict that :func:`validate_meta_dict` accepted.

    Reuses the host segment lengths the validation recorded (no sync) and the dict's offset tensors; the
    converted object is cached in the dict (``"_typed"``) so repeated layer calls share its provider caches.
    """
    n_real = int(meta["n_real"])
    if n_real == 0:
        return empty_meta()
    typed = meta.get("_typed")
    if isinstance(typed, VarlenMeta) and typed.cu_q is meta["cu_q"] and typed.cu_k is meta["cu_k"]:
        if typed.s_first == int(meta["s_first"]) and typed.real_end == int(meta["real_end"]):
            return typed
        return typed.rebased(int(meta["s_first"]), int(meta["real_end"]))
    seg_q, seg_k = meta["_segments"]
    typed = VarlenMeta(
        n_real=n_real,
        s_first=int(meta["s_first"]),
        real_end=int(meta["real_end"]),
        seg_q=seg_q,
        seg_k=seg_k,
        cu_q=meta["cu_q"],
        cu_k=meta["cu_k"],
    )
    meta["_typed"] = typed
    return typed


# ----------------------------------------------------------------------------------------------------------
# flash-attn style offsets: validation once per offsets tensor, normalisation of unusual layouts
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """How a ``varlen_attention`` call runs: a kernel-safe :class:`VarlenMeta` over (possibly gathered) rows.

    When every document has ``1 <= Lq <= Lk`` (causal) or ``Lq, Lk >= 1`` (non-causal), the kernels read the
    caller's tensors directly (``q_index is None``). Otherwise the query rows that see at least one key and the
    keys of documents that keep a query are gathered first (``q_index``/``k_index``, int64 on the device), and
    every other query row's output is exactly zero.
    """

    meta: VarlenMeta
    total_q: int
    total_k: int
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None


_PLANS: OrderedDict[tuple, tuple[Any, Any, VarlenPlan]] = OrderedDict()
_PLANS_MAX = 64


def tensor_cache_key(*tensors: torch.Tensor) -> tuple | None:
    """The part of a cache key that says "these same tensors, unmodified, in this inference mode"; ``None`` when
    they must not be cached.

    An inference tensor tracks no version (reading ``_version`` raises, and it can change in place unseen), so it
    is never a key. The mode is part of the key because what is built under ``torch.inference_mode`` is inference
    tensors, which a later call with autograd on cannot save for backward.
    """
    if any(t.is_inference() for t in tensors):
        return None
    return (torch.is_inference_mode_enabled(), *((id(t), t._version) for t in tensors))


def meta_from_cu_seqlens(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_q: int,
    max_k: int,
    *,
    causal: bool,
    device: torch.device,
) -> VarlenPlan:
    """Validate flash-attn style offsets and return the call's :class:`VarlenPlan` (``ValueError`` when unsafe).

    ``cu_q/cu_k: [N+1]`` integer tensors, non-decreasing from 0, ``cu_q[-1] <= total_q`` and ``cu_k[-1] <=
    total_k`` (rows after the last offset are padding: zero output, never read as keys), ``max_q``/``max_k`` at
    least the largest document. The check copies the offsets to the host once; the plan is cached while the same
    offset tensors come back unmodified (every layer of a step), so later calls do no host work. Offsets that are
    inference tensors (made under ``torch.inference_mode``) are checked at every call (:func:`tensor_cache_key`).
    """
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):  # before the cache key, which reads tensor attributes
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor [N+1], got {type(cu).__name__}")
    tensors = tensor_cache_key(cu_q, cu_k)
    if tensors is None:
        return _plan_uncached(cu_q, cu_k, total_q, total_k, max_q, max_k, causal, device)
    key = (*tensors, total_q, total_k, max_q, max_k, causal, str(device))
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k:
        _PLANS.move_to_end(key)
        return hit[2]
    plan = _plan_uncached(cu_q, cu_k, total_q, total_k, max_q, max_k, causal, device)
    try:
        refs = (weakref.ref(cu_q), weakref.ref(cu_k))
    except TypeError:
        return plan
    _PLANS[key] = (*refs, plan)
    while len(_PLANS) > _PLANS_MAX:
        _PLANS.popitem(last=False)
    return plan


def _check_offsets(name: str, cu: Any, total: int, device: torch.device) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor [N+1], got {cu.dtype} {tuple(cu.shape)}")
    if resolve_device(cu.device) != device:
        raise ValueError(f"{name} is on {cu.device}, but q/k/v are on {device}; move it to the same device")
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"{name} must start at 0, got {host[0]}")
    if any(b < a for a, b in zip(host[:-1], host[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {host[:16]}{'...' if len(host) > 16 else ''}")
    if host[-1] > total:
        raise ValueError(f"{name}[-1]={host[-1]} exceeds the {total} packed rows of its tensor")
    return host


def _plan_uncached(cu_q, cu_k, total_q, total_k, max_q, max_k, causal, device) -> VarlenPlan:
    cq = _check_offsets("cu_seqlens_q", cu_q, total_q, device)
    ck = _check_offsets("cu_seqlens_k", cu_k, total_k, device)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {len(cq) - 1} and {len(ck) - 1} documents")
    lq = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lk = [b - a for a, b in zip(ck[:-1], ck[1:])]
    if lq and (max(lq) > int(max_q) or max(lk) > int(max_k)):
        raise ValueError(
            f"max_seqlen_q/max_seqlen_k = {max_q}/{max_k} are smaller than the longest document "
            f"({max(lq)}/{max(lk)}); pass the true maxima"
        )
    # Rows that see at least one key: causal bottom-right drops the first Lq - Lk queries of a document.
    drop = [(max(0, n - m) if causal else 0) if m > 0 else n for n, m in zip(lq, lk)]
    seg_q = [n - d for n, d in zip(lq, drop)]
    docs = [i for i, n in enumerate(seg_q) if n > 0]
    direct = len(docs) == len(lq) and not any(drop) and cq[-1] == total_q
    if direct and ck[-1] == total_k:
        meta = VarlenMeta(
            n_real=total_q, s_first=0, real_end=total_k, seg_q=tuple(lq), seg_k=tuple(lk),
            cu_q=cu_q.to(torch.int32).contiguous(), cu_k=cu_k.to(torch.int32).contiguous(),
        )  # fmt: skip
        return VarlenPlan(meta=meta, total_q=total_q, total_k=total_k)
    q_rows = [r for i in docs for r in range(cq[i] + drop[i], cq[i + 1])]
    k_rows = [r for i in docs for r in range(ck[i], ck[i + 1])]
    sq = [seg_q[i] for i in docs]
    sk = [lk[i] for i in docs]
    n_real = len(q_rows)
    meta = _meta(n_real, 0, len(k_rows), sq, sk, device) if n_real else empty_meta()
    return VarlenPlan(
        meta=meta,
        total_q=total_q,
        total_k=total_k,
        q_index=torch.tensor(q_rows, dtype=torch.int64, device=device),
        k_index=torch.tensor(k_rows, dtype=torch.int64, device=device),
    )
