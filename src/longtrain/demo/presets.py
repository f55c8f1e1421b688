"""The presets of ``longtrain demo``: one table (:data:`PRESETS`) of named defaults.

A preset gives the defaults of the demo's options; every value is overridden by a flag or a ``--config`` key
(``model:`` keys one by one, over the preset's). The table drives the validation of ``--preset``, the ``--help``
text of every option it sets and the README's preset table (:func:`presets_markdown`, checked by a test).

- ``tiny``: the CPU demo (0.2M parameters, 2048-token rows of chapters on 2 gloo ranks); the default unless
  the run is on CUDA.
- ``h200-32k``: a GLM-5.2-style decoder at realistic width (0.74B parameters) for one H200: GQA block-diagonal
  layers interleaved with DSA layers at GLM-5.2's attention shape (64 heads, ``D_qk = 576`` = latent 512 + rope 64,
  ``D_v = 512``, top-2048, an indexer of 32 heads x 128, IndexShare ``S`` layers), RoPE, SwiGLU, bf16, on packed
  32768-token rows of whole books; the default for ``--device cuda`` (and ``auto`` on a machine with CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

__all__ = ["DEFAULT_CUDA_PRESET", "DEFAULT_PRESET", "PRESETS", "DemoPreset", "default_preset", "presets_markdown"]


@dataclass(frozen=True, kw_only=True)
class DemoPreset:
    """The defaults one preset gives; every field but ``summary`` is a key of ``DemoConfig`` of the same name."""

    summary: str
    """One line for ``--help`` and the docs."""
    steps: int
    seq_len: int
    cp: int
    device: str
    dtype: str
    lr: float
    documents: str
    min_doc: int
    max_doc: int | None
    max_pad: int | None
    parity: bool
    model: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Overrides of :class:`longtrain.models.TinyLMConfig` (a ``--config`` file's ``model:`` keys win one by one)."""

    def defaults(self) -> dict[str, Any]:
        """The ``DemoConfig`` keys this preset sets, as a fresh dict (``model`` a fresh dict too)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "summary"}
        out["model"] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.model.items()}
        return out


#: GLM-5.2's DSA attention shape (the sparse kernels' widths) at a 0.74B-parameter decoder's width.
_H200_MODEL = MappingProxyType(
    {
        "vocab_size": 320,  # the 257 byte ids, padded to a multiple of 64 for aligned LM-head matmuls
        "hidden_size": 2048,
        "layers": "GDSG" * 3,
        "num_heads": 16,
        "num_kv_heads": 4,
        "head_dim": 128,
        "intermediate_size": 5632,
        "rope_theta": 1_000_000.0,
        "init_std": 0.02,
        "dsa_heads": 64,
        "dsa_q_lora_rank": 1024,
        "dsa_kv_lora_rank": 512,
        "dsa_rope_head_dim": 64,
        "dsa_nope_head_dim": 128,
        "dsa_v_head_dim": 128,
        "index_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
    }
)

#: Every preset, by name: the one table of presets.
PRESETS: Mapping[str, DemoPreset] = MappingProxyType(
    {
        "tiny": DemoPreset(
            summary="the CPU demo: a 0.2M-parameter GDSG model (GDSGN with fla on CUDA) on chapters, 2 ranks",
            steps=200,
            seq_len=2048,
            cp=2,
            device="cpu",
            dtype="auto",
            lr=3e-3,
            documents="chapters",
            min_doc=16,
            max_doc=None,
            max_pad=None,
            parity=True,
        ),
        "h200-32k": DemoPreset(
            summary="a 0.74B GLM-5.2-style decoder (GQA + DSA/IndexShare at GLM-5.2's attention shape), bf16, "
            "32768-token rows of whole books, one GPU",
            steps=300,
            seq_len=32768,
            cp=1,
            device="cuda",
            dtype="bfloat16",
            lr=3e-4,
            documents="books",
            min_doc=256,
            max_doc=None,
            max_pad=256,
            parity=True,
            model=_H200_MODEL,
        ),
    }
)
DEFAULT_PRESET = "tiny"
DEFAULT_CUDA_PRESET = "h200-32k"


def default_preset(device: str, cuda_available: bool) -> str:
    """The preset a run gets when it names none: ``h200-32k`` for ``device="cuda"`` (or ``"auto"`` with CUDA
    available), else ``tiny``."""
    if device == "cuda" or (device == "auto" and cuda_available):
        return DEFAULT_CUDA_PRESET
    return DEFAULT_PRESET


def help_default(name: str) -> str:
    """``"default 200"`` when every preset agrees, else ``"default: tiny 200, h200-32k 300"`` (for ``--help``)."""
    values = {p: getattr(preset, name) for p, preset in PRESETS.items()}
    if len(set(map(repr, values.values()))) == 1:
        return f"default {next(iter(values.values()))}"
    return "default: " + ", ".join(f"{p} {v}" for p, v in values.items())


def _fmt(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and value >= 1000 else f"{value:g}"
    return f"`{value}`" if isinstance(value, str) else str(value)


def presets_markdown() -> str:
    """The README's table of presets: one column per preset, one row per option and ``model:`` key it sets (the
    TinyLMConfig default where a preset leaves a key alone), and the parameter count (built on the meta device)."""
    import torch

    from longtrain.models import TinyLM, TinyLMConfig

    names = list(PRESETS)
    base = TinyLMConfig()
    rows = [("", *(f"`{n}`" for n in names)), ("what", *(PRESETS[n].summary for n in names))]
    for f in fields(DemoPreset):
        if f.name not in ("summary", "model"):
            rows.append((f"`{f.name}`", *(_fmt(getattr(PRESETS[n], f.name)) for n in names)))
    keys = list(dict.fromkeys(k for n in names for k in PRESETS[n].model))
    for key in keys:
        rows.append((f"`model.{key}`", *(_fmt(PRESETS[n].model.get(key, getattr(base, key))) for n in names)))
    counts = []
    for n in names:
        with torch.device("meta"):
            model = TinyLM(TinyLMConfig(**PRESETS[n].model))
        counts.append(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    rows.append(("parameters", *counts))
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)
