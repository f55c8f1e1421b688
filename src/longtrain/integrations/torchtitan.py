"""torchtitan models on the block-diagonal runtime, at every CP world size: :func:`apply_blockdiag`.

torchtitan (0.3) builds a decoder's attention as ``GQAttention`` whose ``inner_attention`` is ``VarlenAttention``
(``attn_backend="varlen"``, per-document from ``model.get_attention_masks(positions)``) or ``FlexAttention``; its
varlen path has no context parallelism. :func:`apply_blockdiag` swaps every such ``inner_attention`` for
:class:`BlockdiagAttention`, which keeps their call signature (``q/k/v [B, L, N, H]``, ``attention_masks``,
``scale``, ``enable_gqa``) and:

- inside a CP step (:func:`titan_cp_batch`'s context, or any
  :func:`~longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx` one) runs
  :func:`~longtrain.blockdiag_cp.cp_blockdiag_sdpa` on this rank's shard: documents come from the step, keys
  are exchanged over the CP group, ``attention_masks`` is not read (pass ``None``);
- outside one, runs :func:`~longtrain.blockdiag_cp.varlen_attention` on the offsets of torchtitan's own
  ``VarlenMetadata`` (``cu_seq_q``/``cu_seq_k``/``max_q``/``max_k``; a mapping of them is searched for one), or
  of :func:`varlen_masks` built from ``positions`` when the model was built with ``attn_backend="flex"``.

GQA is native (heads are never repeated) and the dtype is the model's (torchtitan's varlen casts to bf16; this
does not). The stack is imported lazily: this module imports without torchtitan.

Under ``torch.compile`` (torchtitan's ``apply_compile`` compiles every block with ``fullgraph=True``) the path
outside a CP step is one opaque op (:func:`~longtrain.blockdiag_cp.compiled.varlen_attention_op`) whose host checks
(masks that cover every row, recompute after a CP context exited) run inside it at run time; its backward recomputes
the attention forward once more. Inside a CP step the attention runs eagerly at a graph break (so not under
``fullgraph=True``, where dynamo stops with an error saying so).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from longtrain.blockdiag_cp import (
    cp_blockdiag_sdpa,
    current_cp_step,
    make_cp_blockdiag_batch_and_ctx,
    varlen_attention,
)
from longtrain.blockdiag_cp.compiled import register_host_check, varlen_attention_op
from longtrain.blockdiag_cp.meta import tensor_cache_key
from longtrain.blockdiag_cp.runtime import autocast_like_sdpa, check_recompute_outside_context
from longtrain.packing import doc_starts_from_positions

from .fsdp import set_fsdp_gradient_divide_factor

__all__ = ["REPLACED_CLASSES", "BlockdiagAttention", "VarlenOffsets", "apply_blockdiag",
           "set_fsdp_gradient_divide_factor", "titan_cp_batch", "varlen_masks"]  # fmt: skip

#: torchtitan inner-attention classes :func:`apply_blockdiag` replaces.
REPLACED_CLASSES = ("VarlenAttention", "FlexAttention")


class VarlenOffsets(NamedTuple):
    """Document offsets over the flattened ``[B * L]`` tokens, the fields of torchtitan's ``VarlenMetadata``."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


