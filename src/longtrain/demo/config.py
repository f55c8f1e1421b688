"""``longtrain demo``'s options (:class:`DemoConfig`), how presets, ``--config`` files and flags combine into them
(:func:`make_config`), and the checks that run before any rank starts (:func:`check_environment`)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longtrain.demo.presets import PRESETS, default_preset

__all__ = [
    "DEMO_PREWARM",
    "DTYPES",
    "DemoConfig",
    "DemoConfigError",
    "build_model_config",
    "check_environment",
    "dtype_name",
    "make_config",
    "read_config_file",
    "resolve_device",
    "resolve_dtype",
]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

#: The prewarms the demo runs when its config has no ``prewarm:`` section.
DEMO_PREWARM = {
    "cublas_backward": True, "fla_gdn_autotune": True, "dsa_autotune": True, "blockdiag_autotune": True,
    "comm_groups": True,
}  # fmt: skip


class DemoConfigError(ValueError):
    """An impossible or unavailable demo option (reported to the user, exit code 2)."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any, kinds: type | tuple[type, ...] = (int, float)) -> bool:
    """``value`` is one of ``kinds`` and not a bool (YAML's ``true`` is an int to Python)."""
    return isinstance(value, kinds) and not isinstance(value, bool)


@dataclass(kw_only=True)
class DemoConfig:
    """Options of ``longtrain demo`` (also the keys of its ``--config`` YAML file).

    The defaults here are the ``tiny`` preset's; :func:`make_config` starts from the named (or default) preset
    instead and applies the keys given.
    """

    preset: str = "tiny"
    """Which entry of :data:`longtrain.demo.presets.PRESETS` gave the defaults."""
    steps: int = 200
    """Optimizer steps."""
    seq_len: int = 2048
    """Tokens per packed row (the global sequence, before sharding); divisible by 2 * cp."""
    cp: int = 2
    """Context-parallel ranks (processes)."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available)."""
    dtype: str = "auto"
    """``float32`` or ``bfloat16``; ``auto``: float32 on CPU, bfloat16 on CUDA."""
    attn_backend: str = "auto"
    """Varlen backend of the GQA layers (any name ``configure_cp_varlen`` accepts; ``dense``: one masked SDPA,
    the plain-PyTorch baseline)."""
    kv_exchange: str = "allgather"
    """K/V exchange of the GQA layers: ``allgather``, ``halo`` or ``a2a``."""
    sharding: str = "contiguous"
    """Which positions each CP rank owns: ``contiguous`` or ``balanced`` (equal causal work; the GQA and DSA layers
    attend from the rank's own rows, the GDN layers run on the whole row and keep each rank's rows)."""
    dsa_backend: str = "auto"
    """Backend of the DSA layers: ``auto``, ``triton``, ``cudnn`` or ``torch`` (the plain-PyTorch baseline)."""
    seed: int = 0
    """Seed of the model initialisation and of the data stream."""
    lr: float = 3e-3
    """AdamW learning rate (cosine decay to 10% after 10% warm-up)."""
    documents: str = "chapters"
    """What a corpus document is: ``chapters`` or ``books`` (:data:`longtrain.corpus.DOCUMENTS`)."""
    min_doc: int = 16
    """Shortest document span of a packed row, in tokens."""
    max_doc: int | None = None
    """Longest document span of a packed row (None: ``max(32, seq_len // 3)``)."""
    max_pad: int | None = None
    """Longest padding tail a row keeps; a longer gap takes a truncated span (None: up to a quarter of the row
    stays padding, as :class:`longtrain.corpus.PackedStream` does by default)."""
    out: str = "runs/demo"
    """Output folder: metrics.jsonl, loss_curve.png, summary.json."""
    model: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`longtrain.models.TinyLMConfig` (e.g. ``hidden_size``, ``layers``, ``dsa``)."""
    prewarm: dict[str, Any] | bool | None = None
    """The ``prewarm:`` section, read by :meth:`longtrain.prewarm.PrewarmConfig.from_dict` (``true`` is refused
    there and here); None: the demo's set (cuBLAS, fla GDN, DSA and block-diagonal autotune, comm groups);
    ``false`` (``--no-prewarm``): none."""
    parity: bool = True
    """Run the step-1 parity check against a single-rank run of the same row."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU (None: the documented bf16 dense peak of a known GPU, else n/a)."""
    progress: bool = True
    """Draw a progress bar on rank 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or self.preset not in PRESETS:
            raise DemoConfigError(f"--preset {self.preset!r}: unknown preset; valid presets: {', '.join(PRESETS)}")
        for name in ("steps", "seq_len", "cp"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise DemoConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.seq_len % (2 * self.cp):
            raise DemoConfigError(
                f"--seq-len {self.seq_len} is not divisible by 2 * cp = {2 * self.cp}: the demo's rows are split into "
                f"2 * cp equal chunks (both shardings); e.g. --seq-len {self.seq_len + (-self.seq_len) % (2 * self.cp)}"
            )
        if self.seq_len < 16:
            raise DemoConfigError(f"--seq-len must be at least 16, got {self.seq_len}")
        if self.sharding not in ("contiguous", "balanced"):
            raise DemoConfigError(f"--sharding must be contiguous or balanced, got {self.sharding!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise DemoConfigError(f"--device must be one of cpu, cuda, auto; got {self.device!r}")
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in DTYPES):
            raise DemoConfigError(f"--dtype must be one of auto, float32, bfloat16; got {self.dtype!r}")
        if not (_number(self.lr) and math.isfinite(self.lr) and self.lr > 0):
            raise DemoConfigError(f"--lr must be a positive number, got {self.lr!r}")
        from longtrain.corpus import DOCUMENTS, shortest_document

        if self.documents not in DOCUMENTS:
            raise DemoConfigError(f"--documents must be one of {', '.join(DOCUMENTS)}; got {self.documents!r}")
        if not _positive_int(self.min_doc) or self.min_doc < 2:
            raise DemoConfigError(f"min_doc must be an integer >= 2 (one input, one label), got {self.min_doc!r}")
        if self.min_doc > (shortest := shortest_document(self.documents)):
            raise DemoConfigError(
                f"min_doc={self.min_doc} is longer than the shortest {self.documents} document ({shortest} tokens), "
                f"and a span never exceeds its document: use min_doc <= {shortest}"
            )
        if self.max_doc is not None and (not _positive_int(self.max_doc) or self.max_doc < self.min_doc):
            raise DemoConfigError(f"max_doc must be null or an integer >= min_doc={self.min_doc}, got {self.max_doc!r}")
        if self.doc_span_max < self.min_doc:
            raise DemoConfigError(
                f"min_doc={self.min_doc} is longer than the longest document span, max_doc="
                f"{self.max_doc if self.max_doc is not None else f'max(32, seq_len // 3) = {self.doc_span_max}'}: "
                "lower min_doc, or raise max_doc or --seq-len"
            )
        if self.max_pad is not None and (not _number(self.max_pad, int) or self.max_pad < 0):
            raise DemoConfigError(f"max_pad must be null or an integer >= 0, got {self.max_pad!r}")
        if self.peak_tflops is not None and not (
            _number(self.peak_tflops) and math.isfinite(self.peak_tflops) and self.peak_tflops > 0
        ):
            raise DemoConfigError(f"--peak-tflops must be a positive number, got {self.peak_tflops!r}")
        if not isinstance(self.model, dict):
            raise DemoConfigError(f"model: must be a mapping of TinyLMConfig fields, got {type(self.model).__name__}")
        if not _number(self.seed, int) or self.seed < 0:
            raise DemoConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("parity", "progress"):  # a YAML string such as 'false' would read as true
            if not isinstance(getattr(self, name), bool):
                raise DemoConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.out, (str, os.PathLike)) or not str(self.out):
            raise DemoConfigError(f"--out must be a folder path, got {self.out!r}")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise DemoConfigError(f"--out {self.out}: exists and is not a folder; pick another output folder")

    @property
    def doc_span_max(self) -> int:
        """The longest document span of a row (``max_doc``, or its default)."""
        return self.max_doc if self.max_doc is not None else max(32, self.seq_len // 3)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> DemoConfig:
        """Read the YAML file (top-level keys are the fields of this class), apply ``overrides``, then the preset
        (:func:`make_config`)."""
        return make_config({**read_config_file(path), **overrides})


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The top-level mapping of a ``--config`` YAML file, its keys checked against :class:`DemoConfig`."""
    try:
        import yaml
    except ImportError:
        raise DemoConfigError(
            f"--config {path}: reading YAML needs pyyaml: pip install pyyaml (or pip install 'longtrain[demo]')"
        ) from None
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise DemoConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise DemoConfigError(f"--config {path}: is a folder; pass a YAML file") from None
    except OSError as exc:
        raise DemoConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise DemoConfigError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise DemoConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise DemoConfigError(f"--config {path}: expected a mapping at the top level, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(DemoConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DemoConfigError(f"--config {path}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return data


def _merge(base: Mapping[str, Any], extra: Any) -> Any:
    """``extra`` over ``base`` key by key (a nested mapping, e.g. ``model.dsa``, merged the same way)."""
    if not isinstance(extra, Mapping):
        return extra  # not a mapping: DemoConfig / TinyLMConfig say what is wrong with it
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), Mapping) else value
    return out


