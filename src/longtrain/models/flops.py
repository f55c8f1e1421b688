"""Model FLOPs of one :class:`~longtrain.models.TinyLM` training step, and MFU against a GPU's documented peak.

The conventions are the project's (``benchmarks/README.md``, "Whole-model FLOPs"), forward + backward of one
packed row of documents with lengths ``L_d`` (padding not counted):

- **weights**: ``6 · P · T`` for the ``P`` matmul weights that train (every ``nn.Linear``, the LM head included,
  the embedding lookup not), ``T = Σ L_d`` real tokens; the lightning indexer's projections (``wq_b``, ``wk``,
  ``weights_proj``) get no gradient (top-k indices are integers), so they count ``2 · P_I · T``;
- **block-diagonal attention** (``G`` layers): ``4 · MaskArea · H · D`` forward and 2.5x that backward,
  ``MaskArea = Σ L_d (L_d + 1) / 2``;
- **sparse MLA** (``D`` and ``S`` layers): ``2 · H · (D_qk + D_v)`` forward and ``2 · H · (3 · D_qk + 2 · D_v)``
  backward per valid slot, a token at position ``p`` of its document having ``min(p + 1, K)`` valid slots;
- **indexer** (``D`` layers): ``2 · H_I · D_I`` per scored causal pair (``MaskArea`` pairs), forward only.

Not counted: norms, RoPE, activations, softmax, the loss, and the recurrence of fla GDN (``N``) layers (only their
projections count), so MFU is a lower bound for patterns with ``N`` layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PEAK_BF16_TFLOPS", "FlopCounter", "StepFlops", "doc_lengths_of", "mfu", "peak_tflops"]

#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by ``torch.cuda.get_device_name()``, from NVIDIA's data
#: sheets: H200 SXM and H100 SXM 989.4 (1979 with 2:4 sparsity), A100 312. Other names (NVL and PCIe parts of
#: Hopper included, whose clocks differ) are unknown: MFU is then n/a unless the demo is given ``--peak-tflops``.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "NVIDIA H200": 989.4,
    "NVIDIA H100 80GB HBM3": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
}

#: The lightning indexer's projections inside a full DSA layer: forward only (no gradient reaches them).
_INDEXER_LINEARS = ("wq_b", "wk", "weights_proj")


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    """FLOPs of one training step (forward + backward), by part."""

    weights: int
    """Matmuls with the model's weights: ``6 · P · T`` (+ ``2 · P_I · T`` for the indexer's projections)."""
    attention: int
    """Block-diagonal attention of the ``G`` layers, forward and backward."""
    sparse_mla: int
    """Sparse MLA of the ``D`` and ``S`` layers over their valid slots, forward and backward."""
    indexer: int
    """Indexer logits of the ``D`` layers over every scored causal pair (forward only)."""

    @property
    def total(self) -> int:
        return self.weights + self.attention + self.sparse_mla + self.indexer


def _mask_area(lengths: Sequence[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def _valid_slots(lengths: Sequence[int], topk: int) -> int:
    """``Σ_d Σ_{p < L_d} min(p + 1, K)``."""
    total = 0
    for n in lengths:
        head = min(n, topk)
        total += head * (head + 1) // 2 + (n - head) * topk
    return total


@dataclass(frozen=True, kw_only=True)
class FlopCounter:
    """The shape facts of one model that its step FLOPs depend on; :meth:`for_model` reads them off a model."""

    trained_matmul_params: int
    """Weights of every ``nn.Linear`` that trains (6 FLOPs per token each)."""
    forward_only_matmul_params: int
    """Weights of the indexer projections (2 FLOPs per token each)."""
    gqa_layers: int = 0
    gqa_heads: int = 0
    """Query heads ``H`` of a ``G`` layer."""
    gqa_head_dim: int = 0
    mla_layers: int = 0
    """``D`` plus ``S`` layers."""
    mla_heads: int = 0
    mla_d_qk: int = 0
    """Absorbed query/key width: latent + rope (576 in GLM-5.2)."""
    mla_d_v: int = 0
    """Latent value width (512 in GLM-5.2)."""
    topk: int = 1
    indexer_layers: int = 0
    """``D`` layers (those with their own indexer)."""
    indexer_heads: int = 0
    indexer_dim: int = 0

    @classmethod
    def for_model(cls, model: nn.Module) -> FlopCounter:
        """Read the counts off a :class:`~longtrain.models.TinyLM` (any device, the meta device included)."""
        from longtrain.dsa.layer import DSAAttention
        from longtrain.models.tiny_lm import TinyLM

        if not isinstance(model, TinyLM):
            raise TypeError(f"FlopCounter.for_model needs a longtrain.models.TinyLM, got {type(model).__name__}")
        forward_only: set[int] = set()
        for module in model.modules():
            if isinstance(module, DSAAttention) and module.indexer_type == "full":
                forward_only.update(id(getattr(module, name)) for name in _INDEXER_LINEARS)
        trained = frozen = 0
        for module in model.modules():
            if isinstance(module, nn.Linear):
                if id(module) in forward_only:
                    frozen += module.weight.numel()
                else:
                    trained += module.weight.numel()
        c = model.config
        d = c.dsa_config()
        kinds = c.layers
        return cls(
            trained_matmul_params=trained,
            forward_only_matmul_params=frozen,
            gqa_layers=kinds.count("G"),
            gqa_heads=c.num_heads,
            gqa_head_dim=c.head_dim,
            mla_layers=kinds.count("D") + kinds.count("S"),
            mla_heads=d.num_heads,
            mla_d_qk=d.kv_lora_rank + d.qk_rope_head_dim,
            mla_d_v=d.kv_lora_rank,
            topk=d.index_topk,
            indexer_layers=kinds.count("D"),
            indexer_heads=d.index_n_heads,
            indexer_dim=d.index_head_dim,
        )

    def step(self, doc_lengths: Sequence[int]) -> StepFlops:
        """FLOPs of one forward + backward over documents of these lengths (tokens; padding excluded)."""
        lengths = [int(n) for n in doc_lengths]
        if any(n < 0 for n in lengths):
            raise ValueError(f"document lengths must be >= 0, got {lengths}")
        tokens = sum(lengths)
        area = _mask_area(lengths)
        attn_fwd = 4 * area * self.gqa_heads * self.gqa_head_dim
        slots = _valid_slots(lengths, self.topk)
        mla = 2 * self.mla_heads * slots * ((self.mla_d_qk + self.mla_d_v) + (3 * self.mla_d_qk + 2 * self.mla_d_v))
        return StepFlops(
            weights=6 * self.trained_matmul_params * tokens + 2 * self.forward_only_matmul_params * tokens,
            # backward = 2.5 x forward: 3.5 x forward in all (integers: 7/2 of an even number)
            attention=self.gqa_layers * attn_fwd * 7 // 2,
            sparse_mla=self.mla_layers * mla,
            indexer=self.indexer_layers * 2 * self.indexer_heads * self.indexer_dim * area,
        )


def doc_lengths_of(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of documents ``1, 2, ...`` of a ``[S]`` id row (0 = padding, not counted)."""
    counts = torch.bincount(doc_ids.reshape(-1).cpu().to(torch.int64))
    return [int(n) for n in counts[1:].tolist() if n > 0]


def peak_tflops(device: torch.device | str, override: float | None = None) -> tuple[float | None, str]:
    """``(peak TFLOP/s or None, where it comes from)`` for MFU on ``device``.

    ``override`` (the demo's ``--peak-tflops``) wins; else CUDA devices are looked up in :data:`PEAK_BF16_TFLOPS`
    by name; CPUs and unknown GPUs give ``None``.
    """
    device = torch.device(device)
    if override is not None:
        return float(override), "given (--peak-tflops)"
    if device.type != "cuda":
        return None, f"no documented peak for {device.type}"
    name = torch.cuda.get_device_name(device)
    peak = PEAK_BF16_TFLOPS.get(name)
    if peak is None:
        return None, f"no documented peak for {name!r} (pass --peak-tflops)"
    return peak, f"{name} bf16 dense"


def mfu(tflops_per_gpu: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model TFLOP/s per GPU over the peak (None without a peak)."""
    if peak is None or not math.isfinite(tflops_per_gpu):
        return None
    return tflops_per_gpu / peak
