"""Differentiable K/V exchanges for block-diagonal context parallelism.

Three ways for a rank to obtain the keys/values its local queries need. K and V travel stacked as one tensor
with the tokens along ``dim`` (the runtime uses ``[2, L, Hkv, D]``, tokens on dim 1, so that ``K`` and ``V`` of
the result are contiguous views):

- :func:`all_gather_tokens`: everybody gets everything (``all_gather``); backward is one reduce-scatter.
- :func:`left_halo`: each rank receives the tail of its left neighbour, one uniform size on every rank; backward
  is the reverse point-to-point exchange. Usable when no document spans more than two ranks.
- :func:`needed_a2a`: all-to-all-v where every rank receives exactly its needed range; backward is the reverse
  all-to-all-v plus an ``index_add`` for tokens sent to several ranks.

The sizes come from the step's replicated :class:`~longtrain.blockdiag_cp.step.ExchangePlan`, so every rank posts
matching collectives. Collectives are looked up as ``torch.distributed.<fn>`` at call time so tests can substitute
counting or stub versions. Where a process-group backend lacks a collective (older gloo builds have no
``reduce_scatter`` or uneven ``all_to_all_single``), :func:`_reduce_scatter` and :func:`_all_to_all_single` fall
back to the same semantics built from collectives it does have; NCCL always takes the native collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

from longtrain._autograd import differentiable_once

__all__ = ["GroupRef", "all_gather_tokens", "global_rank", "left_halo", "needed_a2a", "zero_touch"]


class GroupRef:
    """A process group held without keeping it alive (a weak reference where the object allows one).

    Steps and autograd graphs outlive a training loop easily (a module-level ``out`` keeps its graph); a strong
    reference would keep the group, and its gloo/NCCL threads, alive past ``destroy_process_group()`` until the
    interpreter tears down, where destroying it can abort the process. ``None`` (the default group) stays None.
    """

    __slots__ = ("_ref", "_strong")

    def __init__(self, group: Any):
        self._ref, self._strong = None, None
        if group is not None:
            try:
                self._ref = weakref.ref(group)
            except TypeError:  # stub groups in tests
                self._strong = group

    def __call__(self) -> Any:
        if self._ref is None:
            return self._strong
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the CP process group was destroyed (torch.distributed.destroy_process_group) while a step or an "
                "autograd graph of longtrain still used it: run backward and drop the step before destroying it"
            )
        return group


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
        gpeer = global_rank(group, peer)
        if in_splits[peer]:
            ops.append(dist.P2POp(dist.isend, send[send_off[peer] : send_off[peer + 1]].contiguous(), gpeer, group))
        if out_splits[peer]:
            ops.append(dist.P2POp(dist.irecv, recv[recv_off[peer] : recv_off[peer + 1]], gpeer, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def global_rank(group: Any, group_rank: int) -> int:
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
    """All-gather along ``seq_dim`` (``[..., L, ...] -> [..., L·W, ...]``); equal shards.

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
        ctx.group, ctx.seq_dim, ctx.world = GroupRef(group), seq_dim, world
        return torch.cat(bufs, dim=seq_dim)

    @staticmethod
    @differentiable_once("the CP all-gather of K/V")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        chunks = [c.contiguous() for c in grad.chunk(ctx.world, dim=ctx.seq_dim)]
        out = torch.empty_like(chunks[0])
        _reduce_scatter(out, chunks, ctx.group())
        return out, None, None


