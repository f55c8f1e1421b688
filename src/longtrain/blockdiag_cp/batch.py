"""``make_cp_blockdiag_batch_and_ctx``: shard one packed batch contiguously over the CP ranks and build the
step context in which ``cp_blockdiag_sdpa`` runs block-diagonal attention.

Everything is validated before the caller's batch is touched: a bad batch raises and leaves it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed
import torch.utils.checkpoint

from longtrain.packing import doc_starts_from_positions

from . import state
from .compiled import maybe_disable_dynamo
from .step import CPStep, build_cp_step, resolve_cp_group

__all__ = ["ShardLayout", "make_cp_blockdiag_batch_and_ctx"]

# Keys sharded along the sequence when present as tensors; everything else (pixel values, grids, ...) is
# left alone.
_SHARD_KEYS = (
    "inputs_embeds",
    "input_ids",
    "labels",
    "position_ids",
    "_packed_seq_ids",
    "loss_mask",
    "padding_mask",
    "visual_pos_masks",
)
_PRIMARY_KEYS = ("inputs_embeds", "input_ids")
_IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardLayout:
    """Sequence lengths of a sharded batch: ``original_seq_len`` before padding, ``padded_seq_len`` after
    padding to a multiple of ``2 * cp_size`` (equal to the original on one rank), and the step it belongs to."""

    original_seq_len: int
    padded_seq_len: int
    step: CPStep | None = field(default=None, compare=False, repr=False)

    def unshard(self, local: Any, dim: int = 1) -> torch.Tensor:
        """A local tensor (this rank's rows along ``dim``, e.g. logits ``[1, L, V]``) back in row order, the
        padding removed: ``[..., original_seq_len, ...]``. Pass one tensor to all-gather it over the CP group (a
        collective: every rank calls it), or every rank's tensors as a list (no collective). Differentiable only
        in the list form."""
        step = self.step
        world = step.world_size if step is not None else 1
        single = not isinstance(local, (list, tuple))
        parts = [local] if single else list(local)
        if not single and len(parts) != world:
            raise ValueError(f"unshard takes this rank's tensor or one tensor per rank ({world}), got {len(parts)}")
        local_len = self.padded_seq_len // world
        for r, part in enumerate(parts):
            ok = isinstance(part, torch.Tensor) and -part.dim() <= dim < part.dim() and part.shape[dim] == local_len
            if not ok:
                got = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
                raise ValueError(
                    f"unshard takes the {local_len} local rows of {'this rank' if single else f'rank {r}'} along dim "
                    f"{dim}, got a tensor of shape {got}; pass dim= the sequence axis of the local tensor (e.g. dim=0 "
                    "for [L, H])"
                )
        if single and world > 1:
            parts = [torch.empty_like(local) for _ in range(world)]
            torch.distributed.all_gather(parts, local.contiguous(), group=step.group)
        if step is None or step.contiguous:
            joined = torch.cat(parts, dim=dim)
        else:
            joined = step.shard_plan.unshard(parts, dim=dim)
        return joined.narrow(dim, 0, self.original_seq_len)


def _fill_value(key: str, tensor: torch.Tensor, padding_token_id: int) -> Any:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return 0.0
    if key == "input_ids":
        return padding_token_id
    if key == "labels":
        return _IGNORE_INDEX
    if key == "padding_mask":
        return True
    return 0  # _packed_seq_ids, loss_mask, visual_pos_masks (False), position_ids, ...


def _seq_dim(key: str, tensor: torch.Tensor) -> int:
    # mRoPE position ids are [3|4, B, S]; every other sequence-aligned tensor is [B, S, ...].
    return 2 if key == "position_ids" and tensor.dim() == 3 else 1


def _shard(tensor: torch.Tensor, key: str, seq_len: int, full_len: int, row_offset: int, local_len: int, fill: Any):
    """Rows ``[row_offset, row_offset + local_len)`` of ``tensor`` padded with ``fill`` to ``full_len``.

    A rank whose rows lie inside the unpadded sequence gets a view (differentiable, no copy); only the rank
    holding the padding tail builds a new tensor.
    """
    dim = _seq_dim(key, tensor)
    end = row_offset + local_len
    if end <= seq_len:
        return tensor.narrow(dim, row_offset, local_len)
    real = tensor.narrow(dim, min(row_offset, seq_len), max(0, seq_len - row_offset))
    shape = list(tensor.shape)
    shape[dim] = local_len - real.shape[dim]
    pad = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([real, pad], dim=dim)


#: Batch keys that describe document boundaries; dropped from the sharded batch (the step carries them).
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens")


@dataclass(frozen=True)
class _Source:
    """Document ids ``[B, S]`` read from one batch key: ``ids`` (0 = padding where ``pad`` says so)."""

    name: str
    ids: torch.Tensor
    boundaries: bool
    """Whether the key says where documents start (a 0/1 ``attention_mask`` only marks padding)."""
    pad: torch.Tensor | None
    """``[B, S]`` bool padding the key marks, or None when it cannot mark padding (``position_ids``)."""


def _ids_from_offsets(cu: torch.Tensor, seq_len: int, batch_size: int, key: str) -> torch.Tensor:
    if cu.dim() != 1 or batch_size != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"batch[{key!r}] must be 1-D integer offsets [N+1] of one packed row, got {cu.dtype} "
                         f"{tuple(cu.shape)} for a batch of {batch_size}")  # fmt: skip
    host = cu.detach().to("cpu", torch.int64)
    if host.numel() == 0 or int(host[0]) != 0 or bool((host[1:] < host[:-1]).any()) or int(host[-1]) > seq_len:
        raise ValueError(
            f"batch[{key!r}] = {host.tolist()[:12]} must be non-decreasing offsets from 0 to at most the row length "
            f"{seq_len}"
        )
    lengths = host[1:] - host[:-1]
    docs = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    return torch.cat([docs, docs.new_zeros(seq_len - docs.numel())])[None]


def _ids_from_positions(pos: torch.Tensor, seq_len: int, batch_size: int) -> torch.Tensor:
    starts = doc_starts_from_positions(pos)
    return torch.cumsum(starts.to(torch.int64), dim=-1)


def _boundary_sources(batch: dict, seq_len: int, batch_size: int) -> list[_Source]:
    """Every boundary-carrying key of the batch, in precedence order (host tensors, ``[B, S]``)."""
    out: list[_Source] = []
    for key in ("_packed_seq_ids", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "position_ids", "attention_mask"):
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(f"batch[{key!r}] is on the meta device (no data); pass the real tensor of the row")
    ids = batch.get("_packed_seq_ids")
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(
                f"batch['_packed_seq_ids'] must be an integer tensor of document ids (0 == padding), got {ids.dtype}"
            )
        host = ids.detach().to("cpu", torch.int64)
        host = host[None] if host.dim() == 1 else host
        out.append(_Source("_packed_seq_ids", host, True, host == 0))
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):  # every one present must agree (training: q == k)
        cu = batch.get(key)
        if isinstance(cu, torch.Tensor):
            docs = _ids_from_offsets(cu, seq_len, batch_size, key)
            out.append(_Source(key, docs, True, docs == 0))
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.shape[-1] == seq_len and not pos.dtype.is_complex:
        # The one rule of every reader (doc_starts_from_positions), on the positions' own dtype: float positions
        # restart documents as integer ones do.
        host = pos.detach().cpu()
        docs = _ids_from_positions(host if host.dtype.is_floating_point else host.to(torch.int64), seq_len, batch_size)
        # position ids that never restart are positions the model wants, not boundaries (e.g. no position reset)
        out.append(_Source("position_ids", docs, bool((docs[:, -1] > 1).any()), None))
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        docs = _doc_ids_from_4d_mask(mask.detach().cpu())
        out.append(_Source("attention_mask", docs, True, docs == 0))
    elif isinstance(mask, torch.Tensor) and mask.dim() in (1, 2):
        host = mask.detach().cpu()
        host = host[None] if host.dim() == 1 else host
        values = host if not (host.dtype.is_floating_point or host.dtype.is_complex) else (host != 0)
        values = values.to(torch.int64)
        out.append(_Source("attention_mask", values, bool((values > 1).any()), values == 0))
    return out


def _run_starts(ids: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def _cp_blockdiag_doc_ids(batch: dict, seq_len: int, device: torch.device, batch_size: int) -> torch.Tensor:
    """Per-position document ids ``[B, S] int64`` on ``device`` (0 == padding); reads, never mutates, ``batch``.

    Boundary sources, first present wins: ``_packed_seq_ids``; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``cu_seqlens``
    (offsets of one packed row, Hugging Face's flash-attention kwargs); ``position_ids`` (a document starts wherever
    they are 0, Hugging Face's packing convention; mRoPE ``[3|4, B, S]`` from its first plane; position ids that never
    restart mark no boundary); ``attention_mask`` (4-D: documents recovered from the diagonal; 2-D: taken as ids when it
    holds values above 1, else a 0/1 mask: one document plus padding); otherwise one document without padding. Padding
    is what the winning source marks, else what a 0/1 ``attention_mask`` marks (``== 0``).

    Every other present source must agree: the same document starts on real tokens (for a boundary source) and
    no real token where it marks padding. A disagreement is a ``ValueError`` naming both keys and the first
    position where they differ.
    """
    sources = _boundary_sources(batch, seq_len, batch_size)
    for src in sources:
        if tuple(src.ids.shape) != (batch_size, seq_len):
            raise ValueError(
                f"document ids from batch[{src.name!r}] have shape {tuple(src.ids.shape)}, expected [B, S] = "
                f"[{batch_size}, {seq_len}] like the primary input stream"
            )
    primary = next((src for src in sources if src.boundaries), None)
    if primary is None:
        ids = torch.ones(batch_size, seq_len, dtype=torch.int64)
        pad_src = next((src for src in sources if src.pad is not None), None)
        if pad_src is not None:
            ids = torch.where(pad_src.pad, 0, ids)
    else:
        ids = primary.ids
        if primary.pad is None:
            pad_src = next((src for src in sources if src.pad is not None), None)
            if pad_src is not None:
                ids = torch.where(pad_src.pad, 0, ids)
    pad = ids == 0
    real_pairs = ~pad
    real_pairs[:, 1:] &= ~pad[:, :-1]
    real_pairs[:, 0] = False
    starts = _run_starts(ids)
    for src in sources:
        if src is primary:
            continue
        if src.pad is not None and bool((src.pad & ~pad).any()):
            b, p = (int(x) for x in (src.pad & ~pad).nonzero()[0])
            raise ValueError(
                f"batch[{src.name!r}] marks position {p} (row {b}) as padding but batch[{_name(primary)}] puts it in a "
                f"document; make the two agree (or drop one of them from the batch)"
            )
        if src.boundaries and primary is not None:
            differ = (_run_starts(src.ids) != starts) & real_pairs
            if bool(differ.any()):
                b, p = (int(x) for x in differ.nonzero()[0])
                what = "starts a new document" if bool(starts[b, p]) else "continues the document"
                raise ValueError(
                    f"document boundaries disagree: at position {p} (row {b}) batch[{primary.name!r}] {what}, "
                    f"batch[{src.name!r}] does not; make the two sources agree (or drop one of them from the batch)"
                )
    return ids.to(device=device, dtype=torch.int64)


def _name(src: _Source | None) -> str:
    return repr(src.name) if src is not None else "'(one document)'"


def _doc_ids_from_4d_mask(mask: torch.Tensor) -> torch.Tensor:
    """Documents read off a 4-D mask's diagonal and sub-diagonal; then every real row of every head is checked to be
    exactly causal within its document (a sliding window, a bidirectional or any other mask is a ``ValueError``:
    the CP step computes per-document causal attention and nothing else)."""
    if mask.dtype.is_floating_point:  # 1 / 0 ("allow") or 0 / -inf (additive), told apart per row by the diagonal
        diag = mask[:, 0].diagonal(dim1=-2, dim2=-1)
        allow_style = (diag > 0).any(dim=-1)[:, None, None, None]
        allowed = torch.where(allow_style, mask > 0, mask == 0)
    else:
        allowed = mask != 0
    head = allowed[:, 0]
    valid = head.diagonal(dim1=-2, dim2=-1)
    linked = head.diagonal(offset=-1, dim1=-2, dim2=-1)  # linked[b, p-1] = mask[b, p, p-1]
    starts = valid.clone()
    starts[:, 1:] &= ~(linked & valid[:, :-1])
    docs = torch.where(valid, torch.cumsum(starts.to(torch.int64), dim=-1), 0)
    seq = docs.shape[-1]
    keys = torch.arange(seq)
    for lo in range(0, seq, _MASK_ROWS):  # query rows a block at a time: a few [B, H, rows, S] temporaries at most
        rows = docs[:, lo : lo + _MASK_ROWS, None]  # [B, rows, 1]
        want = (rows == docs[:, None, :]) & (keys[None, None, :] <= keys[lo : lo + _MASK_ROWS, None]) & (rows > 0)
        wrong = (allowed[:, :, lo : lo + _MASK_ROWS] != want[:, None]) & (rows[:, None] > 0)  # padding rows: any
        if bool(wrong.any()):
            b, h, i, j = (int(x) for x in wrong.nonzero()[0])
            raise ValueError(
                f"attention_mask [B, H, S, S] is not per-document causal: at row {b}, head {h}, query {lo + i} "
                f"{'attends' if bool(allowed[b, h, lo + i, j]) else 'does not attend'} key {j}, unlike causal "
                "attention within the documents on its diagonal. The CP step computes per-document causal attention "
                "only (no sliding windows, bidirectional spans or custom masks); pass the documents as "
                "_packed_seq_ids, cu_seq_lens_q or restarting position_ids instead"
            )
    return docs


_MASK_ROWS = 1024  # query rows of a 4-D mask checked at a time


def _validate_sequence_tensors(batch: dict, keys: list[str], batch_size: int, seq_len: int) -> None:
    for key in keys:
        t = batch[key]
        dim = _seq_dim(key, t)
        bdim = 1 if dim == 2 else 0
        if t.dim() < 2 or t.shape[bdim] != batch_size or t.shape[dim] != seq_len:
            expected = "[3|4, B, S]" if dim == 2 else "[B, S, ...]"
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(t.shape)}; expected {expected} with B={batch_size}, S={seq_len} "
                "to shard it along the sequence like the primary input stream"
            )


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict,
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    sharding: str | None = None,
    shard_chunk: int | None = None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, ShardLayout]:
    """Shard one packed sequence contiguously over the CP ranks and build the step context.

    ``cp_mesh``: ``None`` (one rank), a ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``), or anything
    with ``size()``, ``get_local_rank()`` and ``get_group()``. ``tp_mesh`` is unused (sharder contract). ``batch``:
    one packed row, exactly one of ``input_ids [1, S]`` / ``inputs_embeds [1, S, H]`` (the primary stream), optional
    ``labels`` (pre-shifted), ``position_ids`` (``[1, S]`` or mRoPE ``[3|4, 1, S]``), ``loss_mask``, and the document
    boundaries: ``_packed_seq_ids [1, S]``, else ``cu_seq_lens_q``/``cu_seq_lens_k``/``cu_seqlens``, else restarting
    ``position_ids``, else ``attention_mask``, else one document (see :func:`_cp_blockdiag_doc_ids`; sources that
    disagree are a ``ValueError``).

    Validates everything first (``ValueError``/``TypeError``/``RuntimeError``, batch unchanged), then mutates
    ``batch`` in place and returns it: ``attention_mask`` and the flash-attention offset keys are dropped,
    ``padding_mask = (doc_ids == 0)`` is added (and ``loss_mask`` if given). With ``W > 1`` ranks the sequence is
    padded to ``S_full``, a multiple of ``2W``, with semantic fills (``labels`` -100, ``input_ids``
    ``padding_token_id``, ``loss_mask`` 0, ``padding_mask`` True, floats 0.0, everything else 0) and every sequence
    tensor keeps the rows ``[r·L, (r+1)·L)``, ``L = S_full / W``; with one rank nothing is padded or sliced.
    ``shard_primary=False`` leaves the primary stream unsharded (same object) for models that embed the full
    sequence and shard hidden states themselves, as one contiguous range per rank (with a balanced plan of several
    pieces per rank it is a ``ValueError``). ``sharding``: ``"contiguous"`` (the split above) or
    ``"balanced"`` (every rank gets the positions :func:`~longtrain.blockdiag_cp.plan_cp_shards` plans for it, in
    ascending order, so that the ranks' causal attention work is equal; every sequence tensor is gathered with the
    same plan); default: ``configure_cp_varlen(sharding=...)``. ``shard_chunk``: the plan's smallest piece.
    ``layout.unshard(local)`` maps a local tensor back to row order in both modes.

    Returns ``(ctx_factory, batch, layout)``. The factory gives a fresh context manager per call, which publishes the
    step's :class:`~longtrain.blockdiag_cp.step.CPStep` (``with ctx_factory() as step:``) so that
    ``cp_blockdiag_sdpa`` is block-diagonal inside it, at every world size. ``layout.step`` is the same object.
    Run ``loss.backward()`` inside the context too: activation-checkpoint recompute needs the step.
    """
    group, rank, world = resolve_cp_group(cp_mesh)

    # ---- validate (nothing the caller owns changes in this block) ----
    present = [k for k in _PRIMARY_KEYS if batch.get(k) is not None]
    if len(present) != 1:
        raise ValueError(
            "block-diagonal CP requires exactly one of 'inputs_embeds' or 'input_ids' in the batch, got "
            f"{present or 'neither'}"
        )
    primary_key = present[0]
    primary = batch[primary_key]
    if not isinstance(primary, torch.Tensor) or primary.dim() < 2:
        raise TypeError(f"batch[{primary_key!r}] must be a [B, S, ...] tensor, got {type(primary).__name__}")
    bsz, seq_len = int(primary.shape[0]), int(primary.shape[1])
    if seq_len == 0:
        raise ValueError(f"batch[{primary_key!r}] has shape {tuple(primary.shape)}: an empty row (no token to attend)")
    device = primary.device
    if bsz != 1:
        raise ValueError(
            f"block-diagonal CP requires local_batch_size=1 (one packed sequence per rank), got batch size {bsz}; "
            "enable sequence packing and set the local batch size to 1"
        )
    if loss_mask is not None and (
        not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape[:2]) != (bsz, seq_len)
    ):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask must be a [B, S] = [{bsz}, {seq_len}] tensor, got {got}")
    shard_keys = [
        k
        for k in _SHARD_KEYS
        if isinstance(batch.get(k), torch.Tensor) and (shard_primary or k != primary_key) and k != "padding_mask"
    ]
    if loss_mask is not None and "loss_mask" in shard_keys:
        shard_keys.remove("loss_mask")
    _validate_sequence_tensors(batch, shard_keys, bsz, seq_len)
    doc_ids = _cp_blockdiag_doc_ids(batch, seq_len, device, bsz)

    pad_len = (-seq_len) % (2 * world) if world > 1 else 0
    full_len = seq_len + pad_len
    local_len = full_len // world
    row_offset = rank * local_len
    doc_ids_full = torch.cat([doc_ids, doc_ids.new_zeros((bsz, pad_len))], dim=1) if pad_len else doc_ids
    # Validates padding-as-tail and one run per document (ValueError), segments every rank: one host copy.
    step = build_cp_step(doc_ids_full, _Mesh(group, rank, world) if world > 1 else group, device=device,
                         sharding=sharding, shard_chunk=shard_chunk)  # fmt: skip
    if not step.contiguous and isinstance(batch.get("_deepstack_visual_embeds"), (list, tuple)):
        raise ValueError(
            "sharding='balanced' does not shard _deepstack_visual_embeds (their visual tokens are sliced by one "
            "contiguous row range); use sharding='contiguous' for this batch"
        )
    if not shard_primary:  # the model slices its own hidden states: one contiguous range per rank
        step.require_contiguous(
            f"shard_primary=False (the model embeds the whole batch[{primary_key!r}], then shards its hidden states)"
        )
    deepstack = _shard_deepstack(batch, seq_len, full_len, row_offset, local_len)

    # ---- build every new value, then mutate ----
    padding_mask = doc_ids == 0
    sources = {k: batch[k] for k in shard_keys}
    sources["padding_mask"] = padding_mask
    if loss_mask is not None:
        sources["loss_mask"] = loss_mask
    if step.contiguous:
        sharded = {
            k: _shard(t, k, seq_len, full_len, row_offset, local_len, _fill_value(k, t, padding_token_id))
            for k, t in sources.items()
        }
    else:
        sharded = {
            k: _shard_pieces(t, k, seq_len, full_len, step, _fill_value(k, t, padding_token_id))
            for k, t in sources.items()
        }
    for key in ("attention_mask", *_BOUNDARY_KEYS):
        batch.pop(key, None)
    batch.update(sharded)
    if deepstack is not None:
        batch["_deepstack_visual_embeds"] = deepstack
    maybe_disable_dynamo()

    def ctx_factory() -> contextlib.AbstractContextManager:
        return _step_context(step)

    return ctx_factory, batch, ShardLayout(seq_len, full_len, step=step)


def _shard_pieces(tensor: torch.Tensor, key: str, seq_len: int, full_len: int, step: CPStep, fill: Any):
    """This rank's positions (``step.token_index``, ascending) of ``tensor`` padded with ``fill`` to ``full_len``."""
    dim = _seq_dim(key, tensor)
    if full_len > seq_len:
        shape = list(tensor.shape)
        shape[dim] = full_len - seq_len
        tensor = torch.cat([tensor, tensor.new_full(shape, fill)], dim=dim)
    return tensor.index_select(dim, step.token_index.to(tensor.device))


