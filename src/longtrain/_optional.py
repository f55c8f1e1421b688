"""Lazy, cached probes for optional packages and hardware.

Every probe returns ``(available, reason)``: ``(True, "")`` when the thing can be used, otherwise
``(False, "<why not, and how to get it>")``. Nothing here runs at ``import longtrain``: a probe runs the
first time it is called and its answer is cached for the life of the process (``reset_probe_cache()``
clears it, for tests that fake a package). Probes never raise and never initialise CUDA unless the
probe is about CUDA itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

__all__ = [
    "CUDNN_DSA_SYMBOLS",
    "Probe",
    "cuda_sm",
    "fa4",
    "cudnn_dsa",
    "cudnn_cute",
    "cudnn_frontend",
    "fla",
    "flash_attn",
    "flash_attn_varlen",
    "flash_mla",
    "mamba_ssm",
    "reset_probe_cache",
    "torch_cuda",
    "torch_varlen",
    "transformer_engine",
    "triton",
    "triton_interpret",
    "package_table",
]

Probe = tuple[bool, str]
_OK: Probe = (True, "")


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import(module: str, attr: str | None, install: str) -> Probe:
    """Import ``module`` (and look up ``attr``) and turn any failure into a reason."""
    top = module.split(".")[0]
    if not _spec(top):
        return False, f"{top} not installed (pip install {install})"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything: report, never propagate
        return False, f"{module} failed to import: {type(exc).__name__}: {str(exc)[:160]}"
    if attr is not None and not hasattr(mod, attr):
        return False, f"{module}.{attr} not found (the installed {top} is too old or too new)"
    return _OK


@functools.cache
def torch_cuda() -> Probe:
    """CUDA is usable by torch (a build with CUDA and at least one visible device)."""
    import torch

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device visible"
    except Exception as exc:
        return False, f"CUDA initialisation failed: {exc}"
    return _OK


@functools.cache
def cuda_sm(min_major: int, min_minor: int = 0) -> Probe:
    """The current CUDA device has compute capability at least ``min_major.min_minor``."""
    ok, reason = torch_cuda()
    if not ok:
        return False, f"needs CUDA SM{min_major}{min_minor}+ ({reason})"
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (min_major, min_minor):
        return False, f"needs CUDA SM{min_major}{min_minor}+, found SM{major}{minor}"
    return _OK


@functools.cache
def triton() -> Probe:
    """Triton is importable (needed for our GPU kernels and, with TRITON_INTERPRET=1, on CPU)."""
    return _import("triton", "jit", "triton")


def triton_interpret() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1``). Not cached: tests flip it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def flash_attn() -> Probe:
    """The flash-attn package with its varlen entry point."""
    return _import("flash_attn", "flash_attn_varlen_func", "flash-attn --no-build-isolation")


flash_attn_varlen = flash_attn


@functools.cache
def fa4() -> Probe:
    """FlashAttention-4 (``flash_attn.cute``, the flash-attn-4 package: CuTe DSL kernels for SM90/SM100)."""
    ok, reason = _import("flash_attn.cute", "flash_attn_varlen_func", "flash-attn-4")
    if not ok and "not installed" in reason:
        return False, "flash_attn.cute not installed (pip install flash-attn-4)"
    return ok, reason


@functools.cache
def torch_varlen() -> Probe:
    """torch's bundled FlashAttention-2 varlen op (``aten._flash_attention_forward``), usable on CUDA SM80+."""
    import torch

    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False, f"torch {torch.__version__} has no aten._flash_attention_forward"
    ok, reason = cuda_sm(8, 0)
    if not ok:
        return False, reason
    if not torch.backends.cuda.is_flash_attention_available():
        return False, "this torch build ships without FlashAttention kernels"
    return _OK


@functools.cache
def transformer_engine() -> Probe:
    """TransformerEngine with its PyTorch extension."""
    return _import("transformer_engine.pytorch", "DotProductAttention", "transformer-engine[pytorch]")


