"""Block-diagonal context parallelism for packed documents.

Packed rows of many documents, per-document causal attention, the sequence sharded contiguously over the
context-parallel (CP) ranks. The public surface:

- :func:`make_cp_blockdiag_batch_and_ctx` shards one packed batch and returns the step context factory;
- :func:`cp_blockdiag_sdpa` is the SDPA drop-in attention layers call (stock SDPA outside a context);
- :func:`configure_cp_varlen` / :func:`cp_varlen_runtime_config` choose the varlen backend and K/V exchange;
- :func:`current_blockdiag_cp_state` gives layers the step's :class:`BlockdiagCpModelState`;
- ``enable_cp1_packed_varlen`` & co. run the same attention on a single rank (cp = 1).

The kernels live in :mod:`longtrain.blockdiag_cp.kernels` and :mod:`longtrain.blockdiag_cp.backends`.
Importing this package imports no optional dependency.
"""

from .batch import ShardLayout, make_cp_blockdiag_batch_and_ctx
from .packed import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
)
from .runtime import cp_blockdiag_sdpa
from .state import (
    BlockdiagCpModelState,
    configure_cp_varlen,
    cp_varlen_runtime_config,
    current_blockdiag_cp_state,
)

__all__ = [
    "BlockdiagCpModelState",
    "ShardLayout",
    "attach_cp1_packed_varlen_hooks",
    "configure_cp_varlen",
    "cp1_packed_varlen_backend",
    "cp_blockdiag_sdpa",
    "cp_varlen_runtime_config",
    "current_blockdiag_cp_state",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
    "make_cp_blockdiag_batch_and_ctx",
]