def all_gather_tokens(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's shard of ``x`` concatenated along ``dim`` (differentiable; backward is one reduce-scatter)."""
    return _AllGatherSeqDiff.apply(x, group, dim)


class _LeftHaloExchange(torch.autograd.Function):
    """Receive the last ``halo_size`` positions (along ``dim``) of the left neighbour's shard.

    Every rank but the last sends its tail to ``next_peer``; every rank but the first receives from
    ``prev_peer`` (global ranks, ``None`` for "no peer"). Rank 0 gets zeros. Backward sends the gradient
    of the received block back and returns it on the sent suffix (zeros elsewhere).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, halo_size: int, prev_peer: int | None, next_peer: int | None, dim: int
    ) -> torch.Tensor:
        length = x.shape[dim]
        if not 0 <= halo_size <= length:
            raise ValueError(f"halo_size={halo_size} must be within the local length {length}")
        shape = list(x.shape)
        shape[dim] = halo_size
        recv = x.new_zeros(shape)
        send = x.narrow(dim, length - halo_size, halo_size).contiguous()
        _p2p(group, send if next_peer is not None else None, next_peer, recv if prev_peer is not None else None,
             prev_peer)  # fmt: skip
        ctx.group, ctx.halo, ctx.shape, ctx.dim = GroupRef(group), halo_size, x.shape, dim
        ctx.prev_peer, ctx.next_peer = prev_peer, next_peer
        return recv

    @staticmethod
    @differentiable_once("the CP halo exchange of K/V")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        length = ctx.shape[ctx.dim]
        out = grad.new_zeros(ctx.shape)
        got = torch.zeros_like(grad)
        _p2p(ctx.group(), grad.contiguous() if ctx.prev_peer is not None else None, ctx.prev_peer,
             got if ctx.next_peer is not None else None, ctx.next_peer)  # fmt: skip
        out.narrow(ctx.dim, length - ctx.halo, ctx.halo).copy_(got)
        return out, None, None, None, None, None


def left_halo(
    x: torch.Tensor, group: Any, halo_size: int, prev_peer: int | None, next_peer: int | None, dim: int
) -> torch.Tensor:
    """The last ``halo_size`` positions of the left neighbour's shard (zeros on the first rank), differentiable."""
    return _LeftHaloExchange.apply(x, group, halo_size, prev_peer, next_peer, dim)


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


class _NeededKVExchange(torch.autograd.Function):
    """All-to-all-v of the needed K/V: a local shard (tokens along ``dim``) -> the tokens of ``sum(out_splits)``.

    Backward runs the reverse all-to-all-v and accumulates the gradients of multicast tokens with
    ``index_add`` (the same sum the all-gather's reduce-scatter would form).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: Any,
        in_splits: list[int],
        out_splits: list[int],
        send_index: torch.Tensor,
        dim: int,
    ) -> torch.Tensor:
        tokens = x.movedim(dim, 0)
        send = tokens.index_select(0, send_index).contiguous()
        recv = x.new_empty((sum(out_splits), *tokens.shape[1:]))
        _all_to_all_single(recv, send, list(out_splits), list(in_splits), group)
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.dim = GroupRef(group), list(in_splits), list(out_splits), dim
        ctx.tokens_shape = tokens.shape
        ctx.save_for_backward(send_index)
        return recv.movedim(0, dim).contiguous()

    @staticmethod
    @differentiable_once("the CP all-to-all-v exchange of K/V")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (send_index,) = ctx.saved_tensors
        grad_tokens = grad.movedim(ctx.dim, 0).contiguous()
        back = grad.new_empty((sum(ctx.in_splits), *grad_tokens.shape[1:]))
        _all_to_all_single(back, grad_tokens, ctx.in_splits, ctx.out_splits, ctx.group())
        acc = grad.new_zeros(ctx.tokens_shape)
        acc.index_add_(0, send_index, back)
        return acc.movedim(0, ctx.dim).contiguous(), None, None, None, None, None


def needed_a2a(
    x: torch.Tensor, group: Any, in_splits: list[int], out_splits: list[int], send_index: torch.Tensor, dim: int
) -> torch.Tensor:
    """Exactly the needed tokens (``sum(out_splits)`` along ``dim``) by one all-to-all-v, differentiable."""
    return _NeededKVExchange.apply(x, group, in_splits, out_splits, send_index, dim)


def zero_touch(like: torch.Tensor, *attached: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``like`` that stay attached to the ``attached`` tensors in the autograd graph.

    - Exactly zero whatever the inputs hold: the touch multiplies *empty* slices (a ``0 * sum(K)`` touch turns
      into NaN when K holds inf or overflows in fp16); the gradients are exact zeros.
    - Attached: the backward collective of the K/V exchange fires on an all-padding rank too.
    - Saves a tensor for backward (the empty slices of the product): under non-reentrant activation
      checkpointing a region that saved nothing is never recomputed, so an all-padding rank would skip the
      exchange that the recompute of every other rank issues, and all ranks would hang.
    """
    flat = torch.cat([like.reshape(-1)[:0].detach(), *(t.reshape(-1)[:0].to(like.dtype) for t in attached)])
    return torch.zeros_like(like) + (flat * flat).sum()
