"""Configs, availability and small helpers shared by the Triton DSA kernels (imports no Triton)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

__all__ = [
    "TRITON_DTYPES",
    "IndexerConfig",
    "KernelConfig",
    "SELECT_BY_KEYS",
    "SM90_TMA_MIN_KEYS",
    "SparseMLAConfig",
    "Unfit",
    "availability",
    "dot_precision",
    "gpu_name",
    "indexer_fp8_unfit",
    "indexer_unfit",
    "interpreting",
    "next_pow2",
    "require_available",
    "sm_count",
    "sparse_mla_unfit",
]

#: The dtypes the kernels take (fp64 runs on the torch backend only).
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Largest latent width D_qk of the sparse MLA kernels.
_MAX_D = 1024


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached per device): the wave of one-program-per-SM launches."""
    return _sm_count_of(_index(device))


@functools.cache
def _gpu_name_of(device_index: int) -> str:
    return torch.cuda.get_device_properties(device_index).name


def gpu_name(device: torch.device) -> str:
    """The CUDA ``device``'s name (cached per device; ``""`` for a device that is not CUDA): the key of the few
    defaults that were measured to differ between GPUs of one architecture."""
    if device.type != "cuda":
        return ""
    return _gpu_name_of(_index(device))


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tests); half-precision inputs use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_pow2(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or value < low or value > high or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{low}, {high}], got {value!r}")


_LAYOUTS = ("heads", "keys", "keys_logits", "stacked", "fused", "warp_specialized", "ping_pong")
# The backward's probabilities-kernel layouts, and those of them that compute dkv too (no dkv kernel runs).
_BWD_LAYOUTS = ("heads", "stacked", "fused", "warp_specialized")
_FUSED_LAYOUTS = ("fused", "warp_specialized")


