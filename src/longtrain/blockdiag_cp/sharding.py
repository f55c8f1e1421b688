"""Which positions of a packed row each CP rank owns: contiguous blocks, or a causal-work-balanced plan.

Causal attention work grows along each document (query ``j`` of a document attends ``j + 1`` keys), so contiguous
blocks load the ranks unevenly. :func:`plan_cp_shards` with ``sharding="balanced"`` gives every rank the same
number of positions and nearly the same causal work:

- a document of at least ``2 * W * chunk`` tokens is cut into ``2W`` pieces and rank ``r`` takes pieces ``r`` and
  ``2W - 1 - r`` (per-document head-tail: each rank's share of the document costs the same), with piece sizes
  chosen so that every rank's token count stays equal;
- a shorter document of ``n`` tokens goes head-tail over the ``k = n // (2 chunk)`` least-loaded ranks that have
  room for a share (``2k`` pieces of at least ``chunk`` tokens, rank ``i`` taking pieces ``i`` and ``2k - 1 - i``),
  or whole to the least-loaded rank with room when ``k < 2``, longest documents first; a document no rank has room
  for is split at the ranks' room;
- the padding tail fills the remaining room (it costs nothing).

The plan is deterministic (host integers only, same input -> same plan on every rank). A rank's positions are
listed in ascending order; :attr:`CPShardPlan.pieces` gives them as ranges.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from longtrain.packing import as_index

__all__ = ["CPShardPlan", "RankPass", "RankPieces", "SHARDING_MODES", "causal_work_of", "plan_cp_shards", "rank_pieces"]

SHARDING_CONTIGUOUS, SHARDING_BALANCED = "contiguous", "balanced"
SHARDING_MODES = (SHARDING_CONTIGUOUS, SHARDING_BALANCED)
CHUNK_DEFAULT = 128


@dataclass(frozen=True, eq=False)
class CPShardPlan:
    """Per rank: the positions of the padded row it owns (``token_index[r]``, int64, ascending, each position of the
    row exactly once over all ranks) and the causal same-document query-key pairs of its queries
    (``causal_work[r]``)."""

    sharding: str
    world_size: int
    seq_len: int
    """``S``: positions of the padded row (documents and padding)."""
    local_len: int
    """``S / W``: positions per rank."""
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    """Per rank, its positions as ascending half-open ranges (adjacent ranges merged: one may span documents)."""
    causal_work: tuple[int, ...]
    doc_lens: tuple[int, ...]
    pad: int
    chunk: int
    _index: dict = field(default_factory=dict, repr=False)

    @property
    def token_index(self) -> tuple[torch.Tensor, ...]:
        """Per rank, ``[L] int64`` global positions in local order."""
        hit = self._index.get("cpu")
        if hit is None:
            hit = self._index["cpu"] = tuple(
                torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])
                if ranges
                else torch.zeros(0, dtype=torch.int64)
                for ranges in self.pieces
            )
        return hit

    @property
    def permutation(self) -> torch.Tensor:
        """``[S] int64``: position ``i`` of the ranks' concatenated local rows holds global position
        ``permutation[i]``."""
        return torch.cat(self.token_index)

    @property
    def imbalance(self) -> float:
        """Busiest rank's causal work over the mean (1.0 when there is no work)."""
        total = sum(self.causal_work)
        return max(self.causal_work) * self.world_size / total if total else 1.0

    @property
    def is_contiguous(self) -> bool:
        """Whether rank ``r`` owns exactly ``[r * L, (r + 1) * L)``."""
        return all(
            ranges in ((), ((r * self.local_len, (r + 1) * self.local_len),)) and self._covers(r, ranges)
            for r, ranges in enumerate(self.pieces)
        )

    def _covers(self, r: int, ranges) -> bool:
        return sum(b - a for a, b in ranges) == self.local_len and (not ranges or ranges[0][0] == r * self.local_len)

    def gather(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``tensor``'s rows of ``rank`` along ``dim`` (the full row -> this rank's local tensor, in local order);
        a view when the rank's positions are one range. ``tensor`` must hold the padded row's ``seq_len`` positions
        along ``dim``."""
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(
                f"gather takes the whole padded row ({self.seq_len} positions) along dim {dim}, got a tensor of shape "
                f"{tuple(tensor.shape)}; pad the row to plan.seq_len first (plan.pad positions after the documents)"
            )
        ranges = self.pieces[rank]
        if len(ranges) == 1:
            a, b = ranges[0]
            return tensor.narrow(dim, a, b - a)
        index = self.token_index[rank].to(tensor.device)
        return tensor.index_select(dim, index)

    def unshard(self, parts: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 1) -> torch.Tensor:
        """Every rank's local tensor (in rank order, local order along ``dim``) -> the tensor in row order."""
        if len(parts) != self.world_size:
            raise ValueError(f"unshard takes one tensor per rank ({self.world_size}), got {len(parts)}")
        for r, part in enumerate(parts):
            if part.shape[dim] != self.local_len:
                raise ValueError(
                    f"unshard takes every rank's {self.local_len} local rows along dim {dim}, got {part.shape[dim]} "
                    f"for rank {r} (shape {tuple(part.shape)})"
                )
        joined = torch.cat(list(parts), dim=dim)
        if joined.shape[dim] != self.seq_len:
            raise ValueError(f"the parts hold {joined.shape[dim]} positions along dim {dim}, the row {self.seq_len}")
        inverse = torch.empty(self.seq_len, dtype=torch.int64)
        inverse[self.permutation] = torch.arange(self.seq_len)
        return joined.index_select(dim, inverse.to(joined.device))


