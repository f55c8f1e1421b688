"""The ``"longtrain_blockdiag"`` attention implementation for transformers (see :mod:`longtrain.integrations.hf`,
which re-exports everything here): its registration, the document boundaries of a batch as Hugging Face sees them,
and the attention function."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

from longtrain.blockdiag_cp import current_cp_step, varlen_attention
from longtrain.blockdiag_cp.meta import tensor_cache_key
from longtrain.blockdiag_cp.runtime import autocast_like_sdpa, check_recompute_outside_context, cp_blockdiag_sdpa
from longtrain.packing import doc_starts_from_positions

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS",
    "UNSUPPORTED_KWARGS",
    "blockdiag_attention_forward",
    "blockdiag_attention_mask",
    "check_packed_offsets",
    "packed_doc_ids",
    "register",
]

#: The name :func:`register` gives the attention implementation.
ATTN_IMPLEMENTATION = "longtrain_blockdiag"
#: The lowest transformers version this integration is tested with.
MIN_TRANSFORMERS = "5.24"


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


def register() -> str:
    """Register ``"longtrain_blockdiag"`` with transformers' attention and attention-mask interfaces (idempotent);
    returns the name. The mask function (:func:`blockdiag_attention_mask`) is transformers' flash-attention one: no
    mask when there is no padding, else the 2-D padding mask (never a dense ``[B, 1, S, S]`` mask)."""
    transformers = _transformers()
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_attention_forward)
    transformers.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_attention_mask)
    return ATTN_IMPLEMENTATION


def blockdiag_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                             mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                             **kwargs: Any) -> torch.Tensor | None:  # fmt: skip
    """transformers' mask-interface signature: its flash-attention mask (``None`` without padding, else the 2-D
    padding mask). Chunked attention (Llama 4's ``attention_chunk_size`` layers) over more keys than one chunk is a
    ``ValueError``, as transformers does for flash attention: its chunks are not the packed documents."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    config, local = kwargs.get("config"), kwargs.get("local_size")
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    if local is not None and chunk is not None and local == chunk and kv_length + kv_offset > chunk:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} cannot compute chunked attention (attention_chunk_size="
            f"{chunk}, {kv_length + kv_offset} keys): give this model attn_implementation='sdpa' or 'eager'"
        )
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function or causal_mask_function, attention_mask, **kwargs)  # fmt: skip


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
    ``position_ids`` (``[B, S]`` or mRoPE ``[3|4, B, S]``; :func:`longtrain.packing.doc_starts_from_positions`: a
    new document wherever the text position does not grow by exactly 1, Hugging Face's packed-sequence rule); else
    one document per row. Padding: the zeros of a 2-D ``attention_mask``, in any place. With both offsets and
    position ids that restart, the two must start the same documents between real tokens (as the CP batch builder
    requires), else a ``ValueError``; position ids that never restart (the model's own ``arange``) mark no boundary.
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
        if position_ids is not None:
            _check_positions_agree(ids, position_ids, attention_mask)
        ids = ids.to(dev or cu_seq_lens.device)
    elif position_ids is not None:
        if position_ids.shape[-1] != seq_len:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, the batch has {seq_len}")
        starts = doc_starts_from_positions(position_ids).expand(batch_size, seq_len)
        ids = torch.cumsum(starts.flatten(), 0).view(batch_size, seq_len).to(dev or position_ids.device)
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


def _check_positions_agree(ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Restarting ``position_ids`` start the same documents as the offsets' ``ids`` ``[B, S]`` (CPU) between real
    tokens; else a ``ValueError`` naming the first position where they differ."""
    if position_ids.shape[-1] != ids.shape[1]:
        raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, the batch has {ids.shape[1]}")
    by_pos = doc_starts_from_positions(position_ids).cpu().expand(ids.shape)
    if not bool(by_pos[:, 1:].any()):
        return
    by_cu = torch.ones_like(by_pos)
    by_cu[:, 1:] = ids[:, 1:] != ids[:, :-1]
    real = torch.ones_like(by_pos)
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(ids.shape):  # else packed_doc_ids refuses it
        real = attention_mask.cpu() != 0
    differ = (by_pos[:, 1:] != by_cu[:, 1:]) & real[:, 1:] & real[:, :-1]
    if bool(differ.any()):
        b, p = (int(x) for x in differ.nonzero()[0])
        what = "starts a new document" if bool(by_cu[b, p + 1]) else "continues the document"
        raise ValueError(
            f"document boundaries disagree: at position {p + 1} (row {b}) cu_seq_lens_q {what}, position_ids do "
            f"not; make the two agree (or pass only one of them)"
        )


def check_packed_offsets(batch_size: int, cu_seq_lens_q: Any, cu_seq_lens_k: Any) -> None:
    """The flash-attention offsets a batch brings (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
    describe one packed row, and for training ``cu_seq_lens_k`` equals ``cu_seq_lens_q``; else a ``ValueError``."""
    if isinstance(cu_seq_lens_q, torch.Tensor) and batch_size != 1:
        raise ValueError(f"cu_seq_lens_q describes one packed row; the batch has {batch_size} rows")
    if isinstance(cu_seq_lens_k, torch.Tensor) and (
        not isinstance(cu_seq_lens_q, torch.Tensor) or not torch.equal(cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu())
    ):
        raise ValueError(
            "cu_seq_lens_k must equal cu_seq_lens_q for packed training (each document attends to itself); got "
            f"{cu_seq_lens_k.tolist()} against "
            f"{cu_seq_lens_q.tolist() if isinstance(cu_seq_lens_q, torch.Tensor) else None}"
        )


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
    cu_k = kwargs.get("cu_seq_lens_k")
    pos = kwargs.get("position_ids")
    sources = [t for t in (cu, cu_k, attention_mask, pos) if isinstance(t, torch.Tensor)]
    tensors = tensor_cache_key(*sources)
    key = (batch_size, seq_len, str(device), tensors)
    hit = _PLANS.get(key) if tensors is not None else None
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], sources)):
        _PLANS.move_to_end(key)
        return hit[1]
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    check_packed_offsets(batch_size, cu, cu_k)
    doc_ids = packed_doc_ids(batch_size, seq_len, position_ids=pos, attention_mask=mask, cu_seq_lens=cu)
    plan = _Plan(doc_ids, device)
    if tensors is None:
        return plan
    _PLANS[key] = ([weakref.ref(t) for t in sources], plan)
    while len(_PLANS) > _PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


# ----------------------------------------------------------------------------------------------------------
# the attention implementation
# ----------------------------------------------------------------------------------------------------------

#: Keyword arguments that some transformers models pass to their attention function and that change what it
#: computes beyond per-document causal softmax attention; given (not None), they are refused, never dropped.
UNSUPPORTED_KWARGS = {
    "softcap": "attention-logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "sparse (top-k) attention indices; for GLM-MoE-DSA / DeepSeek-V3.2 call longtrain.integrations.hf."
    "apply_dsa(model)",
    "block_indices": "block-sparse attention indices",
}


def _longest_document(step, plan) -> int:
    """Tokens in the longest real document of the CP step (``step``) or of the batch's plan (cached per step)."""
    if step is None:
        return plan.max_len
    hit = step.cache.get("hf_longest_document")
    if hit is None:
        runs = step.packed_cu_seqlens_cpu.tolist()
        ids = step.doc_ids[0, torch.tensor(runs[:-1], device=step.doc_ids.device)].cpu().tolist() if runs[1:] else []
        hit = max((b - a for a, b, d in zip(runs[:-1], runs[1:], ids) if d != 0), default=0)
        step.cache["hf_longest_document"] = hit
    return hit


def _sliding_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The layer's attention window: the ``sliding_window=`` it passes, else the one it builds only into its mask
    (Qwen2-MoE keeps it on the module, PhiMoE and Mixtral-like models in the config for every layer, models with
    ``layer_types`` for their ``"sliding_attention"`` layers). ``None`` or 0: no window."""
    if kwargs.get("sliding_window") is not None:
        return int(kwargs["sliding_window"]) or None
    if hasattr(module, "sliding_window"):
        return int(module.sliding_window or 0) or None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and index is not None and index < len(layer_types):
        return int(window) if layer_types[index] == "sliding_attention" else None
    return int(window)


def _refuse_what_changes_the_math(module: torch.nn.Module, kwargs: dict, step, plan) -> None:
    name = type(module).__name__
    for key, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise ValueError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} computes per-document causal softmax attention; {name} "
                f"passes {key}= ({what}), which it cannot compute: give this model attn_implementation='sdpa' or "
                "'eager'"
            )
    window = _sliding_window(module, kwargs)
    if window is not None:
        longest = _longest_document(step, plan)
        if longest > int(window):
            raise ValueError(
                f"{name} uses sliding-window attention (sliding_window={window}) and a document here has {longest} "
                f"tokens: attn_implementation={ATTN_IMPLEMENTATION!r} attends to the whole document, which differs "
                "for documents longer than the window. Pack documents of at most the window, set "
                "config.sliding_window=None if the model should attend fully, or use attn_implementation='sdpa'"
            )


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
        _refuse_what_changes_the_math(module, kwargs, step, None)
        if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
            raise ValueError(
                "inside a CP step the document ids decide padding; the model received an attention_mask with zeros "
                "(build the batch with hf_cp_batch / make_cp_blockdiag_batch_and_ctx, which drop it)"
            )
        out = cp_blockdiag_sdpa(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2), None
    check_recompute_outside_context(f"attn_implementation={ATTN_IMPLEMENTATION!r}")
    b, hq, s, d = query.shape
    plan = _plan_for(b, s, query.device, kwargs, attention_mask)
    _refuse_what_changes_the_math(module, kwargs, None, plan)
    query, key, value = autocast_like_sdpa(query, key, value)  # bf16 training runs under autocast (Trainer bf16=True)
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
