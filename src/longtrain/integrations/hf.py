"""Hugging Face transformers: block-diagonal attention for packed batches, a CP batch the model accepts as is,
and FSDP2 gradients that stay right when the FSDP mesh includes the CP ranks.

- :func:`register` adds the attention implementation ``"longtrain_blockdiag"`` (and its mask function, so the
  model builds no dense ``[B, 1, S, S]`` mask): ``AutoModelForCausalLM.from_config(cfg,
  attn_implementation="longtrain_blockdiag")`` or ``model.set_attn_implementation("longtrain_blockdiag")``.
  Inside a CP step context (:func:`hf_cp_batch`, ``make_cp_blockdiag_batch_and_ctx``) it runs
  :func:`~longtrain.blockdiag_cp.cp_varlen_attention` on this rank's shard; outside one it is block-diagonal over
  the documents of the batch (:func:`packed_doc_ids`): ``cu_seq_lens_q`` when the collator returns them, else
  ``position_ids`` that jump (``DataCollatorWithFlattening``: each document restarts at 0; Hugging Face's rule:
  a new document wherever the position does not grow by 1), else one causal document per row; the zeros of a 2-D
  ``attention_mask`` are padding wherever they are (their outputs are 0). Equal to running every document alone.
  GQA native, no ``repeat_kv``. One host sync per forward (the boundaries, cached for the layers), none per layer.
- :func:`hf_cp_batch` shifts the labels over the full row *before* sharding (exactly what the model's loss does on
  one process), shards every sequence tensor and returns the keyword arguments ``model(**kwargs)`` takes:
  ``shift_labels`` (so the model does not shift again) and ``num_items_in_batch`` (the row's label count, so the
  per-rank losses sum to the single-process mean).
- :func:`set_fsdp_gradient_divide_factor` sets FSDP2's gradient divide factor on every FSDP module: with the CP
  ranks inside the FSDP mesh, FSDP's default averaging divides the CP-summed gradient by the CP size too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from longtrain.blockdiag_cp import current_cp_step, make_cp_blockdiag_batch_and_ctx, varlen_attention
from longtrain.blockdiag_cp.runtime import cp_blockdiag_sdpa

__all__ = [
    "ATTN_IMPLEMENTATION",
    "apply_dsa",
    "MIN_TRANSFORMERS",
    "blockdiag_attention_forward",
    "hf_cp_batch",
    "packed_doc_ids",
    "register",
    "set_fsdp_gradient_divide_factor",
    "shift_labels",
]

#: The name :func:`register` gives the attention implementation.
ATTN_IMPLEMENTATION = "longtrain_blockdiag"
#: The lowest transformers version this integration is tested with.
MIN_TRANSFORMERS = "5.24"
_IGNORE_INDEX = -100


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "longtrain.integrations.hf needs transformers: pip install 'longtrain[hf]' (transformers>="
            f"{MIN_TRANSFORMERS})"
        ) from exc
    found = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if found < tuple(int(x) for x in MIN_TRANSFORMERS.split(".")):
        raise ImportError(
            f"longtrain.integrations.hf needs transformers>={MIN_TRANSFORMERS}, found {transformers.__version__}"
        )
    return transformers


def apply_dsa(model: torch.nn.Module, *, backend: str = "auto") -> int:
    """Train transformers' DSA models (``glm_moe_dsa``, ``deepseek_v32``) on our fused indexer top-k and sparse MLA
    kernels; see :mod:`longtrain.integrations.hf_dsa`. Returns the number of attention modules replaced."""
    from .hf_dsa import apply_dsa as _apply

    return _apply(model, backend=backend)


def register() -> str:
    """Register ``"longtrain_blockdiag"`` with transformers' attention and attention-mask interfaces (idempotent);
    returns the name. The mask function is transformers' own flash-attention one: no mask when there is no
    padding, else the 2-D padding mask (never a dense ``[B, 1, S, S]`` mask)."""
    transformers = _transformers()
    from transformers.masking_utils import flash_attention_mask

    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_attention_forward)
    transformers.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)
    return ATTN_IMPLEMENTATION


# ----------------------------------------------------------------------------------------------------------
# document boundaries of a batch, as Hugging Face sees them
# ----------------------------------------------------------------------------------------------------------


def packed_doc_ids(
    batch_size: int,
    seq_len: int,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Document ids ``[B, S] int64`` (0 == padding, documents numbered from 1 across the batch).

    Documents: ``cu_seq_lens`` (flash-attention offsets over the flattened batch) when given; else
    ``position_ids`` (``[B, S]``, or mRoPE ``[3|4, B, S]``: the first plane), a new document wherever the position
    does not grow by exactly 1 (Hugging Face's packed-sequence rule; ``DataCollatorWithFlattening`` restarts each
    document at 0); else one document per row. Padding: the zeros of a 2-D ``attention_mask``, in any place.
    """
    dev = torch.device(device) if device is not None else None
    if cu_seq_lens is not None:
        cu = cu_seq_lens.to(device="cpu", dtype=torch.int64).flatten()
        total = batch_size * seq_len
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"cu_seq_lens must rise from 0 to the batch's {total} tokens (B={batch_size} x S={seq_len}), got "
                f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
            )
        lengths = cu[1:] - cu[:-1]
        ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths).view(batch_size, seq_len)
        ids = ids.to(dev or cu_seq_lens.device)
    elif position_ids is not None:
        pos = position_ids[0] if position_ids.dim() == 3 else position_ids
        if pos.dim() == 1:
            pos = pos[None]
        if pos.shape[-1] != seq_len:
            raise ValueError(f"position_ids cover {pos.shape[-1]} positions, the batch has {seq_len}")
        pos = pos.expand(batch_size, seq_len)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
        ids = torch.cumsum(starts.flatten(), 0).view(batch_size, seq_len).to(dev or pos.device)
    else:
        ids = torch.arange(1, batch_size + 1, device=dev)[:, None].expand(batch_size, seq_len).contiguous()
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, seq_len):
            raise ValueError(
                f"attention_mask must be the 2-D padding mask [B={batch_size}, S={seq_len}] here, got "
                f"{tuple(attention_mask.shape)} (a 4-D mask is not block-diagonal input: pass position_ids instead)"
            )
        ids = torch.where(attention_mask.to(device=ids.device, dtype=torch.bool), ids, 0)
    return ids


