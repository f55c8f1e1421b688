"""Differentiable K/V exchanges for block-diagonal context parallelism, and the plans that drive them.

Three ways for a rank to obtain the keys/values its local queries need (its own shard ``[B, C, L, D]``,
``C = 2·Hkv`` because K and V travel stacked as one tensor):

- :class:`_AllGatherSeqDiff`: everybody gets everything (``all_gather``); backward is one reduce-scatter.
- :class:`_LeftHaloExchange`: each rank receives the tail of its left neighbour, one uniform size on every
  rank; backward is the reverse point-to-point exchange. Usable when no document spans more than two ranks.
- :class:`_NeededKVExchange`: all-to-all-v where every rank receives exactly ``[s_first, real_end)``;
  backward is the reverse all-to-all-v plus an ``index_add`` for tokens sent to several ranks.

The plans are computed from the replicated document ids, so every rank derives the same split sizes and
posts matching collectives. Collectives are looked up as ``torch.distributed.<fn>`` at call time so tests can
substitute counting or stub versions. Where a process-group backend lacks a collective (older gloo builds
have no ``reduce_scatter`` or uneven ``all_to_all_single``), :func:`_reduce_scatter` and
:func:`_all_to_all_single` fall back to the same semantics built from collectives it does have; NCCL always
takes the native collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

from . import kernels

__all__: list[str] = []

_UNSUPPORTED_MARKERS = ("not supported", "does not support", "unsupported", "not implemented", "unimplemented")
# (collective, backend) pairs whose native version raised "unsupported" once in this process.
_EMULATED: set[tuple[str, str]] = set()


def _backend_name(group: Any) -> str:
    try:
        return str(torch.distributed.get_backend(group)).lower()
    except Exception:  # an uninitialised default group or a stub group has no backend
        return ""


def _try_native(name: str, group: Any, call: Callable[[], None]) -> bool:
    """Run the native collective; False when the backend does not implement it (then remembered).

    A backend without the collective raises the same "unsupported" error on every rank before any data
    moves, so every rank switches to the emulation together.
    """
    if _EMULATED and (name, _backend_name(group)) in _EMULATED:
        return False
    try:
        call()
        return True
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        text = str(exc).lower()
        if not (isinstance(exc, NotImplementedError) or any(m in text for m in _UNSUPPORTED_MARKERS)):
            raise
        _EMULATED.add((name, _backend_name(group)))
        return False


def _reduce_scatter(out: torch.Tensor, chunks: list[torch.Tensor], group: Any) -> None:
    """``out = sum over ranks of chunks[rank]``: ``torch.distributed.reduce_scatter`` with op SUM, emulated by
    one all-reduce of the concatenated chunks on a backend without reduce_scatter."""
    dist = torch.distributed
    if _try_native(
        "reduce_scatter", group, lambda: dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
    ):
        return
    flat = torch.cat([c.reshape(-1) for c in chunks])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    rank = dist.get_rank(group)
    n = out.numel()
    out.copy_(flat[rank * n : (rank + 1) * n].view_as(out))


def _all_to_all_single(
    recv: torch.Tensor, send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> None:
    """``torch.distributed.all_to_all_single`` with uneven splits along dim 0, emulated with one batch of
    point-to-point sends/receives on a backend that lacks uneven all-to-all."""
    dist = torch.distributed

    def native() -> None:
        dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)

    if _try_native("all_to_all_single", group, native):
        return
    rank = dist.get_rank(group)
    send_off, recv_off = [0], [0]
    for n in in_splits:
        send_off.append(send_off[-1] + n)
    for n in out_splits:
        recv_off.append(recv_off[-1] + n)
    ops = []
    for peer in range(len(in_splits)):
        if peer == rank:
            recv[recv_off[peer] : recv_off[peer + 1]].copy_(send[send_off[peer] : send_off[peer + 1]])
            continue
        gpeer = _global_rank(group, peer)
        if in_splits[peer]:
            ops.append(dist.P2POp(dist.isend, send[send_off[peer] : send_off[peer + 1]].contiguous(), gpeer, group))
        if out_splits[peer]:
            ops.append(dist.P2POp(dist.irecv, recv[recv_off[peer] : recv_off[peer + 1]], gpeer, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (identity for the default group or no group)."""
    dist = torch.distributed
    if group is None:
        return group_rank
    try:
        if group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(group, group_rank)
    except Exception:  # stub groups in tests: ranks are already global
        return group_rank


