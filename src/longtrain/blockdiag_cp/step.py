"""``CPStep``: the typed, frozen per-step object every block-diagonal attention path reads, at every world size.

A step is one packed row sharded contiguously over the ``W`` ranks of a context-parallel group (``W = 1``
included: then there is no collective, but attention is still block-diagonal). It is built once per step by
:func:`build_cp_step` (which :func:`~longtrain.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx` calls) from the
replicated document ids, with one device-to-host copy of the ids: this rank's segmentation
(:class:`~longtrain.blockdiag_cp.meta.VarlenMeta`), every rank's needed K/V range (:class:`ExchangePlan`) and the
packed run boundaries all come from that copy, so attention layers do no host work. Decisions made at the first
attention call of the step (the concrete backend for the call's dtype, the needed-only preflight) are memoised on
the step (``cache``), so every rank makes them once, in the same order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed

from . import state
from .compiled import maybe_disable_dynamo
from .exchange import GroupRef
from .meta import VarlenMeta, check_packed_layout, resolve_device, segment_rank
from .sharding import plan_cp_shards, rank_pieces

__all__ = ["CPStep", "ExchangePlan", "build_cp_step", "packed_runs", "resolve_cp_group"]


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """Every rank's needed K/V range, from the replicated ids (identical on every rank). Lists of ``W`` ints."""

    recv: tuple[int, ...]
    """``recv[r]``: the left straddle of rank ``r`` (keys of its first document that live on lower ranks)."""
    nreal: tuple[int, ...]
    """Real query rows of each rank."""
    s_first: tuple[int, ...]
    """First needed key position of each rank (its own first position when it has no straddle or no real row)."""
    real_end: tuple[int, ...]
    """One past the last needed key position of each rank."""
    local_len: int
    """Rows per rank."""
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.recv)

    @property
    def send(self) -> tuple[int, ...]:
        """``send[r] = recv[r + 1]`` (0 for the last rank): what rank ``r`` sends right under the halo exchange."""
        return (*self.recv[1:], 0)

    @property
    def use_halo(self) -> bool:
        """Every straddle fits on the left neighbour (no document spans more than two ranks)."""
        return all(b <= self.local_len for b in self.recv)

    @property
    def max_halo(self) -> int:
        return max(self.recv, default=0)

    def a2a_splits(self, rank: int, device: Any) -> tuple[list[int], list[int], torch.Tensor]:
        """``(in_splits, out_splits, send_index)`` of the all-to-all-v that gives ``rank`` exactly its needed range.

        As a sender, ``in_splits[r] = |[rank·L, (rank+1)·L) ∩ [s_first_r, real_end_r)|`` and ``send_index``
        (``[sum(in_splits)] int64`` local positions on ``device``) lists those intersections in destination order; a
        token appears once per destination that needs it. As a receiver, ``out_splits[s]`` is the size of source
        ``s``'s piece of ``[s_first_rank, real_end_rank)``; in source order the pieces concatenate into exactly the
        needed range. Memoised per ``(rank, device)``.
        """
        key = (rank, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        length = self.local_len
        lo_me, hi_me = rank * length, (rank + 1) * length
        in_splits: list[int] = []
        pieces: list[int] = []
        for r in range(self.world_size):
            lo, hi = max(lo_me, self.s_first[r]), min(hi_me, self.real_end[r])
            n = max(0, hi - lo)
            in_splits.append(n)
            pieces.extend(range(lo - lo_me, hi - lo_me))
        s_me, e_me = self.s_first[rank], self.real_end[rank]
        out_splits = [max(0, min(e_me, (s + 1) * length) - max(s_me, s * length)) for s in range(self.world_size)]
        send_index = torch.tensor(pieces, dtype=torch.int64, device=device)
        hit = self.cache[key] = (in_splits, out_splits, send_index)
        return hit


def exchange_plan(ids: torch.Tensor, world: int, local_len: int) -> ExchangePlan:
    """The :class:`ExchangePlan` of the host row ``ids: [W·L] int64`` (validated packed layout). Host work only."""
    if ids.numel() != world * local_len:
        raise ValueError(
            f"doc_ids cover {ids.numel()} positions but world*local_len = {world}*{local_len} = {world * local_len}"
        )
    n = ids.numel()
    pos = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    if n > 1:
        starts[1:] = ids[1:] != ids[:-1]
    run_start = torch.cummax(torch.where(starts, pos, 0), 0).values
    chunks = ids.view(world, local_len)
    nreal = (chunks > 0).sum(1).tolist()
    first = pos.view(world, local_len)[:, 0]
    s_first = torch.where(chunks[:, 0] > 0, run_start[first], first).tolist()
    offsets = first.tolist()
    recv = [o - s for o, s in zip(offsets, s_first)]
    real_end = [o + r for o, r in zip(offsets, nreal)]
    return ExchangePlan(tuple(recv), tuple(nreal), tuple(s_first), tuple(real_end), local_len)


def doc_lengths(ids_host: torch.Tensor, runs: torch.Tensor) -> list[int]:
    """Lengths of the documents of a validated packed row (runs with a nonzero id), in row order."""
    flat = ids_host.reshape(-1)
    return [int(b - a) for a, b in zip(runs[:-1].tolist(), runs[1:].tolist()) if int(flat[a]) != 0]


def packed_runs(ids_host: torch.Tensor) -> torch.Tensor:
    """Run boundaries ``[n_runs+1] int64`` of the flattened padded ids (the padding tail is its own run)."""
    flat = ids_host.reshape(-1)
    change = (flat[1:] != flat[:-1]).nonzero().flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change, torch.tensor([flat.numel()], dtype=torch.int64)])


