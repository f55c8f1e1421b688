"""A small decoder language model that exercises every longtrain piece on packed documents.

Layers are chosen by a pattern string, one letter per layer:

- ``G``: GQA attention through :func:`longtrain.blockdiag_cp.cp_blockdiag_sdpa` (block-diagonal over documents,
  context-parallel under a CP step context; on one rank, the packed path of ``enable_cp1_packed_varlen``);
- ``D``: a DSA attention layer with its own lightning indexer (:class:`longtrain.dsa.DSAAttention`);
- ``S``: a shared DSA layer (IndexShare) reusing the top-k of the previous ``D`` layer;
- ``N``: a gated-delta-net layer from fla (``fla.layers.GatedDeltaNet``; CUDA and fla needed).

Every block is pre-norm: ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``. Inputs are one packed row
(``B = 1``); under context parallelism each rank holds a contiguous shard of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longtrain.blockdiag_cp import cp_blockdiag_sdpa, current_cp_step
from longtrain.dsa.layer import DSAAttention, DSAConfig, gather_tokens

__all__ = ["LAYER_KINDS", "StepInputs", "TinyLM", "TinyLMConfig", "default_layer_pattern"]

LAYER_KINDS = {"G": "GQA block-diagonal attention", "D": "DSA (full indexer)", "S": "DSA (IndexShare)", "N": "fla GDN"}


def default_layer_pattern(with_gdn: bool) -> str:
    """Two GQA layers around a full and a shared DSA layer, plus a GDN layer when fla can run."""
    return "GDSGN" if with_gdn else "GDSG"


_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "dsa_heads",
    "dsa_q_lora_rank", "dsa_kv_lora_rank", "dsa_rope_head_dim", "dsa_nope_head_dim", "dsa_v_head_dim", "index_heads",
    "index_head_dim", "index_topk", "gdn_heads", "gdn_head_dim",
)  # fmt: skip


@dataclass(kw_only=True)
class TinyLMConfig:
    """Dimensions of the demo model (defaults: 0.2M parameters, a fraction of a second per step on a CPU; the demo's
    ``h200-32k`` preset sets GLM-5.2's attention widths at about 0.7B parameters)."""

    vocab_size: int = 257
    """Byte-level vocabulary: 256 bytes shifted by one, id 0 is padding."""
    hidden_size: int = 64
    """Model width."""
    layers: str = "GDSG"
    """Layer pattern, one letter per layer (see the module docstring)."""
    num_heads: int = 4
    """Query heads of the GQA layers."""
    num_kv_heads: int = 2
    """Key/value heads of the GQA layers (divides ``num_heads``)."""
    head_dim: int = 16
    """Head dim of the GQA layers (even, for RoPE)."""
    intermediate_size: int = 128
    """SwiGLU hidden width."""
    rope_theta: float = 10_000.0
    """RoPE base of the GQA layers."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.05
    """Standard deviation of the normal initialisation of every linear and embedding weight (0.02 for wide
    models)."""
    dsa_heads: int = 4
    """Attention heads ``H`` of the DSA layers (GLM-5.2: 64)."""
    dsa_q_lora_rank: int = 32
    """Low-rank query bottleneck of the DSA layers (also the indexer's query input)."""
    dsa_kv_lora_rank: int = 32
    """Latent KV width of the DSA layers: the sparse kernels' value width ``D_v`` (GLM-5.2: 512)."""
    dsa_rope_head_dim: int = 16
    """Rotary part of the DSA query/key heads; ``D_qk = dsa_kv_lora_rank + dsa_rope_head_dim`` (GLM-5.2: 64, so
    ``D_qk = 576``)."""
    dsa_nope_head_dim: int = 16
    """Non-rotary part of a DSA query head (absorbed into the latent query)."""
    dsa_v_head_dim: int = 16
    """Per-head value width of the DSA layers after the latent up-projection."""
    index_heads: int = 2
    """Lightning-indexer heads ``H_I`` (GLM-5.2: 32)."""
    index_head_dim: int = 32
    """Lightning-indexer head dim ``D_I`` (GLM-5.2: 128)."""
    index_topk: int = 64
    """Keys each query selects, ``K`` (GLM-5.2: 2048)."""
    dsa: dict[str, Any] = field(default_factory=dict)
    """Overrides of the DSA layer config (keys of :class:`longtrain.dsa.DSAConfig`: ``backend``, ``rope_scaling``,
    ...); a key here wins over the ``dsa_*`` / ``index_*`` fields above."""
    gdn_heads: int = 2
    """Heads of the GDN layers."""
    gdn_head_dim: int = 32
    """Key/value head dim of the GDN layers."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.layers) - set(LAYER_KINDS))
        if not self.layers or bad:
            raise ValueError(
                f"TinyLMConfig.layers must be a non-empty string over {sorted(LAYER_KINDS)}, got {self.layers!r}"
            )
        first_full = self.layers.find("D")
        if "S" in self.layers and (first_full < 0 or self.layers.index("S") < first_full):
            raise ValueError(
                f"TinyLMConfig.layers={self.layers!r}: a shared DSA layer 'S' needs a full 'D' layer before it"
            )
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TinyLMConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.init_std, (int, float)) or isinstance(self.init_std, bool) or not self.init_std > 0:
            raise ValueError(f"TinyLMConfig.init_std must be a positive number, got {self.init_std!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def dsa_config(self) -> DSAConfig:
        """The DSA layer config: the ``dsa_*`` / ``index_*`` fields (small dims that run on a CPU by default), then
        the ``dsa`` overrides."""
        base = dict(
            hidden_size=self.hidden_size,
            num_heads=self.dsa_heads,
            q_lora_rank=self.dsa_q_lora_rank,
            kv_lora_rank=self.dsa_kv_lora_rank,
            qk_rope_head_dim=self.dsa_rope_head_dim,
            qk_nope_head_dim=self.dsa_nope_head_dim,
            v_head_dim=self.dsa_v_head_dim,
            index_n_heads=self.index_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            rope_theta=self.rope_theta,
            max_position_embeddings=1 << 20,
        )
        valid = sorted(f.name for f in dataclasses.fields(DSAConfig))
        unknown = sorted(str(key) for key in self.dsa if key not in valid)
        if unknown:
            raise ValueError(f"TinyLMConfig.dsa: unknown DSAConfig key(s) {unknown}; valid keys: {valid}")
        base.update(self.dsa)
        return DSAConfig(**base)


@dataclass
class StepInputs:
    """What every layer needs to know about the step's packed row (built once per step by the trainer).

    ``cu_seqlens``: ``[N+1] int32`` global document boundaries of the (padded) row, the padding tail as its own
    run; ``padding_mask``: ``[L] bool`` local padding rows; ``dsa_metadata``: the DSA layers' shared metadata;
    ``cp_group``: the context-parallel group (None on one rank).
    """

    cu_seqlens: torch.Tensor
    padding_mask: torch.Tensor
    dsa_metadata: Any
    cp_group: Any = None
    token_index: torch.Tensor | None = None
    """Under balanced sharding: ``[L] int64`` global positions of this rank's rows (None: contiguous rows)."""
    row_order: torch.Tensor | None = None
    """Under balanced sharding: ``[S] int64``, row ``p`` of the row is row ``row_order[p]`` of the ranks' rows
    gathered in rank order. The GDN layers then run on the whole row and keep this rank's rows: exact, without
    their own CP split."""
    cp_step: Any = None
    """Under balanced sharding: the step's :class:`~longtrain.blockdiag_cp.CPStep`; the DSA layers take it (their
    queries stay this rank's rows, the latent KV is gathered in row order)."""

    def whole_row(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, ...]`` local rows -> ``[S, ...]`` the whole row in row order (differentiable all-gather)."""
        return gather_tokens(x, self.cp_group).index_select(0, self.row_order)


def _rope_half(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on ``x: [B, H, L, D]`` with ``position_ids: [B, L]``."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    ang = position_ids.to(torch.float32)[:, None, :, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class GQAAttention(nn.Module):
    """GQA attention over the packed row; document masking comes from the CP step or the cp=1 packed path."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.c = config
        h, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def blockdiag_attention_shape(self) -> dict:
        """Static attention shape, for ``longtrain.blockdiag_cp.warmup.warmup(**shape, device=...)`` (prewarm)."""
        c = self.c
        return dict(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.q_proj.weight.dtype
        )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, length, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope_half(q, position_ids, c.rope_theta), _rope_half(k, position_ids, c.rope_theta)
        gqa = c.num_heads != c.num_kv_heads
        if current_cp_step() is not None:
            out = cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # Outside a step (the parity reference): the packed-varlen hooks route this call inside the module.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, c.num_heads * c.head_dim))


class GDNMixer(nn.Module):
    """fla's gated delta net over the whole packed row (all-gathered under CP, local rows kept: exact)."""

    def __init__(self, config: TinyLMConfig, layer_idx: int):
        super().__init__()
        from fla.layers import GatedDeltaNet

        self.gdn = GatedDeltaNet(
            hidden_size=config.hidden_size,
            head_dim=config.gdn_head_dim,
            num_heads=config.gdn_heads,
            mode="chunk",
            layer_idx=layer_idx,
        )

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        length = x.shape[1]
        if step.row_order is not None:  # balanced sharding: the whole row in row order, this rank's rows kept
            out = self.gdn(step.whole_row(x[0])[None], cu_seqlens=step.cu_seqlens.to(torch.int32))[0]
            return out[:, step.token_index]
        full = gather_tokens(x[0], step.cp_group)[None]
        out = self.gdn(full, cu_seqlens=step.cu_seqlens.to(torch.int32))[0]
        if step.cp_group is None:
            return out
        rank = torch.distributed.get_rank(step.cp_group)
        return out[:, rank * length : (rank + 1) * length]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: TinyLMConfig, kind: str, layer_idx: int):
        super().__init__()
        self.kind = kind
        self.input_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        if kind == "G":
            # Named self_attn so that attach_cp1_packed_varlen_hooks finds it.
            self.self_attn = GQAAttention(config)
        elif kind in ("D", "S"):
            self.dsa = DSAAttention(config.dsa_config(), layer_idx, "full" if kind == "D" else "shared")
        else:
            self.gdn = GDNMixer(config, layer_idx)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, step: StepInputs, topk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.input_norm(x)
        if self.kind == "G":
            h = self.self_attn(h, position_ids)
        elif self.kind == "N":
            h = self.gdn(h, step)
        elif step.cp_step is not None:  # balanced sharding: this rank's rows, keys from the whole row
            h, topk = self.dsa(
                h[0],
                position_ids[0],
                prev_topk=topk if self.kind == "S" else None,
                return_topk=True,
                cp_step=step.cp_step,
            )
            h = h[None]
        else:
            h, topk = self.dsa(
                h[0],
                position_ids[0],
                step.cu_seqlens,
                metadata=step.dsa_metadata,
                prev_topk=topk if self.kind == "S" else None,
                return_topk=True,
                cp_group=step.cp_group,
            )
            h = h[None]
        x = x + h
        return x + self.mlp(self.post_norm(x)), topk


class TinyLM(nn.Module):
    """Embedding, the pattern's blocks, final RMSNorm and LM head; ``forward`` returns logits ``[1, L, V]``."""

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, kind, i) for i, kind in enumerate(config.layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be one packed row [1, L], got {tuple(input_ids.shape)}")
        x = self.embed(input_ids)
        topk = None
        for block in self.blocks:
            x, topk = block(x, position_ids, step, topk)
        return self.lm_head(self.norm(x))