class _AllGatherSeqDiff(torch.autograd.Function):
    """All-gather along ``seq_dim`` (``[B, C, L, D] -> [B, C, L·W, D]`` for ``seq_dim=2``); equal shards.

    Backward: the gradient of every position is summed over the ranks that read it (all of them) and
    scattered back to its owner: one reduce-scatter.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        dist = torch.distributed
        world = dist.get_world_size(group)
        x = x.contiguous()
        bufs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(bufs, x, group=group)
        ctx.group, ctx.seq_dim, ctx.world = group, seq_dim, world
        return torch.cat(bufs, dim=seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        chunks = [c.contiguous() for c in grad.chunk(ctx.world, dim=ctx.seq_dim)]
        out = torch.empty_like(chunks[0])
        _reduce_scatter(out, chunks, ctx.group)
        return out, None, None


def _compute_blockdiag_kv_plan(doc_ids_full: torch.Tensor, world: int, local_len: int, dev: Any = None) -> dict:
    """Every rank's needed K/V range, from the replicated ids ``[B, S_full]`` (row 0) or ``[S_full]``.

    One device-to-host copy of the ids, then pure host work: the segmentation of every rank runs on the
    CPU copy. Returns ``{"use_halo", "recv", "send", "nreal", "s_first", "real_end"}`` (lists of ``world``
    ints; ``recv[r]`` is the left straddle of rank r, ``send[r] = recv[r+1]``). ``use_halo`` is True when
    every straddle fits on the left neighbour (``recv[r] <= local_len``). ``dev`` is accepted for signature
    compatibility; the plan holds only Python ints.
    """
    ids = doc_ids_full[0] if doc_ids_full.dim() == 2 else doc_ids_full
    if ids.dim() != 1:
        raise ValueError(f"doc_ids must be [B, S_full] or [S_full], got shape {tuple(doc_ids_full.shape)}")
    if ids.numel() != world * local_len:
        raise ValueError(
            f"doc_ids cover {ids.numel()} positions but world*local_len = {world}*{local_len} = {world * local_len}"
        )
    ids_cpu = ids.detach().to("cpu", torch.int64)
    cpu = torch.device("cpu")
    recv, nreal, s_first, real_end = [], [], [], []
    for rr in range(world):
        off = rr * local_len
        seg = kernels._varlen_seg_for_rank(ids_cpu, off, local_len, cpu)
        if seg is None or int(seg.get("n_real", 0)) == 0:
            recv.append(0)
            nreal.append(0)
            s_first.append(off)
            real_end.append(off)
            continue
        sf, n = int(seg["s_first"]), int(seg["n_real"])
        recv.append(off - sf)
        nreal.append(n)
        s_first.append(sf)
        real_end.append(off + n)
    send = recv[1:] + [0]
    return {
        "use_halo": all(b <= local_len for b in recv),
        "recv": recv,
        "send": send,
        "nreal": nreal,
        "s_first": s_first,
        "real_end": real_end,
    }


class _LeftHaloExchange(torch.autograd.Function):
    """Receive the last ``halo_size`` positions of the left neighbour's ``[B, C, L, D]`` shard.

    Every rank but the last sends its tail to ``next_peer``; every rank but the first receives from
    ``prev_peer`` (global ranks, ``None`` for "no peer"). Rank 0 gets zeros. Backward sends the gradient
    of the received block back and returns it on the sent suffix (zeros elsewhere).
    """

    @staticmethod
    def forward(
        ctx: Any, x_local: torch.Tensor, group: Any, halo_size: int, prev_peer: int | None, next_peer: int | None
    ) -> torch.Tensor:
        b, c, length, d = x_local.shape
        if not 0 <= halo_size <= length:
            raise ValueError(f"halo_size={halo_size} must be within the local length {length}")
        recv = x_local.new_zeros((b, c, halo_size, d))
        send = x_local[:, :, length - halo_size :, :].contiguous()
        _p2p(
            group,
            send if next_peer is not None else None,
            next_peer,
            recv if prev_peer is not None else None,
            prev_peer,
        )
        ctx.group, ctx.halo, ctx.shape = group, halo_size, x_local.shape
        ctx.prev_peer, ctx.next_peer = prev_peer, next_peer
        return recv

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        b, c, length, d = ctx.shape
        out = grad.new_zeros((b, c, length, d))
        got = grad.new_zeros((b, c, ctx.halo, d))
        _p2p(
            ctx.group,
            grad.contiguous() if ctx.prev_peer is not None else None,
            ctx.prev_peer,
            got if ctx.next_peer is not None else None,
            ctx.next_peer,
        )
        out[:, :, length - ctx.halo :, :] = got
        return out, None, None, None, None


def _p2p(
    group: Any, send: torch.Tensor | None, send_to: int | None, recv: torch.Tensor | None, recv_from: int | None
) -> None:
    dist = torch.distributed
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, send_to, group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, recv_from, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _needed_kv_a2a_plan(
    plan: dict, rank: int, world: int, local_len: int, dev: Any
) -> tuple[list[int], list[int], torch.Tensor]:
    """Split sizes and the send index of the all-to-all-v that gives every rank ``[s_first, real_end)``.

    As a sender, ``in_splits[r] = |[rank·L, (rank+1)·L) ∩ [s_first_r, real_end_r)|`` and ``send_index``
    (``[sum(in_splits)] int64`` on ``dev``, local positions) lists those intersections in destination
    order; a token appears once per destination that needs it. As a receiver,
    ``out_splits[s] = |[s·L, (s+1)·L) ∩ [s_first_rank, real_end_rank)|``; in source order the pieces
    concatenate into exactly the needed range. Pure Python over the plan's ints: no sync.
    """
    lo_me, hi_me = rank * local_len, (rank + 1) * local_len
    in_splits: list[int] = []
    pieces: list[torch.Tensor] = []
    for r in range(world):
        lo, hi = max(lo_me, plan["s_first"][r]), min(hi_me, plan["real_end"][r])
        n = max(0, hi - lo)
        in_splits.append(n)
        if n:
            pieces.append(torch.arange(lo - lo_me, hi - lo_me, device=dev, dtype=torch.int64))
    s_me, e_me = plan["s_first"][rank], plan["real_end"][rank]
    out_splits = [max(0, min(e_me, (s + 1) * local_len) - max(s_me, s * local_len)) for s in range(world)]
    send_index = torch.cat(pieces) if pieces else torch.zeros(0, device=dev, dtype=torch.int64)
    return in_splits, out_splits, send_index


class _NeededKVExchange(torch.autograd.Function):
    """All-to-all-v of the needed K/V: ``[B, C, L, D]`` local shard -> ``[B, C, sum(out_splits), D]``.

    Backward runs the reverse all-to-all-v and accumulates the gradients of multicast tokens with
    ``index_add`` (the same sum the all-gather's reduce-scatter would form).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_local: torch.Tensor,
        group: Any,
        in_splits: list[int],
        out_splits: list[int],
        send_index: torch.Tensor,
    ) -> torch.Tensor:
        b, c, length, d = x_local.shape
        tokens = x_local.permute(2, 0, 1, 3)
        send = tokens.index_select(0, send_index).contiguous()
        recv = x_local.new_empty((sum(out_splits), b, c, d))
        _all_to_all_single(recv, send, list(out_splits), list(in_splits), group)
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.shape = group, list(in_splits), list(out_splits), x_local.shape
        ctx.save_for_backward(send_index)
        return recv.permute(1, 2, 0, 3).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (send_index,) = ctx.saved_tensors
        b, c, length, d = ctx.shape
        grad_tokens = grad.permute(2, 0, 1, 3).contiguous()
        back = grad.new_empty((sum(ctx.in_splits), b, c, d))
        _all_to_all_single(back, grad_tokens, ctx.in_splits, ctx.out_splits, ctx.group)
        acc = grad.new_zeros((length, b, c, d))
        acc.index_add_(0, send_index, back)
        return acc.permute(1, 2, 0, 3).contiguous(), None, None, None, None


