"""Helpers shared by every prewarm: the logger, optional imports, device resolution, RNG fork, dtype discovery.

Late binding: every prewarm function that calls another documented name (a worker, ``safe_import``,
``safe_import_from``, ``_resolve_cuda_device``, ``_triton_kernel_accepts``, a shape collector) looks it up on
the package ``longtrain.prewarm`` at call time through :func:`_pkg`, so ``monkeypatch.setattr(longtrain.prewarm,
name, fake)`` reaches every caller.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger("longtrain.prewarm")

_PACKAGE = __name__.rpartition(".")[0]


def _pkg() -> Any:
    """The package module ``longtrain.prewarm``: the one namespace that tests patch and callers read."""
    return sys.modules[_PACKAGE]


def _log() -> logging.Logger:
    return _pkg().logger


# ----------------------------------------------------------------------------------------------------------
# Notes for the report: workers annotate the step that is running (a no-op outside ``run_prewarms``).

_CURRENT_NOTES: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "longtrain_prewarm_notes", default=None
)


@contextlib.contextmanager
def _collect_notes() -> Iterator[dict[str, Any]]:
    notes: dict[str, Any] = {"reason": None, "shapes": [], "errors": 0, "failure": None}
    token = _CURRENT_NOTES.set(notes)
    try:
        yield notes
    finally:
        _CURRENT_NOTES.reset(token)


def _note_skip(reason: str) -> None:
    """Record why the running prewarm did nothing (the last reason given wins: the outermost skip)."""
    notes = _CURRENT_NOTES.get()
    if notes is not None:
        notes["reason"] = reason


def _note_error() -> None:
    """Count a caught per-item failure (a shape, mode or kernel) of the running prewarm."""
    notes = _CURRENT_NOTES.get()
    if notes is not None:
        notes["errors"] += 1


def _log_failure(message: str, *args: Any) -> None:
    """Log a caught failure at ERROR with its traceback and count it for the report (inside ``except`` only)."""
    _log().exception(message, *args)
    _note_error()
    exc = sys.exc_info()[1]
    notes = _CURRENT_NOTES.get()
    if notes is not None and exc is not None:
        notes["failure"] = f"{type(exc).__name__}: {exc}"


def _note_shapes(shapes: list[str]) -> None:
    notes = _CURRENT_NOTES.get()
    if notes is not None:
        notes["shapes"].extend(shapes)


def _skip(message: str, *args: Any) -> None:
    """Log a skip at INFO (skips are not errors) and remember it as the step's reason."""
    _log().info(message, *args)
    _note_skip(message % args if args else message)


# ----------------------------------------------------------------------------------------------------------
# Optional imports.


class _Unavailable:
    """Placeholder for a module or symbol that could not be imported; any use raises with the reason."""

    def __init__(self, what: str, reason: str):
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_reason", reason)

    def __getattr__(self, name: str) -> Any:
        raise ImportError(f"{self._what} is unavailable ({self._reason})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._what} is unavailable ({self._reason})")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<unavailable {self._what}: {self._reason}>"


def safe_import(name: str) -> tuple[bool, Any]:
    """``(True, module)``, or ``(False, placeholder)`` when importing raises ``ImportError``.

    Any other exception (a RuntimeError from CUDA/Triton initialisation, an OSError from a broken shared
    library) propagates: that is a broken install, not a missing one, and the caller's top-level handler logs it.
    """
    try:
        return True, importlib.import_module(name)
    except ImportError as exc:
        _log().debug("Optional module %s is not importable: %s", name, exc)
        return False, _Unavailable(name, f"{type(exc).__name__}: {exc}")


def safe_import_from(module: str, symbol: str) -> tuple[bool, Any]:
    """``(True, module.symbol)``, or ``(False, placeholder)`` when the module or the symbol is missing."""
    ok, mod = safe_import(module)
    if not ok:
        return False, mod
    try:
        return True, getattr(mod, symbol)
    except AttributeError as exc:
        _log().info("%s has no attribute %s (installed version differs): %s", module, symbol, exc)
        return False, _Unavailable(f"{module}.{symbol}", "symbol not found")


# ----------------------------------------------------------------------------------------------------------
# Devices and RNG.