def resolve_cp_group(cp_mesh: Any) -> tuple[Any, int, int]:
    """``(group, rank, world_size)`` of a CP mesh argument.

    Accepted: ``None`` (one rank, no group); a ``torch.distributed`` ``ProcessGroup``; a 1-D ``DeviceMesh`` (a named
    dim of a larger mesh, ``mesh["cp"]``, is one); any object with ``size()``, ``get_local_rank()`` and
    ``get_group()``. An unsliced multi-dimensional mesh or anything else is a ``TypeError`` saying what to pass.
    """
    dist = torch.distributed
    if cp_mesh is None:
        return None, 0, 1
    if dist.is_available() and isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh, dist.get_rank(cp_mesh), dist.get_world_size(cp_mesh)
    ndim = getattr(cp_mesh, "ndim", 1)
    if isinstance(ndim, int) and ndim != 1:
        names = getattr(cp_mesh, "mesh_dim_names", None)
        hint = f"mesh[{names[-1]!r}]" if names else "the 1-D context-parallel sub-mesh"
        raise TypeError(
            f"cp_mesh is a {ndim}-D DeviceMesh (dims {names}); pass only its context-parallel dimension, e.g. {hint}, "
            "or that dimension's ProcessGroup"
        )
    if not all(callable(getattr(cp_mesh, m, None)) for m in ("size", "get_local_rank", "get_group")):
        raise TypeError(
            f"cp_mesh must be None, a ProcessGroup, a 1-D DeviceMesh or an object with size(), get_local_rank() and "
            f"get_group(); got {type(cp_mesh).__name__}"
        )
    world = int(cp_mesh.size())
    if world <= 1:
        return cp_mesh.get_group() if world == 1 else None, 0, 1
    rank = int(cp_mesh.get_local_rank())
    group = cp_mesh.get_group()
    group_world = dist.get_world_size(group)
    if group_world != world:
        raise RuntimeError(
            f"the K/V all-gather group has world size {group_world} but cp_mesh.size() is {world}: the CP sub-group "
            "was mis-resolved (a DeviceMesh flatten/slice bug seen on torch 2.8 with dp>1); upgrade torch or pass "
            "the 1-D CP mesh"
        )
    if not 0 <= rank < world:
        raise RuntimeError(f"cp_mesh.get_local_rank() returned {rank}, outside [0, {world})")
    return group, rank, world


