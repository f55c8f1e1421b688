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
- :data:`CPTrainer` (``transformers.Trainer`` with :class:`CPTrainerMixin`; built on first use) trains with CP
  through the Trainer: the ranks of a CP group get the same rows, each row goes through :func:`hf_cp_batch`, and
  the Trainer counts it once (see :mod:`longtrain.integrations.hf_trainer`).
- :func:`set_fsdp_gradient_divide_factor` sets FSDP2's gradient divide factor on every FSDP module: with the CP
  ranks inside the FSDP mesh, FSDP's default averaging divides the CP-summed gradient by the CP size too.
"""

from __future__ import annotations

from typing import Any

from .fsdp import set_fsdp_gradient_divide_factor
from .hf_batch import hf_cp_batch, shift_labels
from .hf_blockdiag import (
    ATTN_IMPLEMENTATION,
    MIN_TRANSFORMERS,
    UNSUPPORTED_KWARGS,
    blockdiag_attention_forward,
    packed_doc_ids,
    register,
)
from .hf_dsa import DSA_ATTENTION_CLASSES, apply_dsa
from .hf_trainer import CPTrainerMixin, cp_trainer_class

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPTrainerMixin",
    "DSA_ATTENTION_CLASSES",
    "apply_dsa",
    "MIN_TRANSFORMERS",
    "UNSUPPORTED_KWARGS",
    "blockdiag_attention_forward",
    "cp_trainer_class",
    "hf_cp_batch",
    "packed_doc_ids",
    "register",
    "set_fsdp_gradient_divide_factor",
    "shift_labels",
]


def __getattr__(name: str) -> Any:
    if name == "CPTrainer":  # built on first use (so not in __all__): importing this module imports no transformers
        return cp_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
