"""A GLM-5.2-style DSA attention module (MLA + lightning indexer) for packed THD input, CP-aware.

Per token row ``t`` with hidden state ``x_t`` and per-document position ``p_t``:

- query: ``q_resid = RMSNorm(W_qa x)``; ``q = W_qb q_resid`` as ``[H, nope + rope]`` (MLA layout [nope, rope]);
  interleaved-pair RoPE on the rope part;
- latent KV: ``[c, k_pe] = W_kva x``, ``c = RMSNorm(c)``, interleaved RoPE on ``k_pe`` (one head shared by all);
- indexer (full layers): ``qI = W_qI q_resid`` as ``[H_I, D_I]``, ``kI = LayerNorm(W_kI x)``, both laid out
  [rope, nope] with half-split (rotate-half) RoPE on the rope part (same angle table as MLA); head weights
  ``W_w x`` scaled once by ``H_I**-0.5 * D_I**-0.5``; top-k over eligible keys
  (:func:`~longtrain.dsa.ops.indexer_topk`);
- absorbed attention: ``Q = [q_nope W_kc, q_pe]`` ``[T, H, kv_lora_rank + rope]``, ``KV = [c, k_pe]``,
  sparse attention over the top-k keys with value ``c`` (:func:`~longtrain.dsa.ops.sparse_mla_attention`), then
  ``W_vc`` per head and ``o_proj``. This equals ordinary MLA restricted to the selected keys.

Shared ("IndexShare") layers have no indexer and reuse the previous full layer's top-k.

Context parallelism: each rank holds a contiguous block of rows of the (padded-storage) packed sequence, or,
with a balanced :class:`~longtrain.blockdiag_cp.CPStep`, several ranges of it (:class:`DSAQueryParts`). The
latent KV (``c``, ``k_pe``) and indexer keys are all-gathered along tokens differentiably (backward:
reduce-scatter, or all-reduce + slice on gloo) and, for a balanced step, put back in row order; queries stay local
and address keys by global coordinate, one kernel call per contiguous range of local rows.
The indexer receives no gradient from the LM loss (top-k indices are integers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longtrain._autograd import differentiable_once
from longtrain.dsa import ops
from longtrain.dsa.metadata import (
    CudnnDsaPackedMetadata,
    check_dsa_metadata,
    mask_ineligible,
    prepare_dsa_metadata,
)

__all__ = [
    "DSAAttention",
    "DSAConfig",
    "DSAQueryParts",
    "derive_indexer_types",
    "gather_rows",
    "gather_tokens",
    "mla_softmax_scale",
    "rope_angles",
    "rope_interleaved",
    "rope_half_split",
]

INDEXER_TYPES = ("full", "shared")


@dataclass(kw_only=True)
class DSAConfig:
    """Dimensions and options of one DSA attention layer.

    The dimension defaults are GLM-5.2's attention shapes; take the RoPE settings (``rope_theta``,
    ``rope_scaling``, ``max_position_embeddings``) from the checkpoint's config.
    """

    hidden_size: int = 6144
    """Model width (input and output features of the layer)."""
    num_heads: int = 64
    """Attention heads ``H``."""
    q_lora_rank: int = 2048
    """Width of the low-rank query bottleneck (also the indexer's query input)."""
    kv_lora_rank: int = 512
    """Width of the shared latent KV ``c`` (also the latent value width ``d_v``); 512 for the fast kernels."""
    qk_rope_head_dim: int = 64
    """Rotary part of every query/key head (even); 64 for the fast kernels."""
    qk_nope_head_dim: int = 192
    """Non-rotary part of every query head (absorbed into the latent query)."""
    v_head_dim: int = 256
    """Per-head value width after ``W_vc``."""
    index_n_heads: int = 32
    """Indexer heads ``H_I`` (cuDNN accepts 32 or 64)."""
    index_head_dim: int = 128
    """Indexer head dim ``D_I`` (>= ``qk_rope_head_dim``; its first ``qk_rope_head_dim`` dims are rotary)."""
    index_topk: int = 2048
    """Selected keys per query ``K``, in ``[1, 2048]``."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """Optional DeepSeek-YaRN dict: ``factor``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``,
    ``mscale`` / ``mscale_all_dim``. The frequency blend applies when ``max_position_embeddings`` exceeds the
    original window; the softmax ``mscale`` whenever ``factor > 1`` and an mscale is given."""
    max_position_embeddings: int = 202_752
    """Longest position the model is trained for (decides whether YaRN frequency scaling applies)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the query and latent-KV RMSNorms."""
    index_norm_eps: float = 1e-6
    """Epsilon of the indexer key LayerNorm."""
    softmax_scale: float | None = None
    """Override of the attention logit scale; ``None`` derives it with :func:`mla_softmax_scale`."""
    backend: str = "auto"
    """DSA kernel backend for both ops: ``"auto" | "triton" | "cudnn" | "torch"``."""
    indexer_fp8: bool = False
    """The indexer scores FP8 codes of its queries and keys, as DeepSeek-V3.2 runs it (``indexer_topk(...,
    fp8=True)``: triton on CUDA SM89+, or torch); the selection then follows the quantized scores."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DSAConfig.{name} must be a positive int, got {value!r}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DSAConfig.qk_rope_head_dim must be even (RoPE pairs), got {self.qk_rope_head_dim}.")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"DSAConfig.index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim} "
                "(the indexer rotates its first qk_rope_head_dim dims)."
            )
        if self.index_topk > ops.MAX_TOPK:
            raise ValueError(f"DSAConfig.index_topk must be in [1, {ops.MAX_TOPK}], got {self.index_topk}.")
        if self.backend not in ops.BACKENDS:
            raise ValueError(f"DSAConfig.backend must be one of {ops.BACKENDS}, got {self.backend!r}.")
        if not isinstance(self.indexer_fp8, bool):
            raise ValueError(f"DSAConfig.indexer_fp8 must be a bool, got {self.indexer_fp8!r}.")
        if self.indexer_fp8 and self.backend == "cudnn":
            raise ValueError(
                "DSAConfig.indexer_fp8=True has no cudnn route (cuDNN's indexer has no FP8 option): use "
                "backend='auto', 'triton' or 'torch', or indexer_fp8=False."
            )
        for name in ("rope_theta", "rms_norm_eps", "index_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"DSAConfig.{name} must be a finite positive number, got {value!r}.")
        if self.softmax_scale is not None and (
            not isinstance(self.softmax_scale, (int, float))
            or not math.isfinite(self.softmax_scale)
            or self.softmax_scale <= 0
        ):
            raise ValueError(
                f"DSAConfig.softmax_scale must be None or a finite positive number, got {self.softmax_scale!r}."
            )
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(
                    f"DSAConfig.rope_scaling must be a dict or None, got {type(self.rope_scaling).__name__}."
                )
            _check_rope_scaling(self.rope_scaling)

    @property
    def qk_head_dim(self) -> int:
        """Full query/key head width ``nope + rope`` (drives the softmax scale)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """Every field the YaRN code reads is a finite number in its range, so a bad checkpoint config is a ValueError
    here and never a NaN (or a math error) in the first forward."""

    def number(key: str, default: float | None, *, low: float, open_low: bool, what: str) -> None:
        value = scaling.get(key, default)
        if value is None and default is None:  # absent or None: the feature is off
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < low or (open_low and value == low):
            raise ValueError(f"DSAConfig.rope_scaling[{key!r}] must be {what}, got {value!r}.")

    number("factor", 1.0, low=0, open_low=True, what="a finite positive number")
    number("original_max_position_embeddings", None, low=0, open_low=True, what="a positive number")
    number("beta_fast", 32, low=0, open_low=True, what="a finite positive number")
    number("beta_slow", 1, low=0, open_low=True, what="a finite positive number")
    for key in ("mscale", "mscale_all_dim"):
        number(key, None, low=0, open_low=False, what="a finite number >= 0")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_softmax_scale(config: DSAConfig) -> float:
    """The MLA attention logit scale: ``qk_head_dim**-0.5``, times ``m**2`` under DeepSeek YaRN.

    ``m = 0.1 * mscale * ln(factor) + 1`` with ``mscale = rope_scaling['mscale_all_dim']`` (falling back to
    ``rope_scaling['mscale']``) when ``factor > 1``; no mscale means ``m = 1``. ``config.softmax_scale``
    overrides all of it. Never the kernels' ``576**-0.5`` default.
    """
    if config.softmax_scale is not None:
        return float(config.softmax_scale)
    scale = config.qk_head_dim**-0.5
    scaling = config.rope_scaling or {}
    mscale = scaling.get("mscale_all_dim") or scaling.get("mscale")
    if mscale and "factor" in scaling:
        scale *= _yarn_mscale(float(scaling["factor"]), float(mscale)) ** 2
    return scale


def _rope_inv_freq(config: DSAConfig) -> torch.Tensor:
    """``[rope/2] float64`` inverse frequencies, with the DeepSeek YaRN blend when it applies."""
    dim, base = config.qk_rope_head_dim, float(config.rope_theta)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings")
    factor = float(scaling.get("factor", 1.0))
    if original is None or factor <= 1 or config.max_position_embeddings <= original:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(float(scaling.get("beta_fast", 32)))), 0)
    high = min(math.ceil(correction_dim(float(scaling.get("beta_slow", 1)))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_angles(config: DSAConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[T, rope/2]`` of angles ``position * inv_freq`` (float64 for float64 ``dtype``, else fp32)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = _rope_inv_freq(config).to(device=position_ids.device, dtype=work)
    angles = position_ids.to(work)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA RoPE on pairs ``(2i, 2i+1)``: ``x [T, ..., rope]``, ``cos/sin [T, rope/2]``; computed in cos's dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer RoPE, rotate-half flavour: ``y = [x1 cos - x2 sin, x2 cos + x1 sin]`` with ``x = [x1, x2]``."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def derive_indexer_types(
    num_layers: int, *, pattern: str | list[str] | None = None, freq: int | None = None
) -> list[str]:
    """Per-layer indexer modes (``"full"`` or ``"shared"``).

    ``pattern``: a string of ``F``/``S`` or a list of modes, one per layer. Else ``freq = f``: layer ``i`` is
    full iff ``max(i - 1, 0) % max(f, 1) == 0`` (layers 0 and 1 always full). Neither: every layer full.
    Layer 0 must be full (a shared layer reuses the previous full layer's top-k).
    """
    if pattern is not None:
        if isinstance(pattern, str):
            codes = {"F": "full", "S": "shared"}
            if any(ch not in codes for ch in pattern.upper()):
                raise ValueError(f"indexer pattern must contain only 'F' and 'S', got {pattern!r}.")
            types = [codes[ch] for ch in pattern.upper()]
        else:
            types = list(pattern)
            if any(t not in INDEXER_TYPES for t in types):
                raise ValueError(f"indexer types must be in {INDEXER_TYPES}, got {types}.")
        if len(types) != num_layers:
            raise ValueError(f"indexer pattern has {len(types)} entries for {num_layers} layers.")
    elif freq is not None:
        types = ["full" if max(i - 1, 0) % max(freq, 1) == 0 else "shared" for i in range(num_layers)]
    else:
        types = ["full"] * num_layers
    if types and types[0] != "full":
        raise ValueError("the first DSA layer must be 'full': a shared layer needs a previous full layer's top-k.")
    return types


def _cp_world(cp_group: Any) -> tuple[int, int]:
    """``(rank, world)`` of the CP group; ``(0, 1)`` when CP is off."""
    if cp_group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(cp_group), dist.get_world_size(cp_group)


def _cp_from_step(cp_step: Any, cp_group: Any) -> Any:
    """The CP group a :class:`~longtrain.blockdiag_cp.CPStep` stands for (None on one rank); ``cp_group`` must agree."""
    from longtrain.blockdiag_cp.step import CPStep

    if not isinstance(cp_step, CPStep):
        raise TypeError(f"cp_step must be a longtrain.blockdiag_cp.CPStep, got {type(cp_step).__name__}")
    group = cp_step.group if cp_step.world_size > 1 else None
    if cp_group is not None and cp_group is not cp_step.group:
        raise ValueError("cp_group and cp_step name different groups; pass one of them (cp_step carries its group)")
    return group


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward sums every rank's gradient and keeps the local shard."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        from longtrain.blockdiag_cp.exchange import GroupRef

        ctx.group = GroupRef(group)  # the graph must not keep the group alive past destroy_process_group()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    @differentiable_once("DSAAttention's key all-gather")
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            local = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
            dist.reduce_scatter_tensor(local, grad, group=group)
            return local, None
        total = grad.clone()  # gloo has no reduce-scatter: all-reduce, then keep this rank's rows
        dist.all_reduce(total, group=group)
        return total.chunk(world, dim=0)[rank].contiguous(), None


def gather_tokens(tensor: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """Differentiable all-gather of ``[T_local, ...]`` rows into ``[T_local * cp, ...]`` (identity without CP)."""
    if _cp_world(cp_group)[1] == 1:
        return tensor
    return _GatherTokens.apply(tensor, cp_group)


@dataclass(frozen=True, eq=False)
class DSAQueryParts:
    """How one rank's local query rows meet the DSA kernels in a CP step: ``parts`` are ``(local rows, metadata)``
    pairs, one per contiguous range of global positions this rank owns (one pair for a contiguous step), each with
    its :class:`~longtrain.dsa.metadata.CudnnDsaPackedMetadata` over the whole row's keys; ``row_order`` ``[S]
    int64`` maps global position ``g`` to its row in the all-gathered (rank-major) tensor, ``None`` when those
    coincide (contiguous sharding)."""

    parts: tuple[tuple[slice, CudnnDsaPackedMetadata], ...]
    row_order: torch.Tensor | None = None


def gather_rows(tensor: torch.Tensor, cp_group: Any, row_order: torch.Tensor | None) -> torch.Tensor:
    """:func:`gather_tokens`, then the rows put in row order (``row_order`` of :class:`DSAQueryParts`); both
    differentiable."""
    full = gather_tokens(tensor, cp_group)
    return full if row_order is None else full.index_select(0, row_order)


class DSAAttention(nn.Module):
    """GLM-5.2-style DSA attention for packed THD input.

    Args:
        config: the layer dimensions (:class:`DSAConfig`).
        layer_idx: position of the layer in the model (kept for logging and the model helper).
        indexer_type: ``"full"`` (own lightning indexer) or ``"shared"`` (IndexShare: reuse ``prev_topk``).
    """

    def __init__(self, config: DSAConfig, layer_idx: int = 0, indexer_type: str = "full"):
        super().__init__()
        if indexer_type not in INDEXER_TYPES:
            raise ValueError(f"indexer_type must be one of {INDEXER_TYPES}, got {indexer_type!r}.")
        self.config = config
        self.layer_idx = layer_idx
        self.indexer_type = indexer_type
        c = config
        self.softmax_scale = mla_softmax_scale(c)
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        if indexer_type == "full":
            self.wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
            self.wk = nn.Linear(c.hidden_size, c.index_head_dim, bias=False)
            self.k_norm = nn.LayerNorm(c.index_head_dim, eps=c.index_norm_eps)
            self.weights_proj = nn.Linear(c.hidden_size, c.index_n_heads, bias=False)

    def dsa_autotune_shape(self) -> dict[str, Any]:
        """Static kernel shape of this layer, for ``longtrain.dsa.triton.warmup(**shape, device=...)``."""
        c = self.config
        return dict(
            num_heads=c.num_heads,
            d_qk=c.kv_lora_rank + c.qk_rope_head_dim,
            d_v=c.kv_lora_rank,
            topk=c.index_topk,
            index_heads=c.index_n_heads,
            index_dim=c.index_head_dim,
            dtype=self.q_a_proj.weight.dtype,
        )

    def rank_knobs(self) -> tuple[tuple[str, object], ...]:
        """The settings every CP rank of a step must share with this layer (compared once per step, before the first
        gather; ranks that differ would select different keys and agree with no single-GPU run)."""
        c = self.config
        return (
            ("DSA backend", c.backend),
            ("DSA indexer fp8", c.indexer_fp8),
            ("DSA top-k", c.index_topk),
            ("DSA indexer heads x dim", (c.index_n_heads, c.index_head_dim)),
        )

    @staticmethod
    def prepare_metadata(
        cu_seqlens: torch.Tensor,
        num_local_tokens: int,
        *,
        cu_seqlens_padded: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cp_group: Any = None,
    ) -> CudnnDsaPackedMetadata:
        """Metadata for one step (one synchronization); pass it to every layer's ``forward(metadata=...)``.

        Under CP this rank's rows are the global rows ``[rank * T_local, (rank + 1) * T_local)``, and the ranks also
        exchange their row counts and whether their checks passed through the process group's store (one small
        exchange), so that a check failing on one rank raises on every rank before any collective.
        """
        rank, world = _cp_world(cp_group)
        if world == 1:
            return DSAAttention._metadata(cu_seqlens, num_local_tokens, rank, world, cu_seqlens_padded, padding_mask)
        # The ranks agree before any collective: a rank whose rows or layout fail its checks must not leave the
        # others waiting in the all-gather (one exchange through the process group's store).
        from longtrain.blockdiag_cp import consensus, state

        error: Exception | None = None
        try:
            meta = DSAAttention._metadata(cu_seqlens, num_local_tokens, rank, world, cu_seqlens_padded, padding_mask)
        except (ValueError, TypeError) as exc:
            error = exc
        payload = f"local_rows={num_local_tokens};checks={'failed' if error is not None else 'passed'}"
        payloads = consensus.exchange_fingerprints(cp_group, rank, world, payload, state.step_timeout_s())
        if error is not None:
            raise error
        disagreement = consensus.mismatch(payloads)
        if disagreement is not None:
            raise consensus.CPMismatchError(
                f"DSAAttention.prepare_metadata: {disagreement}. Every CP rank passes the same number of rows, its "
                "contiguous block of the padded packed row, and the same cu_seqlens / cu_seqlens_padded"
            )
        return meta

    @staticmethod
    def parts_for_step(cp_step: Any) -> DSAQueryParts:
        """The :class:`DSAQueryParts` of a block-diagonal :class:`~longtrain.blockdiag_cp.CPStep`, contiguous or
        balanced; built once per step (one synchronization per range) and cached on the step for every layer."""
        _cp_from_step(cp_step, None)
        hit = cp_step.cache.get("dsa_parts")
        if hit is not None:
            return hit
        if cp_step.contiguous:
            hit = DSAQueryParts(((slice(0, cp_step.local_len), DSAAttention.metadata_for_step(cp_step)),))
        else:
            plan = cp_step.shard_plan
            device = cp_step.packed_cu_seqlens.device
            cu = cp_step.packed_cu_seqlens.to(torch.int32)
            parts, start = [], 0
            for a, b in plan.pieces[cp_step.rank]:
                meta = prepare_dsa_metadata(
                    cu, plan.seq_len, query_indices=torch.arange(a, b, device=device, dtype=torch.int64),
                    padding_mask=cp_step.doc_ids[0, a:b] == 0,
                )  # fmt: skip
                parts.append((slice(start, start + b - a), meta))
                start += b - a
            order = torch.empty(plan.seq_len, dtype=torch.int64)
            order[plan.permutation] = torch.arange(plan.seq_len)
            hit = DSAQueryParts(tuple(parts), order.to(device))
        cp_step.cache["dsa_parts"] = hit
        return hit

    @staticmethod
    def metadata_for_step(cp_step: Any) -> CudnnDsaPackedMetadata:
        """The DSA metadata of a contiguous block-diagonal :class:`~longtrain.blockdiag_cp.CPStep` (its document
        runs, padding tail and rank), built once per step (one synchronization) and cached on the step for every
        layer. A balanced step has one per range of rows: :meth:`parts_for_step`."""
        _cp_from_step(cp_step, None)
        cp_step.require_contiguous("DSAAttention.metadata_for_step (use parts_for_step)")
        hit = cp_step.cache.get("dsa_metadata")
        if hit is None:
            rows = slice(cp_step.row_offset, cp_step.row_offset + cp_step.local_len)
            hit = cp_step.cache["dsa_metadata"] = DSAAttention._metadata(
                cp_step.packed_cu_seqlens.to(torch.int32), cp_step.local_len, cp_step.rank, cp_step.world_size,
                None, cp_step.doc_ids[0, rows] == 0,
            )  # fmt: skip
        return hit

    @staticmethod
    def _metadata(cu_seqlens, num_local_tokens, rank, world, cu_seqlens_padded, padding_mask):
        query_indices = None
        if world > 1:
            query_indices = torch.arange(
                rank * num_local_tokens, (rank + 1) * num_local_tokens, device=cu_seqlens.device, dtype=torch.int64
            )
        return prepare_dsa_metadata(
            cu_seqlens,
            num_local_tokens * world,
            query_indices=query_indices,
            cu_seqlens_padded=cu_seqlens_padded,
            padding_mask=padding_mask,
        )

    def _checked_inputs(self, x, position_ids, cu_seqlens, cu_seqlens_padded, padding_mask, metadata, prev_topk,
                        cp_group, cp_step):  # fmt: skip
        """forward's checks of its arguments: ``(cp_group, DSAQueryParts, prev_topk, T)`` or a ValueError/TypeError."""
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.hidden_size:
            raise ValueError(f"x must be [T, {c.hidden_size}] (packed THD rows), got {tuple(x.shape)}.")
        num_tokens = x.shape[0]
        if position_ids.shape != (num_tokens,):
            raise ValueError(f"position_ids must be [{num_tokens}], got {tuple(position_ids.shape)}.")
        parts = None
        if cp_step is not None:
            cp_group = _cp_from_step(cp_step, cp_group)
            if num_tokens != cp_step.local_len:
                raise ValueError(f"x has {num_tokens} rows but cp_step's shard holds {cp_step.local_len}.")
            if not cp_step.contiguous and (metadata is not None or cu_seqlens is not None):
                raise ValueError(
                    "a balanced cp_step owns several ranges of the row: DSAAttention builds their metadata itself "
                    "(DSAAttention.parts_for_step); pass neither metadata nor cu_seqlens with it"
                )
            if metadata is None and cu_seqlens is None:
                parts = self.parts_for_step(cp_step)
            if cu_seqlens is None:
                cu_seqlens = cp_step.packed_cu_seqlens.to(torch.int32)
        if cu_seqlens is None:
            raise ValueError("DSAAttention.forward needs cu_seqlens (or a cp_step that carries the document runs).")
        rank, world = _cp_world(cp_group)
        total_keys = num_tokens * world
        if parts is None:
            if metadata is None:
                metadata = self.prepare_metadata(
                    cu_seqlens,
                    num_tokens,
                    cu_seqlens_padded=cu_seqlens_padded,
                    padding_mask=padding_mask,
                    cp_group=cp_group,
                )
            else:
                check_dsa_metadata(metadata, num_tokens, total_keys, x.device)
            parts = DSAQueryParts(((slice(0, num_tokens), metadata),))
        if self.indexer_type == "shared":
            if prev_topk is None:
                raise ValueError(
                    f"shared DSA layer {self.layer_idx} (IndexShare) requires prev_topk from the previous full layer."
                )
            if prev_topk.dim() == 3 and prev_topk.shape[1] == 1:
                prev_topk = prev_topk[:, 0]
            if tuple(prev_topk.shape) != (num_tokens, c.index_topk):
                raise ValueError(
                    f"prev_topk must be [{num_tokens}, {c.index_topk}] (T, index_topk), got {tuple(prev_topk.shape)}."
                )
        return cp_group, parts, prev_topk, num_tokens

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        cu_seqlens_padded: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        metadata: CudnnDsaPackedMetadata | None = None,
        prev_topk: torch.Tensor | None = None,
        return_topk: bool = False,
        cp_group: Any = None,
        cp_step: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend over packed documents.

        Args:
            x: ``[T, hidden]`` local rows (under CP: this rank's contiguous block of the padded packed sequence).
            position_ids: ``[T]`` integer position of each row inside its document.
            cu_seqlens: ``[N+1] int32`` global compact real-token offsets (may be omitted with ``cp_step``).
            cu_seqlens_padded: optional ``[N+1] int32`` global storage offsets (documents padded for CP).
            padding_mask: optional ``[T] bool`` local padding rows (True = padding).
            metadata: optional result of :meth:`prepare_metadata` shared by all layers of the step (saves a
                synchronization per layer, and under CP a store exchange per layer); when given, ``cu_seqlens``,
                ``cu_seqlens_padded`` and ``padding_mask`` are not read again.
            prev_topk: ``[T, K]`` int top-k of the previous full layer; required by shared layers, ignored by
                full layers.
            return_topk: also return the top-k used (to thread into following shared layers).
            cp_group: context-parallel process group (``None`` or size 1: no CP); a shortcut for ``cp_step``.
            cp_step: the block-diagonal :class:`~longtrain.blockdiag_cp.CPStep` of the row (the same object the
                block-diagonal layers read): its group, rank and document runs; without ``metadata`` and
                ``cu_seqlens`` the step's DSA metadata is used (:meth:`metadata_for_step`, built once per step).

        Returns:
            ``[T, hidden]`` in ``x.dtype``, or ``(out, topk [T, K] int)`` when ``return_topk``. Padding rows give 0.
        """
        c = self.config
        try:
            cp_group, parts, prev_topk, num_tokens = self._checked_inputs(
                x, position_ids, cu_seqlens, cu_seqlens_padded, padding_mask, metadata, prev_topk, cp_group, cp_step
            )
        except (ValueError, TypeError):
            from longtrain.blockdiag_cp.runtime import refuse_on_every_rank
            from longtrain.blockdiag_cp.step import CPStep

            if isinstance(cp_step, CPStep):  # the other ranks would wait for this one in the step's rank check
                refuse_on_every_rank(cp_step, kind="dsa")
            raise

        cos, sin = rope_angles(c, position_ids, x.dtype)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(num_tokens, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = rope_interleaved(q_pe, cos, sin)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = rope_interleaved(k_pe, cos, sin)
        if cp_step is not None:  # the ranks agree on the step before its first collective (once per step)
            from longtrain.blockdiag_cp.runtime import check_ranks_agree

            check_ranks_agree(cp_step, q, latent[:, None, :], kind="dsa", knobs=self.rank_knobs())
        latent = gather_rows(latent, cp_group, parts.row_order)
        k_pe = gather_rows(k_pe, cp_group, parts.row_order)

        if self.indexer_type == "full":
            topk = self._indexer_topk(x, q_resid, cos, sin, cu_seqlens, parts, cp_group)
        else:
            topk = prev_topk  # handed on as given; attention reads only its eligible indices

        weight = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_kc, w_vc = weight.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        q_absorbed = torch.einsum("thd,hdc->thc", q_nope, w_kc.to(q_nope.dtype))
        query = torch.cat([q_absorbed, q_pe], dim=-1)
        key_value = torch.cat([latent, k_pe], dim=-1)[:, None, :]
        pieces = [
            ops.sparse_mla_attention(
                query[rows],
                key_value,
                topk[rows] if self.indexer_type == "full" else mask_ineligible(topk[rows], meta),
                self.softmax_scale,
                d_v=c.kv_lora_rank,
                topk_length=meta.causal_lengths.clamp(max=c.index_topk),
                backend=c.backend,
            )
            for rows, meta in parts.parts
        ]
        attn_latent = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        attn = torch.einsum("thc,hdc->thd", attn_latent, w_vc.to(attn_latent.dtype))
        out = self.o_proj(attn.reshape(num_tokens, c.num_heads * c.v_head_dim))
        return (out, topk) if return_topk else out

    def _indexer_topk(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor,
        parts: DSAQueryParts,
        cp_group: Any,
    ) -> torch.Tensor:
        c = self.config
        rope = c.qk_rope_head_dim
        index_q = self.wq_b(q_resid).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        index_q = torch.cat([rope_half_split(index_q[..., :rope], cos, sin), index_q[..., rope:]], dim=-1)
        index_k = self.k_norm(self.wk(x))
        index_k = torch.cat([rope_half_split(index_k[..., :rope], cos, sin), index_k[..., rope:]], dim=-1)
        index_k = gather_rows(index_k, cp_group, parts.row_order)
        weight_dtype = torch.promote_types(x.dtype, torch.float32)
        head_weights = self.weights_proj(x).to(weight_dtype) * (c.index_n_heads**-0.5 * c.index_head_dim**-0.5)
        topk = [
            ops.indexer_topk(
                index_q[rows],
                index_k,
                head_weights[rows],
                cu_seqlens,
                c.index_topk,
                packed_metadata=meta,
                backend=c.backend,
                fp8=c.indexer_fp8,
            )
            for rows, meta in parts.parts
        ]
        return topk[0] if len(topk) == 1 else torch.cat(topk, dim=0)