def causal_work_of(doc_lens: list[int], ranges) -> int:
    """Causal same-document query-key pairs of the queries at positions ``ranges`` (half-open; padding after the
    documents costs nothing)."""
    starts, acc = [], 0
    for n in doc_lens:
        starts.append(acc)
        acc += n
    total = 0
    for a, b in ranges:
        d = max(bisect.bisect_right(starts, a) - 1, 0)
        while d < len(starts) and starts[d] < b:
            s, n = starts[d], doc_lens[d]
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:  # document-relative positions i .. j-1 attend (pos + 1) keys each
                i, j = lo - s, hi - s
                total += (j * (j + 1) - i * (i + 1)) // 2
            d += 1
    return total


def _doc_lens(doc_lens) -> list[int]:
    """``doc_lens`` as a list of ints; a float, bool, string or nested length is a ``ValueError`` (``int()`` would
    truncate ``1.5`` to a plan of a different row)."""
    what = "doc_lens must be document lengths in tokens (a list or 1-D tensor of ints)"
    if isinstance(doc_lens, torch.Tensor):
        integer = not (doc_lens.dtype.is_floating_point or doc_lens.dtype.is_complex or doc_lens.dtype == torch.bool)
        if doc_lens.dim() != 1 or not (integer or doc_lens.numel() == 0):
            raise ValueError(f"{what}, got a {doc_lens.dim()}-D {doc_lens.dtype} tensor")
        return [int(n) for n in doc_lens.reshape(-1).tolist()]
    if isinstance(doc_lens, (str, bytes)) or not hasattr(doc_lens, "__iter__"):
        raise ValueError(f"{what}, got {type(doc_lens).__name__} {doc_lens!r}")
    items = list(doc_lens)
    lens = [as_index(n) for n in items]
    if None in lens:
        raise ValueError(f"{what}, got {items[lens.index(None)]!r} among them")
    return lens


def _check(doc_lens, world_size: int, sharding: str, chunk: int, pad: int) -> list[int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (tokens), got {chunk!r}")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be a non-negative int (padding positions after the documents), got {pad!r}")
    lens = _doc_lens(doc_lens)
    if any(n < 0 for n in lens):
        raise ValueError(f"doc_lens must be non-negative, got {lens}")
    return lens


