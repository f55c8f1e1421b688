"""Runtime knobs and the per-step state of block-diagonal context parallelism.

Two process-wide knobs choose how block-diagonal attention runs: the varlen attention backend (``auto``,
``cudnn``, ``fa4``, ``flash``, ``te``, ``flex``, ``reference`` or ``dense``) and the K/V exchange (``allgather``,
``halo`` or ``a2a``). ``configure_cp_varlen`` sets them; every :class:`~longtrain.blockdiag_cp.step.CPStep`
snapshots them when it is built.

The active step lives in a :class:`ThreadSharedVar`, not a ``ContextVar``: autograd runs activation-checkpoint
recompute on its own worker thread, where a ``ContextVar`` would read its default and the recomputed attention
would silently run local-only. The slot only lets the SDPA drop-in find the step; everything else takes the step
as an argument.

This module imports nothing else from the package at import time (the registry and ``kernels`` are imported
lazily by ``configure_cp_varlen``), so every other module can import it without cycles.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ATTN_BACKEND_AUTO",
    "ATTN_BACKEND_CUDNN",
    "ATTN_BACKEND_DEFAULT",
    "ATTN_BACKEND_DENSE",
    "ATTN_BACKEND_CUDNN_FA4",
    "ATTN_BACKEND_FA4",
    "ATTN_BACKEND_FA4_CUDNN",
    "ATTN_BACKEND_FLASH",
    "ATTN_BACKEND_FLEX",
    "ATTN_BACKEND_REFERENCE",
    "ATTN_BACKEND_SYNONYMS",
    "ATTN_BACKEND_TE",
    "ATTN_BACKEND_VALUES",
    "KV_EXCHANGE_A2A",
    "KV_EXCHANGE_ALLGATHER",
    "KV_EXCHANGE_DEFAULT",
    "KV_EXCHANGE_HALO",
    "KV_EXCHANGE_SYNONYMS",
    "KV_EXCHANGE_VALUES",
    "VARLEN_ATTN_BACKENDS",
    "LAST_EXITED_SLOT",
    "STEP_SLOT",
    "BlockdiagCpModelState",
    "ThreadSharedVar",
    "configure_cp_varlen",
    "count_cp_attn_call",
    "cp_attn_fire_count",
    "cp_varlen_runtime_config",
    "current_blockdiag_cp_state",
    "normalize_attn_backend",
    "normalize_kv_exchange",
    "require_provided",
    "reset_cp_attn_fire_count",
    "step_timeout_s",
    "nonfinite_mode",
    "shard_chunk",
    "sharding_mode",
    "NONFINITE_ISOLATE",
    "NONFINITE_MODES",
    "NONFINITE_PROPAGATE",
]

ATTN_BACKEND_AUTO = "auto"
ATTN_BACKEND_FLASH = "flash"
ATTN_BACKEND_TE = "te"
ATTN_BACKEND_CUDNN = "cudnn"
ATTN_BACKEND_FA4 = "fa4"
# Split providers: the first name's forward, the second's backward.
ATTN_BACKEND_CUDNN_FA4 = "cudnn_fa4"
ATTN_BACKEND_FA4_CUDNN = "fa4_cudnn"
ATTN_BACKEND_FLEX = "flex"
ATTN_BACKEND_REFERENCE = "reference"
ATTN_BACKEND_DENSE = "dense"

KV_EXCHANGE_ALLGATHER = "allgather"
KV_EXCHANGE_HALO = "halo"
KV_EXCHANGE_A2A = "a2a"

# Canonical name -> accepted spellings (after cleaning: stripped, lower-cased, '-' -> '_'). Every canonical
# name is a synonym of itself. The key order is the canonical order used by docs and config schemas.
ATTN_BACKEND_SYNONYMS: dict[str, tuple[str, ...]] = {
    ATTN_BACKEND_AUTO: ("auto", "default", "fastest"),
    ATTN_BACKEND_FLASH: ("flash", "flash_attn", "flash_attention", "flash_attention_2", "fa2", "fa"),
    ATTN_BACKEND_TE: ("te", "transformer_engine", "transformerengine"),
    ATTN_BACKEND_CUDNN: ("cudnn", "cudnn_sdpa", "cudnn_attention", "cudnn_frontend"),
    ATTN_BACKEND_FA4: ("fa4", "flash_attn_4", "flash_attention_4", "flash4", "flash_attn_cute"),
    ATTN_BACKEND_CUDNN_FA4: ("cudnn_fa4", "cudnn+fa4"),
    ATTN_BACKEND_FA4_CUDNN: ("fa4_cudnn", "fa4+cudnn"),
    ATTN_BACKEND_FLEX: ("flex", "flex_attention", "flexattention"),
    ATTN_BACKEND_REFERENCE: ("reference", "ref", "torch_reference", "torch_ref", "per_document_sdpa"),
    ATTN_BACKEND_DENSE: ("dense", "sdpa", "torch_sdpa", "masked_sdpa"),
}
KV_EXCHANGE_SYNONYMS: dict[str, tuple[str, ...]] = {
    KV_EXCHANGE_ALLGATHER: ("allgather", "all_gather"),
    KV_EXCHANGE_HALO: ("halo", "neighbor", "neighbour", "needed", "needed_only"),
    KV_EXCHANGE_A2A: ("a2a", "a2av", "all_to_all", "alltoall", "all_to_all_v", "needed_a2a"),
}

ATTN_BACKEND_VALUES: tuple[str, ...] = tuple(ATTN_BACKEND_SYNONYMS)
KV_EXCHANGE_VALUES: tuple[str, ...] = tuple(KV_EXCHANGE_SYNONYMS)
# The backends that run a varlen kernel (everything but "dense"; "auto" resolves to one of them or dense).
VARLEN_ATTN_BACKENDS: tuple[str, ...] = (
    ATTN_BACKEND_FLASH,
    ATTN_BACKEND_TE,
    ATTN_BACKEND_CUDNN,
    ATTN_BACKEND_FA4,
    ATTN_BACKEND_CUDNN_FA4,
    ATTN_BACKEND_FA4_CUDNN,
    ATTN_BACKEND_FLEX,
    ATTN_BACKEND_REFERENCE,
)

# Deliberate deviation from the kernel page's "flash": "auto" picks the fastest backend available for the
# call's dtype, device and layout (cudnn or fa4 on an H200 with bf16, the per-document torch reference on CPU).
ATTN_BACKEND_DEFAULT = ATTN_BACKEND_AUTO
KV_EXCHANGE_DEFAULT = KV_EXCHANGE_ALLGATHER

_ATTN_BACKEND_BY_SYNONYM = {syn: canon for canon, syns in ATTN_BACKEND_SYNONYMS.items() for syn in syns}
_KV_EXCHANGE_BY_SYNONYM = {syn: canon for canon, syns in KV_EXCHANGE_SYNONYMS.items() for syn in syns}
_DEFAULT_SPELLINGS = ("", "auto", "default")


def _clean(value: object) -> str:
    return str(value).strip().lower().replace("-", "_")


def _normalize(value: object, by_synonym: dict[str, str], values: tuple[str, ...], default: str, what: str) -> str:
    if value is None:
        return default
    cleaned = _clean(value)
    if cleaned in _DEFAULT_SPELLINGS:
        return default
    canon = by_synonym.get(cleaned)
    if canon is None:
        synonyms = ", ".join(sorted(set(by_synonym) - set(values)))
        raise ValueError(
            f"Unsupported block-diagonal CP {what} {value!r}; expected one of {', '.join(values)} "
            f"(or a synonym: {synonyms})"
        )
    return canon


def normalize_attn_backend(value: object) -> str:
    """Canonical attention-backend name for ``value`` (a synonym, any case, '-' or '_').

    ``None``, ``""``, ``"auto"`` and ``"default"`` give :data:`ATTN_BACKEND_DEFAULT` (``"auto"``).
    Raises ``ValueError`` listing the valid names for anything else.
    """
    return _normalize(value, _ATTN_BACKEND_BY_SYNONYM, ATTN_BACKEND_VALUES, ATTN_BACKEND_DEFAULT, "attention backend")


def normalize_kv_exchange(value: object) -> str:
    """Canonical K/V-exchange name for ``value``; ``None``/``""``/``"auto"``/``"default"`` give ``"allgather"``.

    Raises ``ValueError`` listing the valid names for anything else.
    """
    return _normalize(value, _KV_EXCHANGE_BY_SYNONYM, KV_EXCHANGE_VALUES, KV_EXCHANGE_DEFAULT, "kv_exchange")


_ATTN_BACKEND: str = ATTN_BACKEND_DEFAULT
_KV_EXCHANGE: str = KV_EXCHANGE_DEFAULT
#: Knobs beyond the two documented ones, with their defaults; they appear in :func:`cp_varlen_runtime_config`
#: only while they differ from the default, so the documented two-key dict is what a default setup reports.
NONFINITE_ISOLATE, NONFINITE_PROPAGATE = "isolate", "propagate"
NONFINITE_MODES = (NONFINITE_ISOLATE, NONFINITE_PROPAGATE)
EXTRA_KNOB_DEFAULTS: dict[str, Any] = {
    "step_timeout_s": None,
    "nonfinite": NONFINITE_ISOLATE,
    "sharding": "contiguous",
    "shard_chunk": 128,
}
_EXTRA: dict[str, Any] = dict(EXTRA_KNOB_DEFAULTS)


def cp_varlen_runtime_config() -> dict[str, Any]:
    """The current knobs as ``{"attn_backend": ..., "kv_exchange": ...}`` (canonical names), plus every other knob
    (``step_timeout_s``, ``nonfinite``, ``sharding``, ``shard_chunk``) whose value is not its default;
    ``configure_cp_varlen(**this)`` restores them all."""
    extra = {k: v for k, v in _EXTRA.items() if v != EXTRA_KNOB_DEFAULTS[k]}
    return {"attn_backend": _ATTN_BACKEND, "kv_exchange": _KV_EXCHANGE, **extra}


def sharding_mode() -> str:
    """``"contiguous"`` (default) or ``"balanced"``: see :func:`configure_cp_varlen`."""
    return _EXTRA["sharding"]


def shard_chunk() -> int:
    """The smallest piece (tokens) a balanced plan cuts a document into."""
    return _EXTRA["shard_chunk"]


def nonfinite_mode() -> str:
    """``"isolate"`` (default) or ``"propagate"``: see :func:`configure_cp_varlen`."""
    return _EXTRA["nonfinite"]


def step_timeout_s() -> float | None:
    """The bound on a step's own consensus exchange (None: the process group store's timeout)."""
    return _EXTRA["step_timeout_s"]


def _check_timeout(value: Any) -> float | None:
    if value is None:
        return None
    try:  # float(): an int past the float range (10**400) raised OverflowError here
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and float(value) > 0
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"step_timeout_s must be a positive number of seconds or None, got {value!r}")
    return float(value)


def configure_cp_varlen(
    *,
    attn_backend: str | None = ATTN_BACKEND_DEFAULT,
    kv_exchange: str | None = KV_EXCHANGE_DEFAULT,
    step_timeout_s: float | None = None,
    nonfinite: str = NONFINITE_ISOLATE,
    sharding: str = "contiguous",
    shard_chunk: int = 128,
) -> dict[str, Any]:
    """Set the process-wide knobs used by the next CP steps.

    ``attn_backend`` and ``kv_exchange`` (any synonym), and ``step_timeout_s``: the bound, in seconds, on the step's
    once-per-step consensus (past it every waiting rank raises ``CPTimeoutError`` naming the ranks that did not
    arrive; None: the process group store's timeout). ``nonfinite``: ``"isolate"`` (default) keeps a NaN or inf of
    one document out of every other document on every provider: a provider whose kernel lets a masked-out non-finite
    value through (cudnn's CuTe route, fa4, the split providers, flex) runs on inputs with those elements zeroed and
    the rows that attended them come out NaN; ``"propagate"`` skips that pass (faster: its cost per provider is in
    ``benchmarks/results/guarantee_cost_2026-12-01.md``) and lets such a value reach the neighbouring document on
    those providers. ``sharding``: which positions of the row each rank owns, ``"contiguous"`` (default:
    ``[r L, (r+1) L)``) or ``"balanced"`` (equal causal work, :func:`~longtrain.blockdiag_cp.plan_cp_shards`), with
    ``shard_chunk`` its smallest piece. Every value is validated before anything changes, so an invalid value leaves
    the knobs untouched. Returns the previous settings:
    ``configure_cp_varlen(**previous)`` restores them exactly. A step already built keeps the snapshot taken when it
    was built. Every call sets every knob (one it does not name takes its default, as in the documented module); to
    change one and keep the others: ``configure_cp_varlen(**{**cp_varlen_runtime_config(), "kv_exchange": ...})``.
    """
    global _ATTN_BACKEND, _KV_EXCHANGE
    backend = require_provided(normalize_attn_backend(attn_backend))
    exchange = normalize_kv_exchange(kv_exchange)
    timeout = _check_timeout(step_timeout_s)
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    from .sharding import SHARDING_MODES

    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}")
    if isinstance(shard_chunk, bool) or not isinstance(shard_chunk, int) or shard_chunk < 1:
        raise ValueError(f"shard_chunk must be a positive int (tokens), got {shard_chunk!r}")
    previous = cp_varlen_runtime_config()
    _EXTRA["step_timeout_s"] = timeout
    _EXTRA["nonfinite"] = nonfinite
    _EXTRA["sharding"], _EXTRA["shard_chunk"] = sharding, shard_chunk
    if (backend, exchange) != (_ATTN_BACKEND, _KV_EXCHANGE):
        _ATTN_BACKEND, _KV_EXCHANGE = backend, exchange
        # Re-arm the one-time "varlen engaged" / "path" logs so the new configuration announces itself.
        kernels = importlib.import_module(f"{__package__}.kernels")
        if hasattr(kernels, "_CP_FLASH_ENGAGED"):
            kernels._CP_FLASH_ENGAGED = False
        importlib.import_module(f"{__package__}.runtime").reset_logs()
    return previous


def require_provided(backend: str) -> str:
    """``backend`` (canonical) if the provider registry holds it, else a ``ValueError`` naming the ones it does."""
    if backend == ATTN_BACKEND_AUTO:
        return backend
    provided = importlib.import_module(f"{__package__}.providers").PROVIDERS
    if backend not in provided:
        raise ValueError(
            f"block-diagonal CP attention backend {backend!r} is a known name but longtrain.blockdiag_cp.providers "
            f"does not provide it; choose one of {', '.join((ATTN_BACKEND_AUTO, *provided))}"
        )
    return backend


@dataclass(frozen=True)
class BlockdiagCpModelState:
    """The typed view of a CP step that model layers (e.g. linear-attention CP paths) read.

    ``group``: the CP process group. ``packed_cu_seqlens``: ``[n_runs+1] int64`` document-run boundaries of the
    flattened padded row on the compute device (the padding tail is its own run). ``packed_cu_seqlens_cpu``:
    the same on the host, copied once per step.
    """

    group: Any
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor


class ThreadSharedVar:
    """A ContextVar-like slot holding one value for the whole process, visible from every thread.

    ``set`` returns the previous value as the token and ``reset(token)`` restores it, so nesting works.
    Not safe for concurrent writers: steps run one after another and backward only reads.
    """

    __slots__ = ("_name", "_value")

    def __init__(self, name: str):
        self._name = name
        self._value: Any = None

    def get(self) -> Any:
        return self._value

    def set(self, value: Any) -> Any:
        token = self._value
        self._value = value
        return token

    def reset(self, token: Any) -> None:
        self._value = token

    def __repr__(self) -> str:
        return f"ThreadSharedVar({self._name!r}, set={self._value is not None})"


_ThreadSharedVar = ThreadSharedVar  # the reference note's name
#: The active CPStep (published by the batch builder's step context for ``cp_blockdiag_sdpa``).
STEP_SLOT = _CP_BLOCKDIAG_STATE = ThreadSharedVar("cp_blockdiag_state")
_CP_ATTN_FIRE_COUNT = [0]
#: Set when a step context exited after CP attention ran with grad enabled; turns an activation-checkpoint
#: recompute that runs after the context exited into a clear error (see runtime).
LAST_EXITED_SLOT = _CP_LAST_EXITED_STATE = ThreadSharedVar("cp_blockdiag_last_exited_state")


def current_blockdiag_cp_state() -> BlockdiagCpModelState | None:
    """The active step's :class:`BlockdiagCpModelState`, or None outside a CP context.

    Also None for a hand-built step state dict that carries no ``model_state``.
    """
    step = _CP_BLOCKDIAG_STATE.get()
    if step is None:
        return None
    model_state = step.get("model_state") if isinstance(step, dict) else getattr(step, "model_state", None)
    return model_state if isinstance(model_state, BlockdiagCpModelState) else None


def count_cp_attn_call() -> None:
    """Count one CP-path attention call (the runtime calls this; forward and recompute)."""
    _CP_ATTN_FIRE_COUNT[0] += 1


def reset_cp_attn_fire_count() -> None:
    """Zero the counter of CP-path attention calls (forward and recompute)."""
    _CP_ATTN_FIRE_COUNT[0] = 0


def cp_attn_fire_count() -> int:
    """How many times ``cp_blockdiag_sdpa`` took the CP path since the last reset (lets a recipe fail loud
    when CP is on but attention never went through it)."""
    return _CP_ATTN_FIRE_COUNT[0]