class _Plan:
    """The varlen call for one batch's boundaries: real-token gather index (None when there is no padding) and
    the offsets over the real tokens."""

    def __init__(self, doc_ids: torch.Tensor, device: torch.device):
        flat = doc_ids.flatten().cpu()
        real = flat > 0
        self.index = None if bool(real.all()) else real.nonzero().flatten().to(device)
        ids = flat[real]
        self.total = int(flat.numel())
        if ids.numel() == 0:
            self.cu, self.max_len = None, 0
            return
        change = torch.ones(ids.numel(), dtype=torch.bool)
        change[1:] = ids[1:] != ids[:-1]
        starts = change.nonzero().flatten()
        cu = torch.cat([starts, torch.tensor([ids.numel()])])
        self.max_len = int((cu[1:] - cu[:-1]).max())
        self.cu = cu.to(device=device, dtype=torch.int32)


_PLANS: OrderedDict[tuple, tuple[Any, _Plan]] = OrderedDict()
_PLAN_CACHE_SIZE = 8


def _plan_for(batch_size: int, seq_len: int, device: torch.device, kwargs: dict, attention_mask) -> _Plan:
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    sources = [t for t in (cu, attention_mask, pos) if isinstance(t, torch.Tensor)]
    key = (batch_size, seq_len, str(device), *((id(t), t._version) for t in sources))
    hit = _PLANS.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], sources)):
        _PLANS.move_to_end(key)
        return hit[1]
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if cu is not None and batch_size != 1:
        raise ValueError(f"cu_seq_lens_q describes one packed row; the batch has {batch_size} rows")
    doc_ids = packed_doc_ids(batch_size, seq_len, position_ids=pos, attention_mask=mask, cu_seq_lens=cu)
    plan = _Plan(doc_ids, device)
    _PLANS[key] = ([weakref.ref(t) for t in sources], plan)
    while len(_PLANS) > _PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


# ----------------------------------------------------------------------------------------------------------
# the attention implementation
# ----------------------------------------------------------------------------------------------------------