@dataclass(frozen=True, kw_only=True, eq=False)
class CPStep:
    """One packed row's context-parallel step, as every attention path of the package reads it.

    Build it with :func:`build_cp_step` (or get it from ``make_cp_blockdiag_batch_and_ctx``'s context:
    ``with ctx() as step``). Fields are host values and step-constant device tensors; nothing here changes
    during the step except the memo ``cache``.
    """

    group_ref: Any = field(repr=False)
    """The CP process group, held weakly (:class:`~longtrain.blockdiag_cp.exchange.GroupRef`): read :attr:`group`."""
    rank: int
    """This rank's index in the group."""
    world_size: int
    """``W``: ranks in the group (1 included)."""
    doc_ids: torch.Tensor
    """``[1, S_full] int64`` document ids of the whole padded row (0 == padding) on the compute device, replicated."""
    row_offset: int
    """Global position of this rank's first row: ``rank * local_len``."""
    local_len: int
    """``L = S_full / W``: rows per rank."""
    varlen_meta: VarlenMeta
    """This rank's segmentation (global key coordinates)."""
    kv_plan: ExchangePlan | None
    """Every rank's needed K/V range (``None`` when ``W == 1``)."""
    attn_backend: str
    """The configured backend, canonical (``"auto"`` or a provider name), resolved once from the knobs."""
    kv_exchange: str
    """The configured K/V exchange, canonical (``"allgather"``, ``"halo"`` or ``"a2a"``)."""
    packed_cu_seqlens: torch.Tensor
    """``[n_runs+1] int64`` run boundaries of the padded row on the compute device (padding tail: its own run)."""
    packed_cu_seqlens_cpu: torch.Tensor
    """The same on the host."""
    device: torch.device
    """The compute device."""
    layout_hash: str = ""
    """A hash of the whole row's ids and length and of the sharding (what the ranks compare once per step)."""
    shard_plan: Any = None
    """The :class:`~longtrain.blockdiag_cp.sharding.CPShardPlan` of the row (every rank's positions)."""
    pieces: Any = None
    """``None`` when this rank owns the contiguous rows ``[row_offset, row_offset + local_len)``; else its
    :class:`~longtrain.blockdiag_cp.sharding.RankPieces` (``sharding="balanced"``): the varlen passes over its
    pieces and every rank's needed keys. ``row_offset`` is then -1 and ``varlen_meta`` the segmentation of
    the rank's one varlen call over its compacted keys (``RankPieces.meta``)."""
    token_index: torch.Tensor | None = None
    """``[L] int64`` global positions of this rank's rows on the compute device (ascending)."""
    cache: dict = field(default_factory=dict, repr=False)
    """Memos of the step's first attention call (concrete backend per dtype, exchange path, preflight)."""

    @property
    def group(self) -> Any:
        """The CP process group (``None`` on one rank without a group); the step does not keep it alive."""
        return self.group_ref()

    @property
    def contiguous(self) -> bool:
        """Whether this rank's rows are one range (``sharding="contiguous"``, or a balanced plan that is)."""
        return self.pieces is None

    def require_contiguous(self, what: str) -> None:
        """A ``ValueError`` for consumers that read this rank's rows as one range, on a balanced step."""
        if not self.contiguous:
            raise ValueError(
                f"{what} reads this rank's rows as one contiguous range, but the step's sharding is balanced (each "
                "rank owns several pieces of the row); build the step with sharding='contiguous'"
            )

    @property
    def model_state(self) -> state.BlockdiagCpModelState:
        """The view model layers read through :func:`~longtrain.blockdiag_cp.current_blockdiag_cp_state`."""
        self.require_contiguous("the model state (document runs for layers with their own CP path)")
        return state.BlockdiagCpModelState(self.group, self.packed_cu_seqlens, self.packed_cu_seqlens_cpu)

    @property
    def meta(self) -> VarlenMeta:
        """Alias of :attr:`varlen_meta`."""
        return self.varlen_meta

    @property
    def plan(self) -> ExchangePlan | None:
        """Alias of :attr:`kv_plan`."""
        return self.kv_plan

    @property
    def full_len(self) -> int:
        """``S_full``: the padded row length."""
        return self.world_size * self.local_len

    def backend_for(self, dtype: torch.dtype, dropout_p: float = 0.0) -> str:
        """The concrete provider a call of ``dtype`` runs (``"auto"`` resolved once per dtype and dropout)."""
        from .providers import resolve_backend

        key = ("backend", dtype, dropout_p > 0)
        name = self.cache.get(key)
        if name is None:
            name = self.cache[key] = resolve_backend(
                self.attn_backend, dtype, self.device, dropout_p=dropout_p, meta=self.varlen_meta
            )
        return name


