"""Hugging Face's DSA models (``glm_moe_dsa``, ``deepseek_v32``) on our kernels: :func:`apply_dsa`.

transformers trains these models with a dense ``[B, S, T]`` fp32 indexer score matrix and a dense additive mask
(no 32K-token row fits). :func:`apply_dsa` replaces the forward of every ``GlmMoeDsaAttention`` /
``DeepseekV32Attention`` with one over packed THD rows that reads the module's own weights (nothing is copied or
re-initialised): the fused lightning-indexer top-k (:func:`longtrain.dsa.ops.indexer_topk`, no gradient, as in
Hugging Face whose indexer runs under ``no_grad``) and sparse MLA in the weight-absorbed form over the latent KV
(:func:`longtrain.dsa.ops.sparse_mla_attention`); ``"shared"`` IndexShare layers reuse the previous layer's
top-k. RoPE uses the model module's own functions (interleaved for the attention; the indexer interleaved on
GLM-MoE-DSA, half-split on DeepSeek-V3.2), so the result equals Hugging Face's eager model per document.

Documents come from the CP step (inside :func:`~longtrain.integrations.hf.hf_cp_batch`'s context: this rank's
shard, keys gathered over the CP group) or, without one, from the batch exactly as the ``longtrain_blockdiag``
attention finds them (:func:`~longtrain.integrations.hf.packed_doc_ids`). The model is switched to
``attn_implementation="longtrain_blockdiag"``, whose mask function builds no dense mask.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections import OrderedDict
from typing import Any

import torch

from longtrain.blockdiag_cp import current_cp_step
from longtrain.blockdiag_cp.meta import tensor_cache_key
from longtrain.blockdiag_cp.runtime import check_ranks_agree, check_recompute_outside_context
from longtrain.dsa import ops
from longtrain.dsa.layer import DSAAttention, DSAQueryParts, gather_rows
from longtrain.dsa.metadata import mask_ineligible, prepare_dsa_metadata

__all__ = ["DSA_ATTENTION_CLASSES", "apply_dsa"]

#: Attention classes :func:`apply_dsa` replaces, and the family that decides the indexer's RoPE and return format.
DSA_ATTENTION_CLASSES = {"GlmMoeDsaAttention": "glm", "DeepseekV32Attention": "deepseek"}

_METAS: OrderedDict[tuple, tuple[list, Any]] = OrderedDict()


def apply_dsa(model: torch.nn.Module, *, backend: str = "auto", indexer_fp8: bool = False) -> int:
    """Run every DSA attention module of ``model`` on our indexer and sparse MLA kernels; returns how many.

    ``backend``: ``"auto" | "triton" | "cudnn" | "torch"`` for both ops. ``indexer_fp8``: the indexer scores FP8
    codes of its queries and keys (``indexer_topk(..., fp8=True)``). Training and evaluation forwards only: a
    forward that would read or fill a KV cache outside training (generation) raises a ``ValueError``, and so does a
    training forward with ``attention_dropout > 0`` (the sparse MLA has no dropout).
    """
    from .hf_blockdiag import ATTN_IMPLEMENTATION, register

    register()
    ops._check_backend(backend)
    if not isinstance(indexer_fp8, bool):
        raise TypeError(f"indexer_fp8 must be a bool, got {type(indexer_fp8).__name__}")
    if indexer_fp8 and backend == "cudnn":
        raise ValueError(
            "apply_dsa(indexer_fp8=True) has no cudnn route (cuDNN's indexer has no FP8 option): use backend='auto', "
            "'triton' or 'torch', or indexer_fp8=False"
        )
    count = 0
    for module in model.modules():
        family = DSA_ATTENTION_CLASSES.get(type(module).__name__)
        if family is None:
            continue
        module.forward = types.MethodType(_make_forward(family, backend, indexer_fp8), module)
        count += 1
    if not count:
        raise ValueError(
            f"apply_dsa found no DSA attention module ({', '.join(DSA_ATTENTION_CLASSES)}) in "
            f"{type(model).__name__}: it is for transformers' glm_moe_dsa and deepseek_v32 models"
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # its mask function builds no dense mask
    return count


def _make_forward(family: str, backend: str, indexer_fp8: bool = False):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, position_ids=None,
                prev_topk_indices=None, **kwargs):  # fmt: skip
        return _dsa_forward(self, family, (backend, indexer_fp8), hidden_states, position_embeddings, attention_mask,
                            cache, position_ids, prev_topk_indices, kwargs)  # fmt: skip

    return forward


def _runs(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_real, cu_storage)`` int32 of flattened ids (0 == padding): every document's real tokens are one run,
    padding after a document is its storage tail. Padding before the first document is a document of its own with
    one "real" row (the metadata rejects empty documents); the padding mask marks every one of its rows, so none of
    them attends anything and no other document can reach its key."""
    real, storage, prev = [0], [0], None
    seen: set[int] = set()
    for pos, value in enumerate(doc_ids.flatten().cpu().tolist()):
        if value == 0:
            if prev is None:  # leading padding
                real.append(real[-1] + 1)
                storage.append(storage[-1])
            storage[-1], prev = pos + 1, 0
            continue
        if value != prev:
            if value in seen:
                raise ValueError(
                    f"document {value} continues after padding at position {pos}: padding may only follow a "
                    "document (or lead the row); pass position_ids that restart per document instead"
                )
            seen.add(value)
            real.append(real[-1])
            storage.append(storage[-1])
            prev = value
        real[-1] += 1
        storage[-1] = pos + 1
    return torch.tensor(real, dtype=torch.int32), torch.tensor(storage, dtype=torch.int32)