@dataclass(kw_only=True)
class KernelConfig:
    """One launch configuration of a sparse MLA kernel (forward or backward)."""

    block_k: int = 64
    """Top-k slots gathered per inner step (a power of two >= 16)."""
    block_h: int = 64
    """Query heads per program; capped at the head count rounded up to a power of two (>= 16)."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 2
    """Software-pipelining depth of the gathered KV loads."""
    layout: str = "heads"
    """Forward: ``"heads"`` (logits ``[heads, keys]``), ``"keys"`` (logits ``[keys, heads]``, output
    accumulated transposed) or ``"keys_logits"`` (logits ``[keys, heads]``, output ``[heads, d_v]``). The
    backward's portable probabilities kernel: ``"heads"``, or ``"stacked"`` (the logits and ``dO V^T`` as one
    matmul of ``2 * block_h`` stacked rows). The backward with ``impl="sm90"``: ``"heads"`` (the SM90 probabilities
    kernel, logits and ``dO V^T`` stacked) or ``"fused"`` (the SM90 kernel that also computes dkv, in place of the
    dkv kernel: ``block_k=64``, ``num_stages=1``). The forward with ``impl="sm90"``: ``"heads"`` (two warpgroups
    splitting the keys, then ``d_v``) or ``"warp_specialized"`` (a producer warpgroup gathering into a ring of
    ``num_stages`` tiles, one warpgroup for the logits, softmax and the left half of ``d_v``, one for the right half;
    ``num_warps=4``, the default partition; ``block_k`` 32 or 64, ``num_stages >= 2``) or ``"ping_pong"`` (a producer
    warpgroup gathering pairs of tiles, two warpgroups each computing one tile of the pair's logits and softmax and
    one half of ``d_v`` over both; ``num_warps=4``, ``block_k=64``, ``num_stages=2``). The backward with
    ``impl="sm90"`` and ``layout="warp_specialized"``: the warp-specialized fused kernel (a producer warpgroup, one
    for the probabilities, one for dkv and its atomics; ``num_warps=4``, ``block_k=64``, ``num_stages=1``)."""
    col_groups: int = 1
    """Backward dkv kernel only: programs per (row, head block), each owning ``d_v / col_groups`` value columns
    (1, 2 or 4; more than 1 gives the rope tail a launch of its own). Autotuned runs use
    ``sparse_mla_bwd.DKV_COL_GROUPS``."""
    impl: str = "triton"
    """Forward and the backward's probabilities kernel: ``"triton"`` (the portable kernel: any SM80+ GPU and the CPU
    interpreter) or ``"sm90"`` (a Hopper kernel: ``num_stages`` gathered tiles in flight through an explicit
    cp.async ring, wgmma; SM90, bf16/fp16, >= 64 heads, power-of-two ``d_v`` in [64, 512] and rope tail 0 or
    16..128, ``num_warps=8``, ``num_stages >= 2``, ``layout="heads"``; the backward's takes ``block_k`` 64 or 32).
    ``config=None`` picks ``"sm90"`` wherever it applies, for the forward and for the backward (its fused
    probabilities + dkv kernel and its dq kernel). ``bwd_dq`` takes ``"sm90"`` too (``block_k`` 64 or 32); the dkv
    kernel is portable only."""

    def __post_init__(self) -> None:
        _check_pow2("block_k", self.block_k, 16, 256)
        _check_pow2("block_h", self.block_h, 16, 128)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be an int in [1, 6], got {self.num_stages!r}")
        if self.col_groups not in (1, 2, 4):
            raise ValueError(f"col_groups must be 1, 2 or 4, got {self.col_groups!r}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, _LAYOUTS))}, got {self.layout!r}")
        if self.impl not in ("triton", "sm90"):
            raise ValueError(f"impl must be one of 'triton', 'sm90', got {self.impl!r}")
        if self.layout == "fused" and (
            self.impl != "sm90" or self.num_warps != 8 or self.block_k != 64 or self.num_stages != 1
        ):
            raise ValueError(
                "layout='fused' is the SM90 backward kernel that computes the probabilities and dkv together (one "
                "gathered tile of 64 slots, two warpgroups): it needs impl='sm90', num_warps=8, block_k=64 and "
                f"num_stages=1, got impl={self.impl!r}, num_warps={self.num_warps}, block_k={self.block_k}, "
                f"num_stages={self.num_stages}"
            )
        if self.layout == "warp_specialized" and (
            self.impl != "sm90" or self.num_warps != 4 or self.block_k not in (32, 64)
        ):
            raise ValueError(
                "layout='warp_specialized' is an SM90 kernel with a producer warpgroup and two consumer warpgroups "
                "(num_warps counts the default partition's): it needs impl='sm90', num_warps=4 and block_k 32 or 64 "
                f"(the forward: num_stages >= 2; the backward: block_k=64, num_stages=1), got impl={self.impl!r}, "
                f"num_warps={self.num_warps}, block_k={self.block_k}"
            )
        if self.layout == "ping_pong" and (
            self.impl != "sm90" or self.num_warps != 4 or self.block_k != 64 or self.num_stages != 2
        ):
            raise ValueError(
                "layout='ping_pong' is the SM90 forward with a producer warpgroup and two consumer warpgroups taking "
                "turns over pairs of 64-slot tiles (num_warps counts the default partition's): it needs impl='sm90', "
                f"num_warps=4, block_k=64 and num_stages=2, got impl={self.impl!r}, num_warps={self.num_warps}, "
                f"block_k={self.block_k}, num_stages={self.num_stages}"
            )
        if (
            self.impl == "sm90"
            and self.layout not in ("fused", "warp_specialized", "ping_pong")
            and (self.num_warps != 8 or self.num_stages < 2 or self.layout != "heads")
        ):
            raise ValueError(
                "impl='sm90' runs two warpgroups over a ring of >= 2 tiles with [heads, keys] logits: it needs "
                f"num_warps=8, num_stages >= 2 and layout='heads', got num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}, layout={self.layout!r}"
            )


@dataclass(kw_only=True)
class SparseMLAConfig:
    """Forced launch configurations for :func:`sparse_mla_triton` (``None`` = autotuned / default)."""

    fwd: KernelConfig | None = None
    """Forward kernel configuration."""
    bwd: KernelConfig | None = None
    """Backward configuration: the probabilities kernel, and the dq / dkv kernels unless given below."""
    bwd_dq: KernelConfig | None = None
    """Backward dq kernel (defaults to ``bwd``)."""
    bwd_dkv: KernelConfig | None = None
    """Backward dkv kernel (defaults to ``bwd``)."""

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd", "bwd_dq", "bwd_dkv"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, KernelConfig):
                raise TypeError(f"SparseMLAConfig.{name} must be a KernelConfig or None, got {type(value).__name__}")
        if self.fwd is not None and self.fwd.layout in ("stacked", "fused"):
            raise ValueError(
                f"SparseMLAConfig.fwd: layout={self.fwd.layout!r} is the backward's probabilities kernel's (set it on "
                "bwd); the forward takes 'heads', 'keys', 'keys_logits', 'warp_specialized' or 'ping_pong'"
            )
        if self.fwd is not None and self.fwd.layout == "warp_specialized" and self.fwd.num_stages < 2:
            raise ValueError(
                "SparseMLAConfig.fwd: the warp-specialized forward streams a ring of num_stages >= 2 tiles, got "
                f"num_stages={self.fwd.num_stages}"
            )
        if self.bwd is not None and self.bwd.layout not in _BWD_LAYOUTS:
            raise ValueError(
                f"SparseMLAConfig.bwd: layout={self.bwd.layout!r} is the forward's; the backward's probabilities "
                f"kernel takes {', '.join(map(repr, _BWD_LAYOUTS))}"
            )
        if self.bwd is not None and self.bwd.layout in _FUSED_LAYOUTS and self.bwd_dkv is not None:
            raise ValueError(
                f"SparseMLAConfig: bwd=KernelConfig(layout={self.bwd.layout!r}) computes dkv in the probabilities "
                "kernel, so there is no dkv kernel for bwd_dkv to configure; drop bwd_dkv or use another bwd layout"
            )
        if (
            self.bwd is not None
            and self.bwd.layout == "warp_specialized"
            and (self.bwd.block_k != 64 or self.bwd.num_stages != 1)
        ):
            raise ValueError(
                "SparseMLAConfig.bwd: the warp-specialized backward gathers one tile of 64 slots at a time: it needs "
                f"block_k=64 and num_stages=1, got block_k={self.bwd.block_k}, num_stages={self.bwd.num_stages}"
            )
        if self.bwd_dq is not None and self.bwd_dq.layout != "heads":
            raise ValueError(
                f"SparseMLAConfig.bwd_dq: the dq kernel has one layout ('heads'), got layout={self.bwd_dq.layout!r}"
            )
        if self.bwd_dkv is not None and (self.bwd_dkv.layout != "heads" or self.bwd_dkv.impl != "triton"):
            raise ValueError(
                "SparseMLAConfig.bwd_dkv: the dkv kernel has one layout and one implementation (layout='heads', "
                f"impl='triton'), got layout={self.bwd_dkv.layout!r}, impl={self.bwd_dkv.impl!r}"
            )

    def backward_configs(self) -> tuple[KernelConfig | None, KernelConfig | None, KernelConfig | None]:
        """Configs of the (probabilities, dq, dkv) backward kernels."""
        if self.bwd is not None and self.bwd.layout in _FUSED_LAYOUTS:  # dq: the default dq kernel unless given
            return self.bwd, self.bwd_dq, None
        return self.bwd, self.bwd_dq or self.bwd, self.bwd_dkv or self.bwd


SELECT_BY_KEYS: tuple[tuple[int | None, int, int], ...] = ((4096, 0, 4096), (32768, 512, 4096), (None, 1024, 4096))
"""``(most key rows, select_sample, select_cand)``: the selection's defaults by the key tensor's rows, first match
(``None``: any number). Measured on the H200 at K = 2048, in the reports
``benchmarks/results/dsa_indexer_overlap_sweep_fdf0b98_2026-12-01.md`` and
``benchmarks/results/dsa_indexer_defaults_sweep_f61a860_2026-12-01.md``: at 4K keys the whole-row select (0.330 ms)
beat the sampled union (0.352); on one 16K document sample 512 (4.61 ms) beat 1024 (4.85), 256 (4.84) and the
whole-row select (5.67); at 64K sample 1024 (64.7 ms) beat 512 (86.0) and 8192 candidates (77.6). 32K is not
measured. The union a row's selection runs on holds K plus the bracket's margin, about
``4 sqrt(K (L - K) / sample) + 4 L / sample`` keys for a row of L keys: 3.1K at K = 2048 on a 16K row with a sample
of 512, 3.7K on a 64K row with 1024; a union over ``select_cand`` falls back to the whole-row select."""


#: Key rows from which ``IndexerConfig(sm90_loader="auto")`` loads the SM90 scoring kernel's tiles by TMA: at
#: 16384 keys TMA was faster, at 4096 cp.async (``dsa_indexer_sm90_0c41f0e_2026-12-02.md``; 8192 is not measured).
SM90_TMA_MIN_KEYS = 8192


@dataclass(kw_only=True)
class IndexerConfig:
    """Launch configuration of the fused indexer top-k (scoring and selection kernels)."""

    block_m: int = 64
    """Query rows per scoring program."""
    block_n: int = 128
    """Keys per scoring program."""
    num_warps: int = 4
    """Warps per scoring program (4 was faster than 8 on every case of
    ``benchmarks/results/dsa_indexer_defaults_sweep_f61a860_2026-12-01.md``, bf16 and FP8)."""
    num_stages: int = 3
    """Pipelining depth of the per-head query loads in the scoring kernel."""
    select_block: int = 2048
    """Scores read per step of the per-row radix selection."""
    select_warps: int = 8
    """Warps per selection program (one program per query row)."""
    select_sample: int | None = None
    """Scores a selection program samples from a row wider than ``select_cand`` to bracket its K-th largest score
    (the exact radix select then runs on the union of the keys at or above the bracket's bottom only); 0 = no
    sampling: the radix select reads the whole row in every pass. ``None``: by the key tensor's rows, see
    :data:`SELECT_BY_KEYS`."""
    select_cand: int | None = None
    """Keys a selection program holds in registers: a row at most this wide whole, a wider one's union (K plus the
    bracket's margin, so it must exceed K to be of use); a union that holds more falls back to the whole-row radix
    select (still exact). ``None``: see :data:`SELECT_BY_KEYS`."""
    scratch_elements: int | None = None
    """Cap on the int32 score scratch (rows x key width); ``None`` = ``max(2 * T_q * K, block_m * T_k)``
    (``indexer_topk.SCRATCH_PER_OUTPUT`` output sizes)."""
    scores_impl: str = "auto"
    """Scoring kernel: ``"auto"`` the SM90 Gluon kernel (``indexer_topk_fwd_sm90_kernel_scores``) where it applies
    (CUDA SM90, bf16/fp16 operands, D_I of 64, 128 or 256, not ``fp8``), the portable Triton kernel elsewhere;
    ``"sm90"`` the SM90 kernel (an error where it does not apply); ``"triton"`` the portable kernel. ``block_m``,
    ``block_n``, ``num_warps`` and ``num_stages`` describe the portable kernel; the SM90 kernel's tile is 64 query rows
    x ``sm90_block_n`` keys over two warpgroups."""
    sm90_block_n: int = 256
    """Keys per SM90 scoring program (128 or 256; the two warpgroups take half each)."""
    sm90_num_buf: int = 5
    """Query-tile buffers of the SM90 scoring kernel's ring (3 to 8; ``num_buf - 2`` heads are loaded ahead)."""
    sm90_group: int = 8
    """Most heads per unrolled step of the SM90 scoring kernel's head loop (1 to 16; the largest divisor of H_I up to
    this, all heads when H_I <= 16): within a step each head's sum overlaps the next head's wgmma, between steps
    it does not. With the cp.async loader 16 was fastest (``dsa_indexer_sm90_aebdc69_2026-12-02.md``, by 0.4-2%);
    with TMA 8 (``dsa_indexer_sm90_0c41f0e_2026-12-02.md``: 3.99 against 4.01 ms at T = 16384)."""
    sm90_loader: str = "auto"
    """How the SM90 scoring kernel loads its query and key tiles: ``"tma"`` (the tensor-memory accelerator, one
    mbarrier per ring buffer; 16-byte aligned tensors, else cp.async), ``"cp_async"`` (per-thread copies, a proxy
    fence and a CTA barrier per head), or ``"auto"``: TMA from :data:`SM90_TMA_MIN_KEYS` keys up, cp.async below.
    TMA was faster at T = 16384 (one document 3.99 against 4.13 ms, documents 1.83 against 1.87) and 65536 (54.9
    against 56.2), slower at 4096 (0.358 against 0.325; ``dsa_indexer_sm90_0c41f0e_2026-12-02.md``)."""

    def __post_init__(self) -> None:
        if self.scores_impl not in ("auto", "sm90", "triton"):
            raise ValueError(f"scores_impl must be one of 'auto', 'sm90', 'triton', got {self.scores_impl!r}")
        if self.sm90_block_n not in (128, 256):
            raise ValueError(f"sm90_block_n must be 128 or 256, got {self.sm90_block_n!r}")
        num_buf = self.sm90_num_buf
        if isinstance(num_buf, bool) or not isinstance(num_buf, int) or not 3 <= num_buf <= 8:
            raise ValueError(f"sm90_num_buf must be an int in [3, 8], got {self.sm90_num_buf!r}")
        if self.sm90_loader not in ("auto", "cp_async", "tma"):
            raise ValueError(f"sm90_loader must be one of 'auto', 'cp_async', 'tma', got {self.sm90_loader!r}")
        group = self.sm90_group
        if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= 16:
            raise ValueError(f"sm90_group must be an int in [1, 16], got {group!r}")
        _check_pow2("block_m", self.block_m, 16, 256)
        _check_pow2("block_n", self.block_n, 16, 512)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        _check_pow2("select_block", self.select_block, 256, 16384)
        _check_pow2("select_warps", self.select_warps, 1, 16)
        if self.select_sample not in (None, 0):
            _check_pow2("select_sample", self.select_sample, 64, 4096)
        if self.select_cand is not None:
            _check_pow2("select_cand", self.select_cand, 256, 16384)
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be an int in [1, 6], got {self.num_stages!r}")
        if self.scratch_elements is not None and (
            not isinstance(self.scratch_elements, int) or self.scratch_elements < 1
        ):
            raise ValueError(f"scratch_elements must be a positive int or None, got {self.scratch_elements!r}")
        for bound, _, _ in SELECT_BY_KEYS:
            num_keys = 1 << 40 if bound is None else bound
            sample, cand = self.resolved_select(num_keys)
            if sample > cand:
                raise ValueError(
                    f"select_sample ({sample}) must be at most select_cand ({cand}) for {num_keys} keys: a row is "
                    "sampled only when it is wider than select_cand"
                )

    def resolved_select(self, num_keys: int) -> tuple[int, int]:
        """``(select_sample, select_cand)`` for a key tensor of ``num_keys`` rows, ``None`` fields from the first row
        of :data:`SELECT_BY_KEYS` that covers ``num_keys``."""
        auto_sample, auto_cand = next((smp, c) for most, smp, c in SELECT_BY_KEYS if most is None or num_keys <= most)
        sample = auto_sample if self.select_sample is None else self.select_sample
        cand = auto_cand if self.select_cand is None else self.select_cand
        return sample, cand


def availability(device: torch.device | str | None = None) -> tuple[bool, str]:
    """``(True, "")`` when the Triton kernels can run on ``device``, else ``(False, reason)``.

    CUDA devices need triton and compute capability 8.0+; CPU tensors run only under ``TRITON_INTERPRET=1``.
    """
    from longtrain import _optional

    ok, reason = _optional.triton()
    if not ok:
        return False, reason
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if interpreting():
            return True, ""
        dev = torch.device("cuda")
    if dev.type == "cpu":
        if interpreting():
            return True, ""
        return False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); use a CUDA device for speed"
    if dev.type != "cuda":
        return False, f"the Triton DSA kernels run on CUDA (or CPU under TRITON_INTERPRET=1), not on {dev.type}"
    ok, reason = _optional.cuda_sm(8, 0)
    if not ok:
        return False, reason
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return False, f"CUDA device {dev.index} does not exist ({torch.cuda.device_count()} visible)"
    major, _ = torch.cuda.get_device_capability(dev)
    if major < 8:
        return False, f"needs CUDA SM80+, {dev} is SM{major}x"
    return True, ""


def require_available(device: torch.device) -> None:
    ok, reason = availability(device)
    if not ok:
        raise RuntimeError(f"the Triton DSA kernels cannot run on {device}: {reason}")


#: ``(exception type, message)``: why a kernel cannot take a call, raised as is when the kernel was asked for.
Unfit = tuple[type[Exception], str]


def sparse_mla_unfit(dtype: torch.dtype, num_heads: int, d_qk: int, d_v: int) -> Unfit | None:
    """Why the sparse MLA kernels cannot take ``q: [T, num_heads, d_qk]`` of ``dtype`` with value width ``d_v``.

    ``None`` when they can. The one statement of the kernels' static constraints: :func:`sparse_mla_triton`
    raises it, ``backend="auto"`` of :mod:`longtrain.dsa.ops` moves to the next route.
    """
    if dtype not in TRITON_DTYPES:
        return TypeError, f"the Triton DSA kernels take bf16, fp16 or fp32 tensors, got {dtype}"
    if d_qk % 16 or d_qk > _MAX_D:
        return ValueError, f"D_qk must be a multiple of 16 up to {_MAX_D} (576 or 512 for MLA), got {d_qk}"
    if not isinstance(d_v, int) or isinstance(d_v, bool) or d_v < 16 or d_v > d_qk or d_v % 16:
        return ValueError, f"d_v must be a multiple of 16 in [16, D_qk={d_qk}], got {d_v!r}"
    if d_qk - d_v > 256:
        return ValueError, f"the key-only tail D_qk - d_v must be <= 256 (64 for MLA rope), got {d_qk - d_v}"
    if num_heads < 1:
        return ValueError, "q needs at least one head"
    return None


def indexer_unfit(dtype: torch.dtype, key_dtype: torch.dtype, num_heads: int, head_dim: int) -> Unfit | None:
    """Why the fused indexer cannot take ``index_q: [T_q, num_heads, head_dim]`` of ``dtype`` with keys of
    ``key_dtype`` (``None`` when it can); the kernels' static constraints, stated once (as :func:`sparse_mla_unfit`)."""
    if dtype not in TRITON_DTYPES:
        return TypeError, f"the Triton DSA kernels take bf16, fp16 or fp32 tensors, got {dtype}"
    if key_dtype != dtype:
        return TypeError, f"index_q and index_k must share a dtype, got {dtype} and {key_dtype}"
    if head_dim < 16 or head_dim > 256:
        return ValueError, f"D_I must be in [16, 256] (128 for GLM-5.2), got {head_dim}"
    if num_heads < 1:
        return ValueError, "index_q needs at least one indexer head"
    return None


_FP8_UNFIT: dict[str, Unfit | None] = {}


def indexer_fp8_unfit(device: torch.device) -> Unfit | None:
    """Why the FP8 indexer scores cannot run on ``device`` (``None`` when they can; cached per device).

    FP8 tensor-core products need CUDA SM89+ (Ada, Hopper and later); CPU tensors run under the interpreter.
    """
    key = str(device)
    if key not in _FP8_UNFIT:
        unfit = None
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                unfit = (
                    RuntimeError,
                    f"FP8 indexer scores need FP8 tensor cores (CUDA SM89+); {device} is SM{major}{minor}: "
                    "use fp8=False there",
                )
        _FP8_UNFIT[key] = unfit
    return _FP8_UNFIT[key]
