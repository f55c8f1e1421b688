"""DeepSeek Sparse Attention (DSA) as in GLM-5.2: lightning-indexer top-k and sparse MLA attention.

- :func:`indexer_topk`, :func:`sparse_mla_attention`: the ops, one contract, ``backend="auto" | "triton" |
  "cudnn" | "torch"`` (:mod:`longtrain.dsa.ops`).
- :func:`prepare_dsa_metadata`: the packed THD metadata every backend and layer shares, built once per step.
- :class:`DSAAttention`, :class:`DSAConfig`: a GLM-5.2-style attention module for packed input, CP-aware.
- :mod:`longtrain.dsa.cudnn_dsa`: the split cuDNN-frontend + FlashMLA path; :mod:`longtrain.dsa.reference`:
  the plain-torch oracle.

Importing this package imports neither triton, cudnn nor flash_mla.
"""

from longtrain.dsa.layer import DSAAttention, DSAConfig, derive_indexer_types, mla_softmax_scale
from longtrain.dsa.metadata import CudnnDsaPackedMetadata, DsaMetadata, prepare_dsa_metadata
from longtrain.dsa.ops import backend_status, indexer_topk, sparse_mla_attention

__all__ = [
    "CudnnDsaPackedMetadata",
    "DSAAttention",
    "DSAConfig",
    "DsaMetadata",
    "backend_status",
    "derive_indexer_types",
    "indexer_topk",
    "mla_softmax_scale",
    "prepare_dsa_metadata",
    "sparse_mla_attention",
]