def build_cp_step(
    doc_ids: torch.Tensor,
    cp_mesh: Any = None,
    *,
    device: Any = None,
    attn_backend: str | None = None,
    kv_exchange: str | None = None,
    sharding: str | None = None,
    shard_chunk: int | None = None,
) -> CPStep:
    """The :class:`CPStep` of one packed row of document ids, for this rank of ``cp_mesh``.

    ``doc_ids: [S_full] or [1, S_full]`` integer (0 == padding; padding only as one tail, each document one
    contiguous run), the whole padded row, identical on every rank; ``S_full`` must be a multiple of the world size
    (``make_cp_blockdiag_batch_and_ctx`` pads to a multiple of ``2W``). ``cp_mesh``: see :func:`resolve_cp_group`.
    ``device``: where attention runs (default: the ids' device). ``attn_backend`` / ``kv_exchange``: override the
    knobs of :func:`~longtrain.blockdiag_cp.configure_cp_varlen` for this step (any synonym). ``sharding`` /
    ``shard_chunk``: which positions each rank owns (:func:`~longtrain.blockdiag_cp.plan_cp_shards`; default: the
    knobs); with ``"balanced"`` the caller must give each rank its rows in the plan's order
    (``step.token_index``; the batch builder does).

    Makes one device-to-host copy of the ids; raises ``ValueError``/``TypeError`` for a malformed row.
    """
    if (
        not isinstance(doc_ids, torch.Tensor)
        or doc_ids.dim() not in (1, 2)
        or (doc_ids.dim() == 2 and len(doc_ids) != 1)
    ):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"doc_ids must be one packed row, [S] or [1, S], got {got}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.device.type == "meta":
        raise ValueError("doc_ids are on the meta device (no data); pass the real ids of the row")
    group, rank, world = resolve_cp_group(cp_mesh)
    cfg = state.cp_varlen_runtime_config()
    backend = state.require_provided(
        state.normalize_attn_backend(attn_backend if attn_backend is not None else cfg["attn_backend"])
    )
    exchange = state.normalize_kv_exchange(kv_exchange if kv_exchange is not None else cfg["kv_exchange"])
    dev = resolve_device(device if device is not None else doc_ids.device)
    row = doc_ids.reshape(-1)
    full_len = row.numel()
    if full_len == 0:
        raise ValueError("doc_ids hold no position (an empty row); a CP step needs a packed row of at least one token")
    if full_len % world:
        raise ValueError(
            f"the packed row has {full_len} positions, not a multiple of the CP world size {world}; pad it with "
            "document id 0 (make_cp_blockdiag_batch_and_ctx pads to a multiple of 2 * world size)"
        )
    local_len = full_len // world
    host = row.detach().to("cpu", torch.int64)  # the one device-to-host copy of the step
    check_packed_layout(host)
    mode = sharding if sharding is not None else state.sharding_mode()
    chunk = shard_chunk if shard_chunk is not None else state.shard_chunk()
    runs_cpu = packed_runs(host)
    shard_plan = plan_cp_shards(doc_lengths(host, runs_cpu), world, sharding=mode, chunk=chunk,
                                pad=int((host == 0).sum()))  # fmt: skip
    pieces = token_index = None
    if shard_plan.is_contiguous:
        meta = segment_rank(host, rank * local_len, local_len, dev)
        plan = exchange_plan(host, world, local_len) if world > 1 else None
        row_offset = rank * local_len
    else:
        pieces = rank_pieces(shard_plan, rank, dev)
        meta = pieces.meta
        plan, row_offset = None, -1
        token_index = shard_plan.token_index[rank].to(dev)
    runs = runs_cpu.to(dev)
    # A copy, never a view of the caller's ids: a frozen step must not change when the caller reuses its buffer.
    ids_dev = row.detach().to(device=dev, dtype=torch.int64, copy=True).view(1, full_len)
    digest = hashlib.blake2b(host.numpy().tobytes() + f"{shard_plan.sharding}/{chunk}".encode(), digest_size=8)
    digest = f"{digest.hexdigest()}/{shard_plan.sharding}"
    maybe_disable_dynamo()  # the step's attention must not be traced by torch.compile (see runtime)
    return CPStep(
        group_ref=GroupRef(group),
        rank=rank,
        world_size=world,
        doc_ids=ids_dev,
        row_offset=row_offset,
        local_len=local_len,
        varlen_meta=meta,
        kv_plan=plan,
        attn_backend=backend,
        kv_exchange=exchange,
        packed_cu_seqlens=runs,
        packed_cu_seqlens_cpu=runs_cpu,
        device=dev,
        layout_hash=f"{digest}/{full_len}",
        shard_plan=shard_plan,
        pieces=pieces,
        token_index=token_index,
    )