def _normalize_device(device: torch.device | int | str) -> torch.device:
    """An int ``n`` means ``cuda:n``; anything else goes through ``torch.device`` (a bad string raises)."""
    if isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, int, str or None, got bool {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _resolve_cuda_device(device: torch.device | int | str | None, label: str) -> torch.device | None:
    """The CUDA device a warmup should run on, or None (logged at INFO) when there is none.

    An index-less ``"cuda"`` resolves to the current device before ``torch.cuda.set_device`` (which would
    reject it). Side effect: the resolved device becomes the process's current CUDA device, which Triton
    launches need and which a training rank has set anyway.
    """
    if device is None:
        _skip("Skipping %s prewarm: no device assigned.", label)
        return None
    dev = _normalize_device(device)
    cuda_available = torch.cuda.is_available()
    if not cuda_available or dev.type != "cuda":
        _skip("Skipping %s prewarm: device=%s cuda_available=%s", label, dev, cuda_available)
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    return dev


def _rng_devices(device: torch.device) -> list[int]:
    """CUDA device indices whose generator a warmup on ``device`` may draw from ([] for CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def _rng_neutral(device: torch.device | None) -> Iterator[None]:
    """Save and restore the CPU generator and the target CUDA device's generator, also on an exception."""
    devices = _rng_devices(device) if device is not None else []
    with torch.random.fork_rng(devices=devices):
        yield


def _release(device: torch.device) -> None:
    """Return a CUDA warmup's transient blocks to the driver; never touches CUDA for a CPU device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------
# Module discovery with the compute dtype the kernels will see.

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fsdp_param_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The FSDP2 mixed-precision ``param_dtype`` of a ``fully_shard``-ed module, or None."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    try:
        dtype = get_state()._mp_policy.param_dtype
    except Exception:  # private FSDP2 internals: no policy readable means "no override"
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


def _float_param_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the module's largest fp16/bf16/fp32 parameter (the first one on ties).

    Not simply the first: a GDN or Mamba layer registers its own small fp32 parameters (``A_log``,
    ``dt_bias``, ``D``) before its submodules' projection weights, whose dtype is what the kernels see.
    """
    best: torch.nn.Parameter | None = None
    for param in module.parameters(recurse=True):
        if param.dtype in _FLOAT_DTYPES and (best is None or param.numel() > best.numel()):
            best = param
    return None if best is None else best.dtype


def _named_modules_with_dtype(part: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, torch.dtype]]:
    """``(name, module, compute dtype)`` for every module of ``part`` in pre-order (root included as ``""``).

    The compute dtype is, in order: an explicit ``prewarm_dtype`` attribute on the module (for autocast
    training, where stored parameters are fp32 but the kernels see bf16); the FSDP2 mixed-precision
    ``param_dtype`` of the module or its nearest ``fully_shard``-ed ancestor (the stored sharded parameters
    keep the master dtype); the dtype of the module's largest fp16/bf16/fp32 parameter; else bfloat16.
    """
    fsdp_dtypes: dict[str, torch.dtype] = {}
    for name, module in part.named_modules():
        mp = _fsdp_param_dtype(module)
        if mp is not None:
            fsdp_dtypes[name] = mp
        explicit = getattr(module, "prewarm_dtype", None)
        if isinstance(explicit, torch.dtype):
            yield name, module, explicit
            continue
        inherited = None
        prefix = name
        while True:
            if prefix in fsdp_dtypes:
                inherited = fsdp_dtypes[prefix]
                break
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        dtype = inherited or _float_param_dtype(module) or torch.bfloat16
        yield name, module, dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _shape_key(shape: Any, keys: tuple[str, ...], method: str, name: str) -> tuple:
    """Validate the dict a module's ``<method>()`` returned: exactly ``keys``, positive ints then a ``dtype``.

    Returns the values as a tuple in ``keys`` order (a dedup key). Raises ``TypeError``/``ValueError`` naming
    the module ``name``.
    """
    where = f"{name}.{method}()"
    if not isinstance(shape, dict):
        raise TypeError(f"{where} must return a dict, got {type(shape).__name__}")
    missing = [k for k in keys if k not in shape]
    extra = sorted(set(shape) - set(keys))
    if missing or extra:
        raise ValueError(f"{where} must return exactly the keys {list(keys)}; missing {missing}, unexpected {extra}")
    dtype = shape[keys[-1]]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}[{keys[-1]!r}] must be a torch.dtype, got {dtype!r}")
    ints = []
    for k in keys[:-1]:
        value = shape[k]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}[{k!r}] must be a positive int, got {value!r}")
        ints.append(value)
    return (*ints, dtype)


def _collect_shapes(model_parts: list[torch.nn.Module], method: str, keys: tuple[str, ...]) -> dict[tuple, str]:
    """``shape tuple -> first module name`` for every module exposing a callable ``<method>()``, deduplicated, in
    discovery order; a malformed shape dict raises ``TypeError``/``ValueError`` naming the module."""
    shapes: dict[tuple, str] = {}
    for part in model_parts:
        for name, module in part.named_modules():
            fn = getattr(module, method, None)
            if callable(fn):
                shapes.setdefault(_shape_key(fn(), keys, method, name or "<root>"), name)
    return shapes


def _warm_each_shape(
    dev: torch.device, shapes: dict[tuple, str], keys: tuple[str, ...], warmup: Any, what: str, kernels: str
) -> bool:
    """Call ``warmup(**shape, device=dev)`` once per shape, RNG-neutral, each failure logged and isolated.

    ``what`` names the prewarm in the failure / finish lines, ``kernels`` what is being warmed. Returns True if
    at least one shape ran.
    """
    _note_shapes([" ".join(f"{k}={v}" for k, v in zip(keys, key)) + f" ({n or '<root>'})" for key, n in shapes.items()])
    ran = False
    with _rng_neutral(dev):
        for key, name in shapes.items():
            kwargs = dict(zip(keys, key))
            _log().info("Prewarming %s | module=%s %s", kernels, name, kwargs)
            try:
                result = warmup(**kwargs, device=dev)
                _log().info("%s warmed: %s", kernels, result)
                ran = True
            except Exception:
                _log_failure("%s prewarm failed for %s; continuing.", what, name)
            finally:
                _release(dev)
    _log().info("Finished %s prewarm.", what)
    return ran


def _device_and_shapes(
    device: Any, what: str, collect: str, model_parts: list, missing: str, warning: str
) -> tuple[Any, Any]:
    """The preamble of every shape-driven worker: the CUDA device (``_resolve_cuda_device``) and the shapes the
    package's ``collect`` function finds in ``model_parts``. ``(None, None)`` when there is no CUDA device, or no
    shape (then ``warning`` is logged and ``missing`` noted as the skip reason)."""
    pkg = _pkg()
    dev = pkg._resolve_cuda_device(device, what)
    if dev is None:
        return None, None
    shapes = getattr(pkg, collect)(model_parts)
    if not shapes:
        _log().warning(warning)
        _note_skip(missing)
        return None, None
    return dev, shapes
