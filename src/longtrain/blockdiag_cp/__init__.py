"""Block-diagonal context parallelism for packed documents.

Packed rows of many documents, per-document causal attention, the sequence sharded contiguously over the
context-parallel (CP) ranks — one path at every world size, 1 included. The public surface:

- :func:`make_cp_blockdiag_batch_and_ctx` shards one packed batch and returns the step context factory (its
  context publishes the step's :class:`CPStep`); :func:`build_cp_step` builds a step from document ids alone;
- :func:`cp_varlen_attention` attends this rank's THD shard of a step; :func:`cp_blockdiag_sdpa` is the SDPA
  drop-in over it (stock SDPA outside a context); :func:`varlen_attention` is the single-device varlen function
  (flash-attn's calling convention);
- :func:`configure_cp_varlen` / :func:`cp_varlen_runtime_config` choose the varlen backend and K/V exchange;
  :func:`resolve_backend` turns a backend name into the provider that runs;
- :func:`current_blockdiag_cp_state` gives layers the step's :class:`BlockdiagCpModelState`;
- ``enable_cp1_packed_varlen`` & co. run the same attention on a single rank through hooks.

The documented kernels module is :mod:`longtrain.blockdiag_cp.kernels`; the backends live side by side in
:mod:`longtrain.blockdiag_cp.providers`. Importing this package imports no optional dependency.
"""

from .batch import ShardLayout, make_cp_blockdiag_batch_and_ctx
from .consensus import CPMismatchError, CPStepError, CPTimeoutError
from .meta import VarlenMeta
from .packed import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
)
from .providers import resolve_backend
from .runtime import cp_blockdiag_sdpa, cp_varlen_attention, current_cp_step, varlen_attention
from .sharding import CPShardPlan, plan_cp_shards
from .state import (
    BlockdiagCpModelState,
    configure_cp_varlen,
    cp_varlen_runtime_config,
    current_blockdiag_cp_state,
)
from .step import CPStep, ExchangePlan, build_cp_step

__all__ = [
    "BlockdiagCpModelState",
    "CPMismatchError",
    "CPShardPlan",
    "CPStep",
    "CPStepError",
    "CPTimeoutError",
    "ExchangePlan",
    "ShardLayout",
    "VarlenMeta",
    "attach_cp1_packed_varlen_hooks",
    "build_cp_step",
    "configure_cp_varlen",
    "cp1_packed_varlen_backend",
    "cp_blockdiag_sdpa",
    "cp_varlen_attention",
    "cp_varlen_runtime_config",
    "current_blockdiag_cp_state",
    "current_cp_step",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
    "make_cp_blockdiag_batch_and_ctx",
    "plan_cp_shards",
    "resolve_backend",
    "varlen_attention",
]