def varlen_masks(positions: torch.Tensor) -> VarlenOffsets:
    """``positions [B, L]`` restarting at 0 per document (torchtitan's packed convention) -> the offsets
    :class:`BlockdiagAttention` reads outside a CP step. A document starts wherever the position does not grow by
    exactly 1 (:func:`longtrain.packing.doc_starts_from_positions`), and at every row's first token."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        raise ValueError(f"positions must be a [B, L] tensor, got {getattr(positions, 'shape', type(positions))}")
    if positions.dtype == torch.bool or positions.dtype.is_complex:
        raise TypeError(f"positions must hold integer (or float) positions, got {positions.dtype}")
    batch, length = positions.shape
    starts = doc_starts_from_positions(positions)
    flat = starts.flatten().nonzero().flatten()
    cu = torch.cat([flat, flat.new_tensor([batch * length])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return VarlenOffsets(cu, cu, longest, longest)


def _offsets(attention_masks: Any) -> Any:
    if isinstance(attention_masks, Mapping):
        found = [m for m in attention_masks.values() if _offsets(m) is not None]
        return found[0] if found else None
    if all(hasattr(attention_masks, f) for f in VarlenOffsets._fields):
        return attention_masks
    return None


_COVERED: OrderedDict[tuple, tuple] = OrderedDict()


def _check_covered(offsets: Any, batch: int, length: int) -> None:
    """The masks' offsets end at ``B * L``, else rows would silently get zero output. Checked once per offsets
    tensor (one host copy), then cached while the same unmodified tensors come back, as every layer of a step does."""
    cu_q, cu_k = offsets.cu_seq_q, offsets.cu_seq_k
    total = batch * length
    tensors = tensor_cache_key(cu_q, cu_k)
    key = (tensors, total)
    hit = _COVERED.get(key) if tensors is not None else None
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k:
        return
    covered = torch.stack([cu_q[-1], cu_k[-1]]).tolist()
    if covered != [total, total]:
        raise ValueError(
            f"attention_masks cover {covered[0]} query and {covered[1]} key tokens but q holds B * L = {batch} * "
            f"{length} = {total}: the rows left over would silently get zero output. Build the masks from this "
            "batch's positions (model.get_attention_masks(positions) or varlen_masks(positions))"
        )
    if tensors is None:
        return
    _COVERED[key] = (weakref.ref(cu_q), weakref.ref(cu_k))
    while len(_COVERED) > 8:
        _COVERED.popitem(last=False)


def _compiled_host_check(cu_q: torch.Tensor, cu_k: torch.Tensor, args: list[int]) -> None:
    """What :class:`BlockdiagAttention` checks on the host before the attention, run inside the compiled op."""
    check_recompute_outside_context("BlockdiagAttention")
    _check_covered(VarlenOffsets(cu_q, cu_k, 0, 0), *args)


_HOST_CHECK = "torchtitan.BlockdiagAttention"
register_host_check(_HOST_CHECK, _compiled_host_check)


class BlockdiagAttention(torch.nn.Module):
    """Per-document causal attention with torchtitan's inner-attention signature (see the module docstring)."""

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Callable | None = None,
        is_causal: bool = True,
        score_mod: Callable | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``q_BLNH [B, L, Hq, D]``, ``k_BLNH/v_BLNH [B, L, Hkv, D]`` -> ``[B, L, Hq, D]`` in q's dtype."""
        if score_mod is not None:  # FlexAttention's keyword: dropping it would silently change the scores
            raise ValueError(
                "BlockdiagAttention computes plain per-document causal attention and cannot apply a FlexAttention "
                "score_mod; keep torchtitan's FlexAttention on the layers that need one "
                "(apply_blockdiag(model, skip=...))"
            )
        if out_transform is not None:
            raise ValueError(
                "BlockdiagAttention returns no log-sum-exp for an out_transform epilogue; keep torchtitan's "
                "VarlenAttention on the layers that need one (apply_blockdiag(model, skip=...))"
            )
        if not is_causal:
            raise ValueError("BlockdiagAttention is per-document causal attention; got is_causal=False")
        step = current_cp_step()
        if step is not None:
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            return cp_blockdiag_sdpa(q, k, v, is_causal=True, scale=scale).transpose(1, 2)
        compiling = torch.compiler.is_compiling()
        if not compiling:
            check_recompute_outside_context("BlockdiagAttention")
        offsets = _offsets(attention_masks)
        if offsets is None:
            raise ValueError(
                "outside a CP step BlockdiagAttention needs the documents: pass attention_masks="
                "model.get_attention_masks(positions) of a model built with attn_backend='varlen', or "
                "longtrain.integrations.torchtitan.varlen_masks(positions); or run the model inside "
                f"titan_cp_batch's context (got attention_masks of type {type(attention_masks).__name__})"
            )
        batch, length = q_BLNH.shape[:2]
        total = batch * length
        if tuple(k_BLNH.shape[:2]) != (batch, length) or tuple(v_BLNH.shape[:2]) != (batch, length):
            raise ValueError(
                f"BlockdiagAttention is self-attention over packed rows: q, k and v must share [B, L] = "
                f"{(batch, length)}, got k {tuple(k_BLNH.shape[:2])} and v {tuple(v_BLNH.shape[:2])}"
            )
        q, k, v = (t.reshape(total, t.shape[2], t.shape[3]) for t in autocast_like_sdpa(q_BLNH, k_BLNH, v_BLNH))
        if compiling:  # one opaque op; the host checks run inside it at run time
            out = varlen_attention_op(q, k, v, offsets.cu_seq_q, offsets.cu_seq_k, offsets.max_q, offsets.max_k,
                                      causal=True, softmax_scale=scale, host_check=_HOST_CHECK,
                                      host_check_args=(batch, length))  # fmt: skip
        else:
            _check_covered(offsets, batch, length)
            out = varlen_attention(q, k, v, offsets.cu_seq_q, offsets.cu_seq_k, int(offsets.max_q),
                                   int(offsets.max_k), causal=True, softmax_scale=scale)  # fmt: skip
        return out.view(batch, length, out.shape[1], out.shape[2])


