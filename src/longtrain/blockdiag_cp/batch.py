"""``make_cp_blockdiag_batch_and_ctx``: shard one packed batch contiguously over the CP ranks and build the
step context in which ``cp_blockdiag_sdpa`` runs block-diagonal attention.

Everything is validated before the caller's batch is touched: a bad batch raises and leaves it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.utils.checkpoint

from . import kernels, runtime, state

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
    padding to a multiple of ``2 * cp_size`` (equal to the original when CP is off)."""

    original_seq_len: int
    padded_seq_len: int


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


def _cp_blockdiag_doc_ids(batch: dict, seq_len: int, device: torch.device, batch_size: int) -> torch.Tensor:
    """Per-position document ids ``[B, S] int64`` on ``device`` (0 == padding); reads, never mutates, ``batch``.

    Sources, first present wins: ``batch["_packed_seq_ids"]``; a 4-D ``attention_mask [B, 1|H, S, S]``
    (documents recovered from its diagonal and sub-diagonal: position p starts a new document when it may
    not attend to p-1; bool/int masks are allow-style, float masks allow-style when their diagonal holds a
    positive value and additive (0 = allowed) otherwise); a 2-D ``attention_mask`` taken as ids (a 0/1 mask is
    one document plus padding); otherwise one document without padding.
    """
    ids = batch.get("_packed_seq_ids")
    mask = batch.get("attention_mask")
    if isinstance(ids, torch.Tensor):
        out = ids
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        out = _doc_ids_from_4d_mask(mask)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out = mask
    else:
        out = torch.ones(batch_size, seq_len, dtype=torch.int64, device=device)
    if out.dtype.is_floating_point or out.dtype.is_complex:
        if isinstance(ids, torch.Tensor):
            raise TypeError(f"batch['_packed_seq_ids'] must be an integer tensor, got {out.dtype}")
        out = out != 0
    if out.dim() == 1:
        out = out.unsqueeze(0)
    if tuple(out.shape) != (batch_size, seq_len):
        source = "_packed_seq_ids" if isinstance(ids, torch.Tensor) else "attention_mask"
        raise ValueError(
            f"document ids from batch[{source!r}] have shape {tuple(out.shape)}, expected [B, S] = "
            f"[{batch_size}, {seq_len}] like the primary input stream"
        )
    return out.to(device=device, dtype=torch.int64)


def _doc_ids_from_4d_mask(mask: torch.Tensor) -> torch.Tensor:
    head = mask[:, 0]
    diag = head.diagonal(dim1=-2, dim2=-1)
    sub = head.diagonal(offset=-1, dim1=-2, dim2=-1)  # sub[b, p-1] = mask[b, p, p-1]
    if mask.dtype.is_floating_point:
        allow_style = (diag > 0).any(dim=-1, keepdim=True)
        valid = torch.where(allow_style, diag > 0, diag == 0)
        linked = torch.where(allow_style, sub > 0, sub == 0)
    else:
        valid, linked = diag != 0, sub != 0
    starts = valid.clone()
    starts[:, 1:] &= ~(linked & valid[:, :-1])
    return torch.where(valid, torch.cumsum(starts.to(torch.int64), dim=-1), 0)


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