def make_config(explicit: Mapping[str, Any], *, cuda_available: bool | None = None) -> DemoConfig:
    """The demo config of ``explicit`` keys (a ``--config`` file's, then the flags') over their preset's defaults.

    The preset is ``explicit["preset"]``, else :func:`~longtrain.demo.presets.default_preset` of the device asked
    for (``cuda_available``: whether ``--device auto`` would find CUDA; None: ask torch). ``model:`` keys override
    the preset's one by one. An unknown preset is a :class:`DemoConfigError` naming the valid ones.
    """
    name = explicit.get("preset")
    if name is None:
        device = explicit.get("device", DemoConfig.device)
        if cuda_available is None:
            cuda_available = device == "auto" and torch.cuda.is_available()
        name = default_preset(device, cuda_available)
    if not isinstance(name, str) or name not in PRESETS:
        raise DemoConfigError(f"--preset {name!r}: unknown preset; valid presets: {', '.join(PRESETS)}")
    values = PRESETS[name].defaults()
    for key, value in explicit.items():
        values[key] = _merge(values["model"], value) if key == "model" else value
    values["preset"] = name
    try:
        return DemoConfig(**values)
    except TypeError as exc:  # a key DemoConfig does not have (a caller's dict, not a checked file)
        raise DemoConfigError(str(exc)) from None