#: The ``get_attention_masks`` whose flex masks are per-document causal and nothing else (torchtitan's decoder base).
_DOCUMENT_CAUSAL_MASKS = "Decoder.get_attention_masks"


def apply_blockdiag(model: torch.nn.Module, *, skip: Callable[[str], bool] | None = None) -> int:
    """Replace every torchtitan ``VarlenAttention``/``FlexAttention`` inner attention of ``model`` (in place) by
    :class:`BlockdiagAttention`; returns how many. ``skip(name)`` keeps the named modules as they are.

    Refused (``ValueError``, nothing replaced) where the replacement would compute something else: a
    ``VarlenAttention`` with a sliding window (``window_size != (-1, 0)``, e.g. gpt-oss's sliding layers), and a
    ``FlexAttention`` in a model whose ``get_attention_masks`` is not torchtitan's per-document causal one (its own
    mask mods, e.g. sliding windows). Keep those layers with ``skip``."""
    targets = []
    masks = getattr(type(model), "get_attention_masks", None)
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind not in REPLACED_CLASSES or (skip and skip(name)):
            continue
        window = tuple(getattr(module, "window_size", (-1, 0)) or (-1, 0))
        if kind == "VarlenAttention" and window != (-1, 0):
            raise ValueError(
                f"{name} is a sliding-window VarlenAttention (window_size={window}); BlockdiagAttention attends to "
                "whole documents: keep it with apply_blockdiag(model, skip=lambda name: ...)"
            )
        if kind == "FlexAttention" and getattr(masks, "__qualname__", None) != _DOCUMENT_CAUSAL_MASKS:
            raise ValueError(
                f"{name} is a FlexAttention of {type(model).__name__}, whose get_attention_masks builds its own masks "
                "(BlockdiagAttention computes per-document causal attention only): build the model with "
                "attn_backend='varlen', or keep these layers with apply_blockdiag(model, skip=...)"
            )
        targets.append(name)
    if not targets:
        raise ValueError(
            f"apply_blockdiag found no torchtitan inner attention ({', '.join(REPLACED_CLASSES)}) in "
            f"{type(model).__name__}: build the model with attn_backend='varlen' or 'flex'"
        )
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BlockdiagAttention())
    return len(targets)


def titan_cp_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    positions: torch.Tensor,
    cp_mesh: Any,
    *,
    padding_token_id: int = 0,
    sharding: str | None = None,
    shard_chunk: int | None = None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, torch.Tensor | None, Any]:
    """One packed torchtitan row -> ``(ctx_factory, model_kwargs, local_labels, layout)``.

    ``tokens [1, S]``, ``labels [1, S]`` already shifted (torchtitan's datasets yield ``input``/``label`` pairs),
    ``positions [1, S]`` restarting at 0 per document (they set the documents). ``cp_mesh``: ``None``, a
    ``ProcessGroup``, a 1-D ``DeviceMesh`` or a named dim of a larger one. The row is sharded by
    :func:`~longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx` (``sharding``: ``"contiguous"`` or
    ``"balanced"``, ``shard_chunk``: the balanced plan's smallest piece); ``model_kwargs`` is ``{"tokens",
    "positions", "attention_masks": None}`` of this rank: run ``model(**model_kwargs)``, the loss (a token sum
    over ``local_labels``) and ``backward()`` inside ``with ctx_factory():``. The caller's tensors are not
    modified.
    """
    batch: dict[str, Any] = {"input_ids": tokens, "position_ids": positions}
    if labels is not None:
        batch["labels"] = labels
    ctx, sharded, layout = make_cp_blockdiag_batch_and_ctx(
        cp_mesh, None, batch, padding_token_id=padding_token_id, sharding=sharding, shard_chunk=shard_chunk
    )
    kwargs = {"tokens": sharded["input_ids"], "positions": sharded["position_ids"], "attention_masks": None}
    return ctx, kwargs, sharded.get("labels"), layout