def _packed_runs(ids_full_host: torch.Tensor) -> torch.Tensor:
    """Run boundaries ``[n_runs+1] int64`` of the flattened padded ids (the padding tail is its own run)."""
    flat = ids_full_host.reshape(-1)
    change = (flat[1:] != flat[:-1]).nonzero().flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change, torch.tensor([flat.numel()], dtype=torch.int64)])


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict,
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, ShardLayout | None]:
    """Shard one packed sequence contiguously over the CP ranks and build the step context.

    ``cp_mesh``: anything with ``size()``, ``get_local_rank()`` and ``get_group()`` (a 1-D ``DeviceMesh``).
    ``tp_mesh`` is unused (sharder contract). ``batch``: one packed row, exactly one of ``input_ids [1, S]``
    / ``inputs_embeds [1, S, H]`` (the primary stream), optional ``labels`` (pre-shifted), ``position_ids``
    (``[1, S]`` or mRoPE ``[3|4, 1, S]``), ``_packed_seq_ids [1, S]`` (else ids come from ``attention_mask``,
    else one document), ``loss_mask``.

    With ``W = cp_mesh.size() <= 1`` returns ``(contextlib.nullcontext, batch, layout)`` with the batch
    untouched. Otherwise validates everything (``ValueError``/``TypeError``/``RuntimeError``, batch
    unchanged), then mutates ``batch`` in place and returns it: ``attention_mask`` is dropped, ``padding_mask
    = (doc_ids == 0)`` is added (and ``loss_mask`` if given); the sequence is padded to ``S_full``, a multiple
    of ``2W``, with semantic fills (``labels`` -100, ``input_ids`` ``padding_token_id``, ``loss_mask`` 0,
    ``padding_mask`` True, floats 0.0, everything else 0) and every sequence tensor keeps the rows
    ``[r·L, (r+1)·L)``, ``L = S_full / W``. ``shard_primary=False`` leaves the primary stream unsharded (same
    object) for models that embed the full sequence and shard hidden states themselves.

    The returned factory gives a fresh context manager per call; attention inside it is block-diagonal CP.
    Run ``loss.backward()`` inside the context too: activation-checkpoint recompute needs the step state.
    """
    world = int(cp_mesh.size())
    if world <= 1:
        primary = next((batch[k] for k in _PRIMARY_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
        layout = None if primary is None else ShardLayout(int(primary.shape[1]), int(primary.shape[1]))
        return contextlib.nullcontext, batch, layout

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
    device = primary.device
    if bsz != 1:
        raise ValueError(
            f"block-diagonal CP requires local_batch_size=1 (one packed sequence per rank), got batch size {bsz}; "
            "enable sequence packing and set the local batch size to 1"
        )
    rank = int(cp_mesh.get_local_rank())
    group = cp_mesh.get_group()
    group_world = torch.distributed.get_world_size(group)
    if group_world != world:
        raise RuntimeError(
            f"the K/V all-gather group has world size {group_world} but cp_mesh.size() is {world}: the CP sub-group "
            "was mis-resolved (a DeviceMesh flatten/slice bug seen on torch 2.8 with dp>1); upgrade torch or pass "
            "the 1-D CP mesh"
        )
    if not 0 <= rank < world:
        raise RuntimeError(f"cp_mesh.get_local_rank() returned {rank}, outside [0, {world})")
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

    pad_len = (-seq_len) % (2 * world)
    full_len = seq_len + pad_len
    local_len = full_len // world
    row_offset = rank * local_len
    doc_ids_full = torch.cat([doc_ids, doc_ids.new_zeros((bsz, pad_len))], dim=1) if pad_len else doc_ids
    # The one device-to-host copy of the step: the layout check, the run boundaries and the segmentation all
    # work on it (precompute validates padding-as-tail and one run per document, raising ValueError).
    ids_host = doc_ids_full.detach().to("cpu")
    varlen_meta = kernels.precompute_blockdiag_varlen_meta(
        ids_host, row_offset=row_offset, local_len=local_len, device=device
    )
    packed_cu_seqlens_cpu = _packed_runs(ids_host)
    packed_cu_seqlens = packed_cu_seqlens_cpu.to(device)
    deepstack = _shard_deepstack(batch, seq_len, full_len, row_offset, local_len)

    # ---- build every new value, then mutate ----
    padding_mask = doc_ids == 0
    sources = {k: batch[k] for k in shard_keys}
    sources["padding_mask"] = padding_mask
    if loss_mask is not None:
        sources["loss_mask"] = loss_mask
    sharded = {
        k: _shard(t, k, seq_len, full_len, row_offset, local_len, _fill_value(k, t, padding_token_id))
        for k, t in sources.items()
    }
    batch.pop("attention_mask", None)
    batch.update(sharded)
    if deepstack is not None:
        batch["_deepstack_visual_embeds"] = deepstack

    cfg = state.cp_varlen_runtime_config()
    model_state = state.BlockdiagCpModelState(group, packed_cu_seqlens, packed_cu_seqlens_cpu)
    step = {
        "group": group,
        "doc_ids": doc_ids_full,
        "packed_cu_seqlens": packed_cu_seqlens,
        "packed_cu_seqlens_cpu": packed_cu_seqlens_cpu,
        "row_offset": row_offset,
        "seq_dim": 2,
        "attn_backend": cfg["attn_backend"],
        "kv_exchange": cfg["kv_exchange"],
        "varlen_meta": varlen_meta,
        "model_state": model_state,
    }
    runtime._maybe_disable_dynamo()

    def ctx_factory() -> contextlib.AbstractContextManager:
        return _step_context(step)

    return ctx_factory, batch, ShardLayout(seq_len, full_len)


@contextlib.contextmanager
def _step_context(step: dict) -> Iterator[None]:
    """Activate ``step`` for ``cp_blockdiag_sdpa`` (visible from autograd's recompute thread).

    Also turns off the early stop of non-reentrant activation checkpointing for checkpoints created inside:
    an early-stopped recompute ends at the last tensor the forward saved, which differs between a rank with
    real tokens (inside its kernel) and an all-padding rank (which may have saved nothing after the K/V
    exchange), so one rank would re-issue the exchange collective and the other not, and both would hang.
    """
    state._CP_LAST_EXITED_STATE.set(None)
    token = state._CP_BLOCKDIAG_STATE.set(step)
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            yield
    finally:
        state._CP_BLOCKDIAG_STATE.reset(token)
        if step.get("_grad_calls") and state._CP_BLOCKDIAG_STATE.get() is None:
            state._CP_LAST_EXITED_STATE.set(True)


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