@functools.cache
def cudnn_frontend() -> Probe:
    """The cuDNN frontend Python package (``import cudnn``)."""
    return _import("cudnn", None, "nvidia-cudnn-frontend")


# The cudnn.DSA functions longtrain.dsa.cudnn_dsa calls: the probe imports each of them.
CUDNN_DSA_SYMBOLS = ("indexer_top_k_wrapper", "indexer_forward_wrapper", "sparse_attention_backward_wrapper")


@functools.cache
def cudnn_dsa() -> Probe:
    """The cuDNN frontend DSA namespace (``from cudnn import DSA``), which needs the cutedsl extra."""
    ok, reason = cudnn_frontend()
    if not ok:
        return False, reason
    try:
        import cudnn

        dsa = cudnn.DSA
        # The namespace is lazy (frontend 1.32: an object whose __getattr__ imports a symbol's module on first use),
        # so only the symbols we call prove that their CuTe DSL kernels import. Without the cutedsl extra the
        # namespace itself resolves and these raise ModuleNotFoundError ('cutlass.cute').
        for name in CUDNN_DSA_SYMBOLS:
            getattr(dsa, name)
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc)[:120]}"
        return False, f"cudnn.DSA unavailable ({why}); pip install 'nvidia-cudnn-frontend[cutedsl]'"
    return _OK


@functools.cache
def cudnn_cute() -> Probe:
    """The cuDNN frontend's CuTe DSL varlen attention (``cudnn.flex_attention``), which needs the cutedsl extra."""
    ok, reason = cudnn_frontend()
    if not ok:
        return False, reason
    ok, reason = _import("cudnn.flex_attention", "flex_attn_func", "nvidia-cudnn-frontend[cutedsl]")
    if not ok:
        return False, f"{reason}; pip install 'nvidia-cudnn-frontend[cutedsl]'"
    return _OK


@functools.cache
def flash_mla() -> Probe:
    """FlashMLA's sparse prefill kernel (``flash_mla.flash_mla_sparse_fwd``); built from source, no wheel."""
    return _import("flash_mla", "flash_mla_sparse_fwd", "FlashMLA from source (github.com/deepseek-ai/FlashMLA)")


@functools.cache
def fla() -> Probe:
    """flash-linear-attention (``fla``) with the gated delta rule."""
    return _import("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fla-core")


@functools.cache
def mamba_ssm() -> Probe:
    """mamba-ssm with the chunked SSD scan."""
    return _import("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba-ssm --no-build-isolation")


_ALL_PROBES = (
    torch_cuda,
    cuda_sm,
    triton,
    flash_attn,
    fa4,
    torch_varlen,
    transformer_engine,
    cudnn_frontend,
    cudnn_dsa,
    cudnn_cute,
    flash_mla,
    fla,
    mamba_ssm,
)


def reset_probe_cache() -> None:
    """Forget every cached probe answer (tests that install fake packages call this)."""
    for probe in _ALL_PROBES:
        probe.cache_clear()


def package_table() -> list[tuple[str, bool, str]]:
    """``(name, available, reason)`` for every optional dependency, for ``longtrain doctor``."""
    rows = [
        ("torch CUDA", *torch_cuda()),
        ("CUDA SM80+ (Ampere)", *cuda_sm(8, 0)),
        ("CUDA SM90+ (Hopper)", *cuda_sm(9, 0)),
        ("triton", *triton()),
        ("flash_attn", *flash_attn()),
        ("torch bundled FA2 varlen", *torch_varlen()),
        ("transformer_engine", *transformer_engine()),
        ("cudnn frontend", *cudnn_frontend()),
        ("cudnn frontend DSA", *cudnn_dsa()),
        ("cudnn frontend CuTe DSL attention", *cudnn_cute()),
        ("flash_attn.cute (FlashAttention-4)", *fa4()),
        ("flash_mla", *flash_mla()),
        ("fla (flash-linear-attention)", *fla()),
        ("mamba_ssm", *mamba_ssm()),
    ]
    return rows
