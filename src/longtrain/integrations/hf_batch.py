"""A packed Hugging Face row as a CP batch the model takes as is (:func:`hf_cp_batch`; re-exported by
:mod:`longtrain.integrations.hf`, which describes it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from longtrain.blockdiag_cp import make_cp_blockdiag_batch_and_ctx
from longtrain.blockdiag_cp.step import resolve_cp_group

from .hf_blockdiag import ATTN_IMPLEMENTATION

__all__ = ["hf_cp_batch", "shift_labels"]

_IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = _IGNORE_INDEX) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index``: the target of position ``t`` is the label of ``t + 1``,
    over the full row (Hugging Face's ``ForCausalLMLoss`` shift)."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def hf_cp_batch(
    batch: dict,
    cp_mesh: Any,
    *,
    padding_token_id: int = 0,
    ignore_index: int = _IGNORE_INDEX,
    sharding: str | None = None,
    shard_chunk: int | None = None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, Any]:
    """One packed Hugging Face row (``input_ids`` or ``inputs_embeds`` ``[1, S]``, optional unshifted ``labels``,
    ``position_ids``, ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_*`` from ``DataCollatorWithFlattening``,
    or an ``attention_mask`` whose zeros are a padding tail) -> ``(ctx_factory, model_kwargs, layout)``.

    The labels are shifted over the full row before sharding (``shift_labels``), missing ``position_ids`` become
    ``arange(S)`` (what the model uses on one process) before sharding, then every sequence tensor is sharded by
    :func:`~longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx` (``cp_mesh``: None, a ProcessGroup, a 1-D
    DeviceMesh or a named dim of a larger one). ``model_kwargs`` holds the local ``input_ids``/``inputs_embeds``,
    ``position_ids``, ``labels`` and ``shift_labels`` (the same shifted local labels: the model computes its loss
    and does not shift again) and ``num_items_in_batch`` (the row's label count, unless the batch brings its own,
    e.g. a count over gradient-accumulation steps), plus every other key of the
    batch (``seq_idx``, the state resets of sequence-state layers, is passed through on one rank and refused
    on several: those layers carry no state between CP ranks); run ``model(**model_kwargs)`` and ``loss.backward()``
    inside ``with ctx_factory():``. The per-rank
    losses sum (all-reduce) to the single-process loss; the caller's ``batch`` is not modified. ``sharding``:
    ``"contiguous"`` or ``"balanced"`` (see the builder; default ``configure_cp_varlen(sharding=...)``; the DSA
    models of :func:`apply_dsa` take both), ``shard_chunk`` the balanced plan's smallest piece.
    """
    batch = dict(batch)
    if batch.get("seq_idx") is not None and resolve_cp_group(cp_mesh)[2] > 1:
        raise ValueError(
            "hf_cp_batch: the batch has seq_idx (DataCollatorWithFlattening(return_seq_idx=True)), the per-document "
            "state resets of sequence-state layers such as Mamba-2; transformers' sequence-state layers pass no "
            "state between CP ranks, so such a model is not exact under CP. Train it with cp_mesh=None (seq_idx is "
            "passed through), or, for an attention-only model, leave seq_idx out of the batch"
        )
    primary = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    if batch.get(primary) is None:
        raise ValueError("hf_cp_batch needs 'input_ids' or 'inputs_embeds' in the batch")
    if batch[primary].dim() != (2 if primary == "input_ids" else 3):
        want = "[1, S]" if primary == "input_ids" else "[1, S, hidden]"
        raise ValueError(
            f"hf_cp_batch takes one packed row: {primary} {want} (what DataCollatorWithFlattening returns), got shape "
            f"{tuple(batch[primary].shape)}; add the batch dimension, e.g. {primary}[None]"
        )
    seq_len = batch[primary].shape[1]
    device = batch[primary].device
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(seq_len, device=device)[None]
    shifted = None
    if batch.get("labels") is not None:
        labels = batch["labels"]
        if labels.shape[-1] != seq_len:
            raise ValueError(f"labels cover {labels.shape[-1]} positions, {primary} {seq_len}")
        shifted = shift_labels(labels, ignore_index)
        batch["labels"] = shifted
    ctx, local, layout = make_cp_blockdiag_batch_and_ctx(
        cp_mesh, None, batch, padding_token_id=padding_token_id, sharding=sharding, shard_chunk=shard_chunk
    )
    kwargs = {k: v for k, v in local.items() if k not in ("_packed_seq_ids", "padding_mask", "loss_mask")}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(key, None)
    if shifted is not None:
        kwargs["shift_labels"] = kwargs["labels"]
        if batch.get("num_items_in_batch") is None:  # a caller's count (e.g. over accumulation steps) stays
            kwargs["num_items_in_batch"] = (shifted != ignore_index).sum()

    def checked_ctx() -> contextlib.AbstractContextManager:
        return _used_step_context(ctx, layout.step)

    return checked_ctx, kwargs, layout


@contextlib.contextmanager
def _used_step_context(ctx: Callable[[], contextlib.AbstractContextManager], step: Any) -> Iterator[Any]:
    """``ctx()``, and on a clean exit with several ranks, a RuntimeError when no attention used the step: each rank
    would then have attended only inside its own shard (a model left on 'sdpa' or 'eager'), a wrong result."""
    with ctx() as published:
        yield published
    if step.world_size > 1 and not step.cache.get("attention_calls"):
        raise RuntimeError(
            f"hf_cp_batch's step over {step.world_size} CP ranks was entered, but no attention layer used it: each "
            "rank attended only inside its own shard, so the outputs and gradients are wrong. Give the model "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} (longtrain.integrations.hf.register(), then "
            "model.set_attn_implementation(...)) or apply_dsa(model) for DSA models, and run the forward inside the "
            "context"
        )