class _Mesh:
    """A resolved group, rank and world size in the mesh protocol :func:`build_cp_step` takes."""

    def __init__(self, group: Any, rank: int, world: int):
        self._group, self._rank, self._world = group, rank, world

    def size(self) -> int:
        return self._world

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> Any:
        return self._group


@contextlib.contextmanager
def _step_context(step: CPStep) -> Iterator[CPStep]:
    """Publish ``step`` for ``cp_blockdiag_sdpa`` (visible from autograd's recompute thread) and yield it.

    Also turns off the early stop of non-reentrant activation checkpointing for checkpoints created inside:
    an early-stopped recompute ends at the last tensor the forward saved, which differs between a rank with
    real tokens (inside its kernel) and an all-padding rank (which may have saved nothing after the K/V
    exchange), so one rank would re-issue the exchange collective and the other not, and both would hang.
    """
    state.LAST_EXITED_SLOT.set(None)
    token = state.STEP_SLOT.set(step)
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            yield step
    finally:
        state.STEP_SLOT.reset(token)
        if step.cache.get("grad_calls") and state.STEP_SLOT.get() is None:
            state.LAST_EXITED_SLOT.set(True)


def _shard_deepstack(batch: dict, seq_len: int, full_len: int, row_offset: int, local_len: int) -> list | None:
    """The local slice of each ``_deepstack_visual_embeds`` entry (``[n_visual, H]``, visual tokens in sequence
    order), when the batch carries them with ``visual_pos_masks [B, S]``; None otherwise."""
    embeds, vmask = batch.get("_deepstack_visual_embeds"), batch.get("visual_pos_masks")
    if not isinstance(embeds, (list, tuple)) or not isinstance(vmask, torch.Tensor):
        return None
    flat = vmask.reshape(-1).to(torch.int64)
    counts = torch.stack([flat[: min(row_offset, seq_len)].sum(), flat[row_offset : row_offset + local_len].sum()])
    v_start, n_local = (int(c) for c in counts.tolist())
    return [e.narrow(0, v_start, n_local) for e in embeds]
