"""Setup-time prewarm: move one-time lazy initialisation (and its memory spikes) out of training step 1.

Several CUDA runtime components initialize lazily on first use: cuBLAS/cuBLASLt allocate workspaces on the
first backward matmul of each dtype; Triton autotuners benchmark every candidate config on a kernel's first
launch for a new key (fla's gated-delta-rule and Mamba's SSD backward kernels are the heavy cases, and so are
longtrain's DSA kernels); NCCL creates a communicator, with scratch buffers outside the torch caching
allocator, on a group's first collective. When that first use falls in step 1, at peak activation memory,
it can fail with ``NCCL ... Cuda failure 2 'out of memory'`` or ``Triton Error [CUDA]: out of memory`` even
though the run fits in steady state. :class:`PrewarmConfig` runs tiny synthetic versions of the same work,
with the same autotune keys, at setup time.

Contract: opt-in; best-effort (``apply`` never raises an ``Exception``; each prewarm is isolated and its
failures are logged); RNG-neutral (CPU and target-CUDA generator states are unchanged, also after a
failure); no parameter, gradient or optimizer state is touched; transient memory is released
(``torch.cuda.empty_cache``), while cuBLAS workspaces, NCCL communicators and autotune results persist by
design.

Late binding: every cross-call between the names below goes through this package's namespace at call
time (``PrewarmConfig.apply`` -> ``run_prewarms`` -> the ``_prewarm_*`` workers -> ``_resolve_cuda_device``,
``safe_import``, ``safe_import_from``, the ``_collect_*`` functions, ``_triton_kernel_accepts`` and the
inner ``_prewarm_fla_gdn_cp_kernels`` / ``_prewarm_fla_gdn_end_to_end`` / ``_prewarm_mamba_ssd_end_to_end``),
so ``monkeypatch.setattr(longtrain.prewarm, name, fake)`` is seen by every caller. Patch here, not on the
submodules. Everything logs to ``logger`` (``logging.getLogger("longtrain.prewarm")``).
"""

from longtrain.prewarm._common import _resolve_cuda_device, logger, safe_import, safe_import_from
from longtrain.prewarm.blockdiag import _collect_blockdiag_attention_shapes, _prewarm_blockdiag_autotune
from longtrain.prewarm.comm import _prewarm_comm_groups
from longtrain.prewarm.config import PrewarmConfig, PrewarmConfigError
from longtrain.prewarm.cublas import _prewarm_cublas_backward
from longtrain.prewarm.dsa import _collect_dsa_autotune_shapes, _prewarm_dsa_autotune
from longtrain.prewarm.fla_cp import (
    _FLA_CP_BWD_DH_KERNEL_ARGS,
    _FLA_CP_MERGE_KERNEL_ARGS,
    _FLA_MERGE_FWD_BWD_KERNEL_ARGS,
    _FLA_PRE_PROCESS_BWD_KERNEL_ARGS,
    _prewarm_fla_gdn_cp_kernels,
    _triton_kernel_accepts,
)
from longtrain.prewarm.fla_gdn import (
    _collect_gdn_autotune_shapes,
    _GDNAttention,
    _prewarm_fla_gdn_autotune,
    _prewarm_fla_gdn_end_to_end,
    _prewarm_fla_gdn_l2norm_bucket,
)
from longtrain.prewarm.mamba_ssd import (
    _collect_mamba_ssd_autotune_shapes,
    _MambaSSDContextParallel,
    _MambaSSDMixer,
    _prewarm_mamba_ssd_autotune,
    _prewarm_mamba_ssd_end_to_end,
)
from longtrain.prewarm.report import MemorySnapshot, PrewarmReport, PrewarmStep, run_prewarms
from longtrain.prewarm.status import backend_status

__all__ = [
    "MemorySnapshot",
    "PrewarmConfig",
    "PrewarmConfigError",
    "PrewarmReport",
    "PrewarmStep",
    "backend_status",
    "logger",
    "run_prewarms",
    "safe_import",
    "safe_import_from",
    "_FLA_CP_BWD_DH_KERNEL_ARGS",
    "_FLA_CP_MERGE_KERNEL_ARGS",
    "_FLA_MERGE_FWD_BWD_KERNEL_ARGS",
    "_FLA_PRE_PROCESS_BWD_KERNEL_ARGS",
    "_GDNAttention",
    "_MambaSSDContextParallel",
    "_MambaSSDMixer",
    "_collect_blockdiag_attention_shapes",
    "_collect_dsa_autotune_shapes",
    "_collect_gdn_autotune_shapes",
    "_collect_mamba_ssd_autotune_shapes",
    "_prewarm_blockdiag_autotune",
    "_prewarm_comm_groups",
    "_prewarm_cublas_backward",
    "_prewarm_dsa_autotune",
    "_prewarm_fla_gdn_autotune",
    "_prewarm_fla_gdn_cp_kernels",
    "_prewarm_fla_gdn_end_to_end",
    "_prewarm_fla_gdn_l2norm_bucket",
    "_prewarm_mamba_ssd_autotune",
    "_prewarm_mamba_ssd_end_to_end",
    "_resolve_cuda_device",
    "_triton_kernel_accepts",
]
