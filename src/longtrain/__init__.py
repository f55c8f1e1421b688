"""longtrain: runtime pieces for long-context LLM training.

- ``longtrain.blockdiag_cp``: block-diagonal (document-masked) causal attention with the sequence sharded over
  context-parallel ranks.
- ``longtrain.dsa``: DeepSeek Sparse Attention (lightning-indexer top-k + sparse MLA), forward and backward.
- ``longtrain.prewarm``: setup-time warm-up of cuBLAS, Triton autotuners and communicators.

``import longtrain`` imports only torch-free metadata; each subpackage imports torch and nothing optional.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
