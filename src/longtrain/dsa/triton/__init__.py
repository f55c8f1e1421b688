"""Triton kernels for DeepSeek Sparse Attention: fused indexer top-k, sparse MLA forward and backward.

Runs on CUDA SM80+ (and on CPU tensors under ``TRITON_INTERPRET=1``) without FlashMLA or cuDNN. Importing
this package does not import Triton; the kernels load on first use.

- :func:`indexer_topk_triton` — canonical top-k index rows without materialising ``[T_q, T_k]`` scores.
- :func:`sparse_mla_triton` — sparse MLA attention with an optional sink, autograd in q, kv and the sink.
- :func:`availability` — ``(ok, reason)`` for a device; :func:`warmup` — fill autotune caches before step 1.
- :func:`sparse_mla_triton_unchecked`, :func:`indexer_topk_triton_unchecked` — the same without the checks, for
  :mod:`longtrain.dsa.ops`, which validates each call once at its boundary;
  :func:`~longtrain.dsa.triton.sparse_mla.flash_mla_style_fwd` — our forward behind FlashMLA's call convention.
"""

from __future__ import annotations

import importlib
from typing import Any

from longtrain.dsa.triton._common import SELECT_BY_KEYS, IndexerConfig, KernelConfig, SparseMLAConfig, availability

__all__ = [
    "SELECT_BY_KEYS",
    "IndexerConfig",
    "KernelConfig",
    "SparseMLAConfig",
    "availability",
    "indexer_topk_triton",
    "indexer_topk_triton_unchecked",
    "sparse_mla_triton",
    "sparse_mla_triton_unchecked",
    "warmup",
]

_LAZY = {
    "indexer_topk_triton": "longtrain.dsa.triton.indexer_topk",
    "indexer_topk_triton_unchecked": "longtrain.dsa.triton.indexer_topk",
    "sparse_mla_triton": "longtrain.dsa.triton.sparse_mla",
    "sparse_mla_triton_unchecked": "longtrain.dsa.triton.sparse_mla",
    "warmup": "longtrain.dsa.triton.warmup",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