def _metadata(batch_size: int, seq_len: int, device, position_ids, attention_mask, cu_seq_lens_q=None,
              cu_seq_lens_k=None):  # fmt: skip
    """The packed metadata of a batch without a CP step, from its documents as ``"longtrain_blockdiag"`` finds them:
    ``cu_seq_lens_q`` (checked against ``cu_seq_lens_k``) when the batch brings them, else ``position_ids``; the
    zeros of a 2-D ``attention_mask`` are padding."""
    from .hf_blockdiag import check_packed_offsets, packed_doc_ids

    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    cu = cu_seq_lens_q if isinstance(cu_seq_lens_q, torch.Tensor) else None
    cu_k = cu_seq_lens_k if isinstance(cu_seq_lens_k, torch.Tensor) else None
    sources = [t for t in (position_ids, mask, cu, cu_k) if isinstance(t, torch.Tensor)]
    tensors = tensor_cache_key(*sources)
    key = (batch_size, seq_len, str(device), tensors)
    hit = _METAS.get(key) if tensors is not None else None
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], sources)):
        return hit[1]
    check_packed_offsets(batch_size, cu, cu_k)
    ids = packed_doc_ids(batch_size, seq_len, position_ids=position_ids, attention_mask=mask, cu_seq_lens=cu)
    cu_real, cu_storage = _runs(ids)
    padding = (ids.flatten() == 0).to(device)
    meta = prepare_dsa_metadata(
        cu_real.to(device), batch_size * seq_len, cu_seqlens_padded=cu_storage.to(device), padding_mask=padding
    )
    cu = cu_real.to(device)
    if tensors is None:
        return meta, cu
    _METAS[key] = ([weakref.ref(t) for t in sources], (meta, cu))
    while len(_METAS) > 8:
        _METAS.popitem(last=False)
    return meta, cu