def plan_cp_shards(
    doc_lens,
    world_size: int,
    *,
    sharding: str = SHARDING_BALANCED,
    chunk: int = CHUNK_DEFAULT,
    pad: int = 0,
) -> CPShardPlan:
    """Plan which positions of one packed row each of ``world_size`` CP ranks owns.

    Args:
        doc_lens: document lengths in row order (list or 1-D tensor of ints; empty documents allowed). A padding
            tail is given as ``pad`` (it is not a document).
        world_size: ``W``. The row is padded to a multiple of it: ``S = sum(doc_lens) + pad`` rounded up to a
            multiple of ``W`` (``plan.pad`` is the padding used), and every rank owns ``L = S / W`` positions.
        sharding: ``"contiguous"`` (rank ``r`` owns ``[r L, (r+1) L)``: the seed's split) or ``"balanced"`` (module
            docstring).
        chunk: the smallest piece, in tokens, a balanced plan cuts a document into (documents shorter than
            ``4 chunk`` stay whole, shorter than ``2 W chunk`` go over fewer ranks; a document no rank has room for is
            split at the ranks' room, which can leave smaller pieces); kernels stay efficient on pieces of 128 tokens
            and more.
        pad: padding positions after the last document (at least; grown to make ``S`` a multiple of ``W``).

    Returns:
        :class:`CPShardPlan`. Raises ``ValueError`` for invalid arguments.
    """
    return _plan(_check(doc_lens, world_size, sharding, chunk, pad), world_size, sharding, chunk, pad)