def _zero_touch(query: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``query`` that stay attached to ``query`` and ``tensors`` in the autograd graph.

    - Exactly zero whatever the inputs hold: the touch multiplies *empty* slices (a ``0 * sum(K)`` touch turns
      into NaN when K holds inf or overflows in fp16); the gradients are exact zeros.
    - Attached: the backward collective of the K/V exchange fires on an all-padding rank too.
    - Saves a tensor for backward (the empty slices of the product): under non-reentrant activation
      checkpointing a region that saved nothing is never recomputed, so an all-padding rank would skip the
      exchange that the recompute of every other rank issues, and all ranks would hang.
    """
    flat = torch.cat([query.reshape(-1)[:0], *(t.reshape(-1)[:0].to(query.dtype) for t in tensors)])
    return torch.zeros_like(query) + (flat * flat).sum()


def _attend_needed(
    query: torch.Tensor,
    kv_needed: torch.Tensor,
    hkv: int,
    doc_ids: torch.Tensor,
    plan: dict,
    gm: dict,
    row_offset: int,
    scale: float | None,
    backend: str,
    dropout_p: float,
    real_end: int,
    diagnostic: dict,
) -> torch.Tensor | None:
    """Attention over the needed K/V block ``kv_needed: [B, 2·Hkv, R, D]`` (index 0 = global ``s_first``).

    An all-padding rank returns attached zeros (its exchange backward must still fire). Otherwise the step
    meta is rebased to the block (``s_first = 0``, ``real_end``) in a shallow copy: the validation cache dict
    is created on the step meta first, so the copies of every layer and of activation-checkpoint recompute
    share it and the host validation runs once per step and shape.
    """
    k_needed, v_needed = kv_needed[:, :hkv], kv_needed[:, hkv:]
    if int(gm.get("n_real", 0)) == 0:
        return _zero_touch(query, kv_needed)
    diagnostic.update(
        rank=plan["rank"],
        world=plan["world"],
        row_offset=row_offset,
        needed_len=int(kv_needed.shape[2]),
        validation_snapshot=gm.get("_validation_snapshot"),
    )
    gm.setdefault("_validation_cache", {})
    gm.setdefault("_needed_only_diagnostic", diagnostic)
    local_meta = dict(gm)
    local_meta["s_first"] = 0
    local_meta["real_end"] = real_end
    return kernels._cp_blockdiag_varlen(
        query, k_needed, v_needed, doc_ids, row_offset, scale, backend=backend, dropout_p=dropout_p, meta=local_meta
    )


def _blockdiag_halo_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    doc_ids: torch.Tensor,
    group: Any,
    plan: dict,
    gm: dict,
    row_offset: int,
    scale: float | None,
    backend: str,
    dropout_p: float,
) -> torch.Tensor | None:
    """Block-diagonal attention with the left-halo exchange. ``query: [B, Hq, L, D]``, ``key/value:
    [B, Hkv, L, D]`` local shards; ``gm`` is this rank's step meta (global coordinates).

    Returns ``[B, Hq, L, D]``, or None when the varlen kernel failed on this rank. The exchange has then
    already run: the caller must not fall back to another exchange alone (it runs the post-kernel consensus).
    """
    rank, world = plan["rank"], plan["world"]
    recv_count = plan["recv"][rank]
    max_halo = max(plan["recv"], default=0)
    hkv = key.shape[1]
    kv_local = torch.cat([key, value], dim=1)
    if max_halo > 0:
        prev_peer = _global_rank(group, rank - 1) if rank > 0 else None
        next_peer = _global_rank(group, rank + 1) if rank < world - 1 else None
        halo = _LeftHaloExchange.apply(kv_local, group, max_halo, prev_peer, next_peer)
        halo = halo[:, :, max_halo - recv_count :, :]
    else:
        halo = kv_local[:, :, :0, :]
    kv_needed = torch.cat([halo, kv_local], dim=2)
    diagnostic = {"path": "halo", "recv_count": recv_count, "max_halo": max_halo}
    real_end = recv_count + int(gm.get("n_real", 0))
    return _attend_needed(
        query, kv_needed, hkv, doc_ids, plan, gm, row_offset, scale, backend, dropout_p, real_end, diagnostic
    )


def _a2a_splits(plan: dict, rank: int, world: int, local_len: int, dev: Any) -> tuple[list, list, torch.Tensor]:
    """:func:`_needed_kv_a2a_plan`, memoised in the (per-step) plan per device."""
    memo = plan.setdefault("_a2a", {})
    key = (rank, world, local_len, str(dev))
    if key not in memo:
        memo[key] = _needed_kv_a2a_plan(plan, rank, world, local_len, dev)
    return memo[key]


def _blockdiag_a2a_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    doc_ids: torch.Tensor,
    group: Any,
    plan: dict,
    gm: dict,
    row_offset: int,
    scale: float | None,
    backend: str,
    dropout_p: float,
) -> torch.Tensor | None:
    """Block-diagonal attention with the all-to-all-v needed-only exchange (documents may span any number of
    ranks). Same arguments and contract as :func:`_blockdiag_halo_attention`."""
    rank, world = plan["rank"], plan["world"]
    local_len = query.shape[2]
    in_splits, out_splits, send_index = _a2a_splits(plan, rank, world, local_len, query.device)
    hkv = key.shape[1]
    kv_local = torch.cat([key, value], dim=1)
    kv_needed = _NeededKVExchange.apply(kv_local, group, in_splits, out_splits, send_index)
    diagnostic = {"path": "a2a", "in_splits": list(in_splits), "out_splits": list(out_splits)}
    real_end = plan["real_end"][rank] - plan["s_first"][rank]
    return _attend_needed(
        query, kv_needed, hkv, doc_ids, plan, gm, row_offset, scale, backend, dropout_p, real_end, diagnostic
    )