def resolve_device(cfg: DemoConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: DemoConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_environment(cfg: DemoConfig) -> None:
    """Fail fast, before any process starts, on options this machine cannot run."""
    from longtrain.blockdiag_cp import providers, state
    from longtrain.dsa import ops

    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DemoConfigError("--device cuda: no CUDA device is visible (use --device cpu)")
        if cfg.cp > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
            raise DemoConfigError(
                f"--cp {cfg.cp} needs {cfg.cp} GPUs (one per rank), this machine has {torch.cuda.device_count()}"
            )
    try:
        attn = state.normalize_attn_backend(cfg.attn_backend)
        state.normalize_kv_exchange(cfg.kv_exchange)
    except ValueError as exc:
        raise DemoConfigError(str(exc)) from None
    if device.type != "cuda" and attn not in ("auto", "dense", "reference", "flex"):
        raise DemoConfigError(
            f"--attn-backend {cfg.attn_backend}: needs a CUDA device, and this run is on {device} "
            "(use --attn-backend auto, reference or dense on CPU)"
        )
    if cfg.prewarm is not None and cfg.prewarm is not False:
        from longtrain.prewarm import PrewarmConfig, PrewarmConfigError

        try:
            PrewarmConfig.from_dict(cfg.prewarm)
        except PrewarmConfigError as exc:
            raise DemoConfigError(f"prewarm: {exc}") from None
    if attn not in ("auto", "dense"):
        reason = providers.unavailable_reason(attn, dtype, device)
        if reason is not None:
            raise DemoConfigError(f"--attn-backend {cfg.attn_backend}: not available here ({reason}); try auto")
    if cfg.dsa_backend not in ops.BACKENDS:
        raise DemoConfigError(f"--dsa-backend must be one of {list(ops.BACKENDS)}, got {cfg.dsa_backend!r}")
    reason = _dsa_backend_reason(cfg.dsa_backend, device)
    if reason is not None:
        raise DemoConfigError(f"--dsa-backend {cfg.dsa_backend}: not available on {device} ({reason})")
    model_cfg = build_model_config(cfg, device)
    backend = model_cfg.dsa.get("backend", cfg.dsa_backend) if isinstance(model_cfg.dsa, Mapping) else cfg.dsa_backend
    if backend != cfg.dsa_backend:  # model.dsa.backend in a --config file: the same checks as --dsa-backend
        reason = _dsa_backend_reason(backend, device)
        if reason is not None:
            raise DemoConfigError(f"model.dsa.backend {backend}: not available on {device} ({reason})")


def _dsa_backend_reason(backend: str, device: torch.device) -> str | None:
    """Why the DSA backend named explicitly cannot run on ``device`` (None when it can, and for auto / torch)."""
    from longtrain.dsa import routes

    if backend == "triton":
        return routes.triton_reason(device)
    if backend == "cudnn":
        return routes.cudnn_backend_reason(device)
    return None


def build_model_config(cfg: DemoConfig, device: torch.device):
    """The :class:`~longtrain.models.TinyLMConfig` of ``cfg.model`` (the layer pattern, when not given: ``GDSG``,
    plus a GDN layer on CUDA with fla), its DSA backend ``cfg.dsa_backend`` unless ``model.dsa.backend`` says."""
    from longtrain import _optional
    from longtrain.corpus import VOCAB_SIZE
    from longtrain.models import TinyLMConfig, default_layer_pattern

    overrides = dict(cfg.model)
    with_gdn = device.type == "cuda" and _optional.fla()[0]
    overrides.setdefault("layers", default_layer_pattern(with_gdn))
    dsa = overrides.pop("dsa", {}) or {}
    if not isinstance(dsa, Mapping):
        raise DemoConfigError(f"model.dsa must be a mapping of DSA options (e.g. {{backend: triton}}), got {dsa!r}")
    dsa = dict(dsa)
    dsa.setdefault("backend", cfg.dsa_backend)
    if isinstance(overrides["layers"], str) and "N" in overrides["layers"] and not with_gdn:
        raise DemoConfigError(
            f"model.layers={overrides['layers']!r} has a GDN layer 'N', which needs CUDA and fla "
            f"({_optional.fla()[1] or 'CPU device'})"
        )
    valid = sorted(f.name for f in dataclasses.fields(TinyLMConfig))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise DemoConfigError(f"model: unknown key(s) {unknown}; valid keys: {valid}")
    try:
        model_cfg = TinyLMConfig(**overrides, dsa=dsa)
        model_cfg.dsa_config()
    except (TypeError, ValueError) as exc:
        raise DemoConfigError(f"model: {exc}") from None
    if model_cfg.vocab_size < VOCAB_SIZE:
        raise DemoConfigError(
            f"model.vocab_size={model_cfg.vocab_size} cannot hold the corpus's byte tokens: use at least {VOCAB_SIZE}"
        )
    return model_cfg