def _plan(
    lens: list[int], w: int, sharding: str, chunk: int, pad: int, whole_first: float | None = None
) -> CPShardPlan:
    """:func:`plan_cp_shards` on checked arguments (``whole_first``: see :func:`_balanced`)."""
    pad += (-(sum(lens) + pad)) % w
    seq_len = sum(lens) + pad
    local = seq_len // w
    if sharding == SHARDING_CONTIGUOUS or w == 1:
        pieces = [[(r * local, (r + 1) * local)] if local else [] for r in range(w)]
    else:
        pieces = _balanced(lens, pad, w, local, chunk, whole_first)
    pieces = tuple(tuple(_merge(p)) for p in pieces)
    work = tuple(causal_work_of(lens, p) for p in pieces)
    mode = SHARDING_CONTIGUOUS if w == 1 else sharding
    return CPShardPlan(mode, w, seq_len, local, pieces, work, tuple(lens), pad, chunk)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def _balanced(
    lens: list[int], pad: int, w: int, local: int, chunk: int, whole_first: float | None = None
) -> list[list[tuple[int, int]]]:
    """The balanced plan's pieces per rank (module docstring). ``whole_first`` (an experiment, timed by
    ``benchmarks/cp_imbalance.py --whole-first``; not a public option): every document, longest first, goes whole
    to the least-loaded rank with room for it when that keeps the rank's causal work at most ``whole_first`` times
    the mean; the others are cut as the default plan cuts its shorter documents. Fewer, longer query segments and
    fewer all-to-all keys, at a less even work split."""
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    tokens = [0] * w
    work = [0] * w
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    mean_work = sum(_tri(n) for n in lens) / w

    def head_tail(d: int, ranks: list[int]) -> None:
        """Document ``d`` over ``ranks`` (k of them): 2k pieces, ``ranks[i]`` takes pieces i and 2k-1-i; shares are
        floor/ceil of n / k, the extra tokens to the ranks holding the fewest so far."""
        n, s, k = lens[d], starts[d], len(ranks)
        base, extra = divmod(n, k)
        share = {r: base for r in ranks}
        for r in sorted(ranks, key=lambda r: (tokens[r], r))[:extra]:
            share[r] += 1
        pos = s
        for r in ranks:
            head = share[r] // 2
            pieces[r].append((pos, pos + head))
            pos += head
        for r in reversed(ranks):
            tail = share[r] - share[r] // 2
            pieces[r].append((pos, pos + tail))
            pos += tail
        for r in ranks:
            tokens[r] += share[r]
            work[r] += causal_work_of([n], [(a - s, b - s) for a, b in pieces[r][-2:]])

    def whole(d: int, r: int) -> None:
        pieces[r].append((starts[d], starts[d] + lens[d]))
        tokens[r] += lens[d]
        work[r] += _tri(lens[d])

    # long documents: per-document head-tail over every rank (each rank's share costs the same)
    if whole_first is None:
        for d, n in enumerate(lens):
            if n >= 2 * w * chunk:
                head_tail(d, list(range(w)))
    # the other documents, longest first: head-tail over the k = n // (2 chunk) least-loaded ranks with room for a
    # share (pieces of at least `chunk` tokens), whole onto the least-loaded rank with room when k < 2
    rest = [d for d, n in enumerate(lens) if n > 0 and (whole_first is not None or n < 2 * w * chunk)]
    for d in sorted(rest, key=lambda d: (-lens[d], d)):
        n, s = lens[d], starts[d]
        by_work = sorted(range(w), key=lambda r: (work[r], r))
        if whole_first is not None:
            fits = [r for r in by_work if local - tokens[r] >= n]
            if fits and work[fits[0]] + _tri(n) <= whole_first * mean_work:
                whole(d, fits[0])
                continue
        best = None
        for k in range(max(1, min(w, n // (2 * chunk))), 0, -1):
            ranks = [r for r in by_work if local - tokens[r] >= -(-n // k)][:k]
            if len(ranks) == k:
                best = ranks
                break
        if best is not None:
            if len(best) == 1:
                whole(d, best[0])
            else:
                head_tail(d, sorted(best))
            continue
        done = 0  # no rank has room for it whole (nor for a share): split at the ranks' room, prefix first
        for r in sorted(range(w), key=lambda r: (-(local - tokens[r]), r)):
            room = min(local - tokens[r], n - done)
            if room <= 0:
                continue
            pieces[r].append((s + done, s + done + room))
            work[r] += _tri(done + room) - _tri(done)
            tokens[r] += room
            done += room
            if done == n:
                break
    # the padding tail fills the rest, rank by rank
    pos = sum(lens)
    for r in range(w):
        room = local - tokens[r]
        if room:
            pieces[r].append((pos, pos + room))
            pos += room
            tokens[r] += room
    assert pos == sum(lens) + pad and all(t == local for t in tokens), (pos, tokens)
    return pieces


# ----------------------------------------------------------------------------------------------------------
# attention over a rank's pieces: one varlen call over compacted keys, gathered in passes
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RankPass:
    """One group of a rank's segments with at most one segment per document, so that gathering its keys reads
    every key row at most once (the gather's backward then adds each row once: deterministic).

    ``q_rows``: ``[n] int64`` local rows (device) of its segments' queries, segment after segment;
    ``key_pos``: ``[m] int64`` global key positions (host), segment after segment (a segment's keys run from its
    document's start to its last query).
    """

    q_rows: torch.Tensor
    key_pos: torch.Tensor


@dataclass(frozen=True, eq=False)
class RankPieces:
    """Everything a rank of a non-contiguous plan needs per attention call, built once per step (host work).

    The rank's attention is one varlen call: its queries are the local rows ``q_rows`` (every pass's, in pass
    order), its keys every pass's compacted keys concatenated in the same order, and ``meta`` segments both (two
    pieces of one document are two segments, each over its own copy of the document's prefix)."""

    passes: tuple[RankPass, ...]
    needed: tuple[torch.Tensor, ...]
    """Per rank, ``[n_r] int64`` sorted global key positions its passes read (host)."""
    plan: CPShardPlan
    q_rows: torch.Tensor
    """``[n] int64`` local rows of the one call's queries (device): every pass's ``q_rows``, in pass order."""
    meta: Any
    """The one call's :class:`~longtrain.blockdiag_cp.meta.VarlenMeta`: every pass's segments, in pass order."""
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_real(self) -> int:
        return self.meta.n_real

    def key_index(self, kind: str, buffer_pos: torch.Tensor, device: Any) -> tuple[torch.Tensor, ...]:
        """Per pass, the indices of its keys in a K/V buffer whose row ``i`` holds global position
        ``buffer_pos[i]`` (host, every needed position present). Memoised per buffer ``kind`` and device."""
        key = ("key_index", kind, str(device))
        hit = self.cache.get(key)
        if hit is None:
            where = torch.full((self.plan.seq_len,), -1, dtype=torch.int64)
            where[buffer_pos] = torch.arange(buffer_pos.numel())
            hit = self.cache[key] = tuple(where[p.key_pos].to(device) for p in self.passes)
        return hit

    def a2a_splits(self, rank: int, device: Any) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """``(in_splits, out_splits, send_index, recv_pos)`` of the all-to-all-v that gives ``rank`` its needed keys:
        as a sender, the local rows every destination needs (destination order); as a receiver, the count from each
        source and the global position of every received row (source order). Memoised per device."""
        key = ("a2a", rank, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        plan = self.plan
        owner = torch.empty(plan.seq_len, dtype=torch.int64)
        local_row = torch.empty(plan.seq_len, dtype=torch.int64)
        for r, idx in enumerate(plan.token_index):
            owner[idx] = r
            local_row[idx] = torch.arange(idx.numel())
        in_splits, send = [], []
        for dest in range(plan.world_size):
            mine = self.needed[dest][owner[self.needed[dest]] == rank]
            in_splits.append(int(mine.numel()))
            send.append(local_row[mine])
        recv_pos = [self.needed[rank][owner[self.needed[rank]] == src] for src in range(plan.world_size)]
        out_splits = [int(p.numel()) for p in recv_pos]
        send_index = torch.cat(send).to(device) if send else torch.zeros(0, dtype=torch.int64, device=device)
        hit = self.cache[key] = (in_splits, out_splits, send_index, torch.cat(recv_pos))
        return hit


def _segments(plan: CPShardPlan, rank: int) -> list[tuple[int, int, int]]:
    """``(doc_start, q_lo, q_hi)`` of every document piece of ``rank`` (global positions, ascending)."""
    starts, acc = [], 0
    for n in plan.doc_lens:
        starts.append(acc)
        acc += n
    out = []
    for a, b in plan.pieces[rank]:
        d = max(bisect.bisect_right(starts, a) - 1, 0)
        while d < len(starts) and starts[d] < b:
            lo, hi = max(a, starts[d]), min(b, starts[d] + plan.doc_lens[d])
            if lo < hi:
                out.append((starts[d], lo, hi))
            d += 1
    return out


def rank_pieces(plan: CPShardPlan, rank: int, device: Any) -> RankPieces:
    """The passes of ``rank`` and every rank's needed key positions (host work, once per step)."""
    from .meta import meta_from_segments

    def passes_of(r: int) -> list[list[tuple[int, int, int]]]:
        passes: list[list[tuple[int, int, int]]] = []
        seen: dict[int, int] = {}
        for seg in _segments(plan, r):
            p = seen.get(seg[0], 0)
            seen[seg[0]] = p + 1
            while len(passes) <= p:
                passes.append([])
            passes[p].append(seg)
        return passes

    needed = []
    for r in range(plan.world_size):
        # Every piece of a document reads the document's keys from its start: the union of a rank's key ranges is
        # one range per document, [start, end of its last piece), and these are disjoint and ascending.
        reach: dict[int, int] = {}
        for ds, _, hi in _segments(plan, r):
            reach[ds] = max(reach.get(ds, hi), hi)
        pos = [torch.arange(ds, hi, dtype=torch.int64) for ds, hi in sorted(reach.items())]
        needed.append(torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64))
    index = plan.token_index[rank]
    built, all_segs = [], []
    for segs in passes_of(rank):
        q_pos = torch.cat([torch.arange(lo, hi, dtype=torch.int64) for _, lo, hi in segs])
        key_pos = torch.cat([torch.arange(ds, hi, dtype=torch.int64) for ds, _, hi in segs])
        built.append(RankPass(torch.searchsorted(index, q_pos).to(device), key_pos))
        all_segs += segs
    q_rows = torch.cat([p.q_rows for p in built]) if built else torch.zeros(0, dtype=torch.int64, device=device)
    meta = meta_from_segments([hi - lo for _, lo, hi in all_segs], [hi - ds for ds, _, hi in all_segs], device)
    return RankPieces(tuple(built), tuple(needed), plan, q_rows, meta)