def blockdiag_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``query [B, Hq, S, D]``, ``key/value [B, Hkv, S, D]`` ->
    ``(attn_output [B, S, Hq, D], None)``. See the module docstring for how documents are found."""
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is per-document causal self-attention; "
            f"{type(module).__name__} is not causal: give that module attn_implementation='sdpa'"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is for training on packed rows (query and key of equal "
            f"length); got {query.shape[2]} queries and {key.shape[2]} keys (a KV cache?): generate with "
            "model.set_attn_implementation('sdpa')"
        )
    step = current_cp_step()
    if step is not None:
        if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
            raise ValueError(
                "inside a CP step the document ids decide padding; the model received an attention_mask with zeros "
                "(build the batch with hf_cp_batch / make_cp_blockdiag_batch_and_ctx, which drop it)"
            )
        out = cp_blockdiag_sdpa(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2), None
    b, hq, s, d = query.shape
    plan = _plan_for(b, s, query.device, kwargs, attention_mask)
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]) for t in (query, key, value))
    if plan.index is not None:
        q, k, v = (t.index_select(0, plan.index) for t in (q, k, v))
    if plan.cu is None:  # nothing but padding
        out = q.new_zeros(b * s, hq, value.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
        return out.view(b, s, hq, -1), None
    out = varlen_attention(
        q, k, v, plan.cu, plan.cu, plan.max_len, plan.max_len, causal=True, softmax_scale=scaling, dropout_p=dropout
    )
    if plan.index is not None:
        out = out.new_zeros(b * s, hq, out.shape[-1]).index_copy(0, plan.index, out)
    return out.view(b, s, hq, -1), None


# ----------------------------------------------------------------------------------------------------------
# a CP batch the model takes as is
# ----------------------------------------------------------------------------------------------------------


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
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, Any]:
    """One packed Hugging Face row (``input_ids`` or ``inputs_embeds`` ``[1, S]``, optional unshifted ``labels``,
    ``position_ids``, ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_*`` from ``DataCollatorWithFlattening``,
    or an ``attention_mask`` whose zeros are a padding tail) -> ``(ctx_factory, model_kwargs, layout)``.

    The labels are shifted over the full row before sharding (``shift_labels``), missing ``position_ids`` become
    ``arange(S)`` (what the model uses on one process) before sharding, then every sequence tensor is sharded by
    :func:`~longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx` (``cp_mesh``: None, a ProcessGroup, a 1-D
    DeviceMesh or a named dim of a larger one). ``model_kwargs`` holds the local ``input_ids``/``inputs_embeds``,
    ``position_ids``, ``labels`` and ``shift_labels`` (the same shifted local labels: the model computes its loss
    and does not shift again) and ``num_items_in_batch`` (the row's label count), plus every other key of the
    batch; run ``model(**model_kwargs)`` and ``loss.backward()`` inside ``with ctx_factory():``. The per-rank
    losses sum (all-reduce) to the single-process loss; the caller's ``batch`` is not modified. ``sharding``:
    ``"contiguous"`` or ``"balanced"`` (see the builder; default ``configure_cp_varlen(sharding=...)``); the DSA
    models of :func:`apply_dsa` need ``"contiguous"``.
    """
    batch = dict(batch)
    primary = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    if batch.get(primary) is None:
        raise ValueError("hf_cp_batch needs 'input_ids' or 'inputs_embeds' in the batch")
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
    if batch.get("_packed_seq_ids") is None and batch.get("cu_seq_lens_q") is None:
        mask = batch.get("attention_mask")
        pos = batch["position_ids"]
        if mask is None or bool(mask.all()):  # Hugging Face's packed rule: a jump in the positions starts a document
            batch["_packed_seq_ids"] = packed_doc_ids(1, seq_len, position_ids=pos, device=device)
    ctx, local, layout = make_cp_blockdiag_batch_and_ctx(
        cp_mesh, None, batch, padding_token_id=padding_token_id, sharding=sharding
    )
    kwargs = {k: v for k, v in local.items() if k not in ("_packed_seq_ids", "padding_mask", "loss_mask")}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        kwargs.pop(key, None)
    if shifted is not None:
        kwargs["shift_labels"] = kwargs["labels"]
        kwargs["num_items_in_batch"] = (shifted != ignore_index).sum()
    return ctx, kwargs, layout


# ----------------------------------------------------------------------------------------------------------
# FSDP2
# ----------------------------------------------------------------------------------------------------------


def set_fsdp_gradient_divide_factor(model: torch.nn.Module, factor: float = 1.0) -> int:
    """Set FSDP2's gradient divide factor on every FSDP module of ``model``; returns how many it set.

    With a ``dp_shard x cp`` mesh flattened into FSDP's mesh, FSDP averages gradients over every rank of it, so a
    loss normalised by the global token count (what :func:`hf_cp_batch`'s ``num_items_in_batch`` gives, summed
    over the CP ranks) comes out divided by the CP size as well. ``factor=1.0`` makes the reduction a plain sum:
    right when every rank's loss is already divided by the token count of the whole global batch (all DP and CP
    ranks). Raises a ``ValueError`` when ``model`` holds no FSDP module (call it after ``fully_shard``).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # torch < 2.6
        raise ImportError(
            "set_fsdp_gradient_divide_factor needs torch.distributed.fsdp.FSDPModule (torch>=2.6)"
        ) from exc
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            count += 1
    if not count:
        raise ValueError("the model holds no FSDP2 module: call set_fsdp_gradient_divide_factor after fully_shard")
    return count