def _dsa_forward(self, family, kernels, hidden_states, position_embeddings, attention_mask, cache, position_ids,
                 prev_topk_indices, kwargs):  # fmt: skip
    dropout = float(getattr(self, "attention_dropout", 0.0) or 0.0)
    if self.training and dropout > 0:
        raise ValueError(
            f"apply_dsa's sparse MLA has no attention dropout, and {type(self).__name__} (layer {self.layer_idx}) "
            f"trains with attention_dropout={dropout}: set config.attention_dropout=0.0 before building the model "
            "(or the attention_dropout of every attention module), or evaluate with model.eval()"
        )
    cache = cache if cache is not None else kwargs.get("past_key_values")
    if cache is not None and not self.training:
        raise ValueError(
            "apply_dsa runs training and evaluation forwards over packed rows, not KV-cache generation: call "
            "model(..., use_cache=False), or generate with a model that apply_dsa was not applied to"
        )
    mod = sys.modules[type(self).__module__]
    cfg = self.config
    batch, seq, _ = hidden_states.shape
    tokens = batch * seq
    heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    lora, v_dim = self.kv_lora_rank, self.v_head_dim

    step = current_cp_step()
    group = None
    if step is not None:
        if batch != 1 or seq != step.local_len:
            raise ValueError(f"inside a CP step the model takes this rank's shard [1, {step.local_len}], got "
                             f"[{batch}, {seq}]")  # fmt: skip
        group = step.group if step.world_size > 1 else None
        step.cache["attention_calls"] = True
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            step.cache["grad_calls"] = True  # a recompute after the step's context exits is then an error
        parts, cu = DSAAttention.parts_for_step(step), step.packed_cu_seqlens.to(torch.int32)
    else:
        check_recompute_outside_context("apply_dsa's attention")
        meta, cu = _metadata(batch, seq, hidden_states.device, position_ids, attention_mask,
                             kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))  # fmt: skip
        parts = DSAQueryParts(((slice(0, tokens), meta),))

    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [lora, rope], dim=-1)
    latent = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_rot, k_rot = mod.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(batch, 1, seq, rope), cos, sin)
    q_nope = q_pass.transpose(1, 2).reshape(tokens, heads, nope)
    q_pe = q_rot.transpose(1, 2).reshape(tokens, heads, rope)
    if step is not None:  # the ranks agree on the step before its first collective (once per step)
        index = (self.indexer.n_heads, self.indexer.head_dim) if self.indexer is not None else "shared (previous layer)"
        knobs = (("DSA backend", kernels[0]), ("DSA indexer fp8", kernels[1]), ("DSA top-k", cfg.index_topk),
                 ("DSA indexer heads x dim", index))  # fmt: skip
        check_ranks_agree(step, q_nope, latent.reshape(tokens, 1, lora), kind="dsa", knobs=knobs)
    latent = gather_rows(latent.reshape(tokens, lora), group, parts.row_order)
    k_pe = gather_rows(k_rot.reshape(tokens, rope), group, parts.row_order)

    topk_width = cfg.index_topk
    if self.indexer is not None:
        topk = _indexer(self.indexer, family, mod, hidden_states, q_resid, cos, sin, parts, cu, group, *kernels)
    else:
        if prev_topk_indices is None or tuple(prev_topk_indices.shape) != (tokens, topk_width):
            raise ValueError(
                f"shared DSA layer {self.layer_idx} needs the previous full layer's top-k [{tokens}, {topk_width}] "
                "from apply_dsa's forward (apply it to the whole model)"
            )
        topk = prev_topk_indices

    weight = self.kv_b_proj.weight.view(heads, nope + v_dim, lora)
    w_kc, w_vc = weight.split([nope, v_dim], dim=1)
    query = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_kc.to(q_nope.dtype)), q_pe], dim=-1)
    key_value = torch.cat([latent, k_pe], dim=-1)[:, None, :]
    pieces = [
        ops.sparse_mla_attention(
            query[rows],
            key_value,
            topk[rows] if self.indexer is not None else mask_ineligible(topk[rows], meta),
            self.scaling,
            d_v=lora,
            topk_length=meta.causal_lengths.clamp(max=topk_width),
            backend=kernels[0],
        )  # fmt: skip
        for rows, meta in parts.parts
    ]
    attn_latent = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    attn = torch.einsum("thc,hdc->thd", attn_latent, w_vc.to(attn_latent.dtype))
    out = self.o_proj(attn.reshape(batch, seq, heads * v_dim))
    return (out, None, topk) if family == "glm" else (out, None)


@torch.no_grad()
def _indexer(indexer, family, mod, hidden_states, q_resid, cos, sin, parts, cu, group, backend, fp8=False):
    batch, seq, _ = hidden_states.shape
    tokens = batch * seq
    n_heads, dim, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, seq, n_heads, dim)
    q_rot, q_pass = torch.split(q, [rope, dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, dim - rope], dim=-1)
    rotate = mod.apply_rotary_pos_emb_interleave if family == "glm" else mod.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    index_q = torch.cat([q_rot, q_pass], dim=-1).reshape(tokens, n_heads, dim)
    index_k = gather_rows(torch.cat([k_rot, k_pass], dim=-1).reshape(tokens, dim), group, parts.row_order)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = (weights * (n_heads**-0.5 * indexer.softmax_scale)).reshape(tokens, n_heads)
    # q and k stay in the model's dtype: HF's indexer multiplies the same bf16 values in fp32, which is what the
    # kernels' fp32 accumulation does; fp32 copies would only run the fused kernel on its far slower fp32 path.
    index_k = index_k.to(index_q.dtype)
    weights = weights.to(torch.promote_types(index_q.dtype, torch.float32))
    topk = [
        ops.indexer_topk(
            index_q[rows],
            index_k,
            weights[rows],
            cu,
            indexer.index_topk,
            packed_metadata=meta,
            backend=backend,
            fp8=fp8,
        )  # fmt: skip
        for rows, meta in parts.parts
    ]
    return topk[0] if len(topk) == 1 else torch.cat(topk, dim=0)
