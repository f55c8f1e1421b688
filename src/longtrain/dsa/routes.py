"""Which kernels run a DSA call: one measured table, the presence probes, the constraints, and ``"auto"``'s choice.

``backend="auto"`` of :mod:`longtrain.dsa.ops` takes, for each op and direction, the first row of
:data:`ROUTE_TABLE` whose route is present on the call's device (:func:`route_absent`) and fits the call
(:func:`route_unfit`). The rows of one op and direction are ordered by the figure measured in the report each row
names, fastest first; a row without a measurement says in ``source`` why it stands where it does. Sparse MLA picks
its two directions together: a backward runs only after a forward it can follow (:data:`FOLLOWS`).

Routes:

- ``"triton"``: our kernels (:mod:`longtrain.dsa.triton`), CUDA SM80+; ``"auto"`` never runs them under the Triton
  interpreter (that is ``backend="triton"`` on CPU, for tests).
- ``"cudnn"``: the cuDNN frontend DSA (``nvidia-cudnn-frontend[cutedsl]``): the sparse MLA backward and the indexer,
  CUDA SM90+, GLM-5.2 widths in bf16 (:func:`~longtrain.dsa.cudnn_dsa.sparse_attention_unfit`,
  :func:`~longtrain.dsa.cudnn_dsa.indexer_unfit`).
- ``"flash_mla"``: FlashMLA's sparse prefill forward (``flash_mla.flash_mla_sparse_fwd``), paired with cuDNN's
  backward: the seed's split path, same constraints.
- ``"torch"``: the plain-torch reference on row chunks: anywhere, any float dtype, always the last row.

Every figure was measured on one H200 (SM90, the ``sm`` column). No other GPU has been measured, so the same order
holds on every GPU; a measurement on another one belongs in a new row with its ``sm``.

The probes are module functions looked up at call time (tests replace them); nothing here imports an optional
package or initialises CUDA at import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from longtrain.dsa import cudnn_dsa
from longtrain.dsa.triton import _common as _triton_common

__all__ = [
    "FOLLOWS",
    "GLM52_INDEXER",
    "GLM52_SPARSE_MLA",
    "ROUTE_TABLE",
    "CallShape",
    "Plan",
    "RouteRow",
    "auto_plan",
    "auto_status",
    "cudnn_absent",
    "cudnn_backend_reason",
    "device_major",
    "flash_mla_absent",
    "route_absent",
    "route_unfit",
    "rows_for",
    "triton_absent",
    "triton_reason",
]


class RouteRow(NamedTuple):
    """One measured (or deliberately unmeasured) route of one op and direction."""

    op: str
    """``"sparse_mla"`` or ``"indexer_topk"``."""
    direction: str
    """``"fwd"`` or ``"bwd"`` (the indexer has no backward: its result is integer)."""
    route: str
    """``"triton" | "cudnn" | "flash_mla" | "torch"``."""
    sm: str
    """Compute capability the figure was measured on (``"90"``), ``"-"`` without a figure."""
    tflops: float | None
    """The measured TFLOP/s (FLOP conventions of CONVENTIONS.md, valid slots only), ``None`` if not measured."""
    figure: str
    """The measurement as its report gives it: time, rate and shape."""
    source: str
    """The report under ``benchmarks/results/`` the figure comes from, or why there is no figure."""


# The FP8 indexer's figure for `longtrain doctor` (its route follows the same table, without cudnn).
_FP8_FIGURE = (
    "3.80 ms against 3.84 ms in bf16 at T=16384 H_I=32 D_I=128 K=2048, one document; selection overlap with the "
    "bf16 selection 0.978 (dsa_indexer_34a525d_h200_2026-12-07.md)"
)

#: What ``"auto"`` chooses from, per op and direction fastest first (a test keeps the measured rows in order).
ROUTE_TABLE: tuple[RouteRow, ...] = (
    RouteRow(
        "sparse_mla", "fwd", "triton", "90", 492.7,
        "8.89 ms, 492.7 TFLOP/s (SM90 warp-specialized kernel); T=16384 H=64 D_qk=576 d_v=512 K=2048, one document",
        "benchmarks/results/dsa_mla_34a525d_h200_2026-12-07.md",
    ),
    RouteRow(
        "sparse_mla", "fwd", "flash_mla", "-", None,
        "not measured",
        "no measurement here: FlashMLA has no wheel and has not been built on our H200 (its README claims up to "
        "640 TFLOP/s on an H800, not our figure); after ours until it is measured",
    ),
    RouteRow(
        "sparse_mla", "fwd", "torch", "90", 9.029,
        "97.06 ms, 9.03 TFLOP/s (torch reference, gather); T=4096 H=64 K=2048, one document",
        "benchmarks/results/dsa_2026-11-29.md",
    ),
    RouteRow(
        "sparse_mla", "bwd", "cudnn", "90", 411.0,
        "27.0 ms, 411 TFLOP/s (cuDNN frontend SparseAttentionBackward, fed our forward's out and LSE); "
        "T=16384 H=64 K=2048, one document",
        "benchmarks/results/blockdiag_cudnn_bwd_probe_2026-11-29.md (section 4)",
    ),
    RouteRow(
        "sparse_mla", "bwd", "triton", "90", 317.9,
        "34.86 ms, 317.9 TFLOP/s (SM90 warp-specialized probabilities + dkv kernel, SM90 dq kernel); T=16384 H=64 "
        "K=2048, one document",
        "benchmarks/results/dsa_mla_34a525d_h200_2026-12-07.md",
    ),
    RouteRow(
        "sparse_mla", "bwd", "torch", "90", 1.299,
        "1706 ms, 1.30 TFLOP/s (torch reference, chunked recomputation); T=4096 H=64 K=2048, one document",
        "benchmarks/results/dsa_2026-11-29.md",
    ),
    RouteRow(
        "indexer_topk", "fwd", "triton", "90", 286.6,
        "3.84 ms, 286.6 TFLOP/s of logits (SM90 Gluon scores, TMA, + union radix select); T=16384 H_I=32 D_I=128 "
        "K=2048, one document",
        "benchmarks/results/dsa_indexer_34a525d_h200_2026-12-07.md",
    ),
    RouteRow(
        "indexer_topk", "fwd", "cudnn", "-", None,
        "not measured",
        "no measurement of cuDNN's indexer (segmented scores + radix top-k) on our H200: kept after ours, where "
        "auto placed it before this table",
    ),
    RouteRow(
        "indexer_topk", "fwd", "torch", "-", None,
        "not measured",
        "the torch backend itself was not timed (the benchmark's plain-torch indexer, materialised scores + "
        "torch.topk, took 65.4 ms at T=16384 in benchmarks/results/dsa_2026-11-29.md); the fallback, last",
    ),
)  # fmt: skip

#: The forwards each sparse MLA backward can run after. cuDNN's backward takes the forward's output and its
#: natural-log LSE in FlashMLA's convention, which our forward also writes (``flash_mla_style_fwd``); ours and the
#: torch backend's keep their own forward's saved state.
FOLLOWS: dict[str, tuple[str, ...]] = {"cudnn": ("triton", "flash_mla"), "triton": ("triton",), "torch": ("torch",)}

_ROWS: dict[tuple[str, str], tuple[RouteRow, ...]] = {}
for _row in ROUTE_TABLE:
    _ROWS[(_row.op, _row.direction)] = (*_ROWS.get((_row.op, _row.direction), ()), _row)


def rows_for(op: str, direction: str) -> tuple[RouteRow, ...]:
    """The table's rows of ``op`` and ``direction``, in the order ``"auto"`` tries them."""
    return _ROWS[(op, direction)]


class CallShape(NamedTuple):
    """What the constraints read from one validated call: host attributes only (no synchronisation).

    A named tuple, not a dataclass: one is built per call, and it must cost next to nothing.
    """

    op: str
    """``"sparse_mla"`` or ``"indexer_topk"``."""
    device: torch.device
    """Where the call's tensors are."""
    dtype: torch.dtype
    """``q``'s (and ``kv``'s) dtype, or ``index_q``'s."""
    heads: int
    """``H`` or ``H_I``."""
    width: int
    """``D_qk`` or ``D_I``."""
    topk: int
    """``K``: index slots per row."""
    d_v: int = 0
    """Sparse MLA's value width."""
    has_sink: bool = False
    """Sparse MLA: an ``attn_sink`` was given."""
    key_dtype: torch.dtype | None = None
    """The indexer's ``index_k`` dtype."""
    weight_dtype: torch.dtype | None = None
    """The indexer's ``head_weights`` dtype."""
    fp8: bool = False
    """The indexer scores FP8 codes of its inputs (``indexer_topk(..., fp8=True)``): triton (SM89+) or torch only."""
    deterministic: bool = False
    """Sparse MLA: ``torch.are_deterministic_algorithms_enabled()`` at the call. The backward must then be bitwise
    reproducible: triton (its fixed-order dkv reduction) or torch, not cuDNN's."""


class Plan(NamedTuple):
    """The routes one call runs."""

    fwd: str
    """The forward's route (the indexer's only one)."""
    bwd: str | None
    """The backward's route; ``None`` for the indexer."""
    fwd_row: RouteRow | None = None
    """The table row ``"auto"`` chose the forward by (``None`` when the backend was named)."""
    bwd_row: RouteRow | None = None
    """The table row ``"auto"`` chose the backward by."""
    major: int | None = None
    """The device's SM major where a cuDNN route needs it (head padding)."""
    deterministic: bool = False
    """Sparse MLA: the backward must be bitwise reproducible (``torch.use_deterministic_algorithms(True)``)."""


# --------------------------------------------------------------------------------------------- presence probes

_TRITON_REASONS: dict[tuple[int, str], str | None] = {}


def triton_reason(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (``None`` when they can); cached per kernel module and device.

    What ``backend="triton"`` needs: CUDA SM80+, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    from longtrain import _optional

    ok, why = _optional.triton()
    if not ok:
        return why
    import importlib

    try:
        module = importlib.import_module("longtrain.dsa.triton")
    except Exception as exc:  # a missing or broken kernel module is a reason, not a crash
        return f"longtrain.dsa.triton failed to import ({type(exc).__name__}: {str(exc)[:160]})"
    key = (id(module), str(device))
    if key not in _TRITON_REASONS:
        try:
            ok, why = module.availability(device)
            _TRITON_REASONS[key] = None if ok else (why or "longtrain.dsa.triton reports it is unavailable")
        except Exception as exc:
            _TRITON_REASONS[key] = f"longtrain.dsa.triton.availability failed ({type(exc).__name__}: {str(exc)[:160]})"
    return _TRITON_REASONS[key]


def triton_absent(device: torch.device) -> str | None:
    """Why ``"auto"`` cannot take the ``triton`` route on ``device``: it runs our kernels on CUDA only."""
    if device.type != "cuda":
        return "auto runs the Triton kernels on CUDA only (the interpreter is backend='triton', for tests)"
    return triton_reason(device)


def _sm90(device: torch.device) -> str | None:
    from longtrain import _optional

    if device.type != "cuda":
        return "needs CUDA SM90+"
    ok, why = _optional.cuda_sm(9, 0)
    return None if ok else why


def cudnn_absent(device: torch.device) -> str | None:
    """Why the cuDNN frontend DSA cannot run on ``device`` (package, CUDA, SM90+), or ``None``."""
    from longtrain import _optional

    if device.type == "cuda" and not cudnn_dsa._has_cudnn_dsa():
        return _optional.cudnn_dsa()[1] or "cudnn.DSA unavailable"
    return _sm90(device)


def flash_mla_absent(device: torch.device) -> str | None:
    """Why FlashMLA's sparse forward cannot run on ``device`` (package, CUDA, SM90+), or ``None``."""
    from longtrain import _optional

    if device.type == "cuda" and not cudnn_dsa._has_flash_mla():
        return _optional.flash_mla()[1] or "flash_mla.flash_mla_sparse_fwd unavailable"
    return _sm90(device)


def device_major(device: torch.device) -> int:
    """The SM major of a CUDA ``device`` (what the cuDNN routes' head padding depends on)."""
    return torch.cuda.get_device_capability(device)[0]


def route_absent(route: str, device: torch.device) -> str | None:
    """Why ``route`` is not present on ``device`` for ``"auto"`` (``None``: present). Cheap: cached probes only."""
    if route == "torch":
        return None
    if route == "triton":
        return triton_absent(device)
    if route == "cudnn":
        return cudnn_absent(device)
    if route == "flash_mla":
        return flash_mla_absent(device)
    raise ValueError(f"unknown DSA route {route!r}; valid: triton, cudnn, flash_mla, torch")


#: Why the cuDNN backward is not taken under ``torch.use_deterministic_algorithms(True)``.
CUDNN_NOT_DETERMINISTIC = (
    "torch.use_deterministic_algorithms(True) is set and cuDNN's DSA backward does not promise bitwise-reproducible "
    "gradients; backend='triton' reduces dkv in a fixed order then (or 'torch'), or pass warn_only=True to "
    "torch.use_deterministic_algorithms to run cuDNN's anyway"
)


def route_unfit(route: str, call: CallShape, major: int | None = None) -> tuple[type[Exception], str] | None:
    """Why ``route`` cannot take ``call`` (``(exception type, message)``; ``None``: it fits).

    ``major``: the device's SM major, for the cuDNN routes (read from the device when not given).
    """
    if route == "torch":
        return None
    if route == "triton":
        if call.op == "sparse_mla":
            return _triton_common.sparse_mla_unfit(call.dtype, call.heads, call.width, call.d_v)
        unfit = _triton_common.indexer_unfit(call.dtype, call.key_dtype, call.heads, call.width)
        if unfit is None and call.fp8:
            unfit = _triton_common.indexer_fp8_unfit(call.device)
        return unfit
    if call.fp8:
        return ValueError, f"fp8=True has no {route} route: the FP8 indexer runs on backend='triton' or 'torch'"
    if route == "cudnn" and call.op == "sparse_mla" and call.deterministic:
        return RuntimeError, CUDNN_NOT_DETERMINISTIC
    major = device_major(call.device) if major is None else major
    if call.op == "sparse_mla":
        return cudnn_dsa.value_unfit(call.d_v, call.has_sink) or cudnn_dsa.sparse_attention_unfit(
            call.dtype, call.width, call.topk, call.heads, major
        )
    if route == "flash_mla":
        return ValueError, "FlashMLA has no indexer"
    return cudnn_dsa.indexer_unfit(call.dtype, call.key_dtype, call.weight_dtype, call.heads, call.width, major)


# --------------------------------------------------------------------------------------------- the choice


_PLANS: dict[tuple, Plan] = {}
_MAX_PLANS = 1024


def auto_plan(call: CallShape) -> Plan:
    """What ``backend="auto"`` runs for ``call``: per direction the first usable row (see the module docstring).

    Decided once per call shape and kept: every probe is cached for the life of the process anyway. The key also
    holds the probes themselves and the provider flags, so a test that replaces one gets a fresh answer.
    """
    key = (
        call, triton_absent, triton_reason, cudnn_absent, flash_mla_absent, device_major,
        cudnn_dsa._HAS_CUDNN_DSA, cudnn_dsa._HAS_FLASH_MLA,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _decide(call)
    return plan


def _decide(call: CallShape) -> Plan:
    absent: dict[str, str | None] = {}
    majors: list[int] = []

    def usable(row: RouteRow) -> bool:
        if row.route not in absent:
            absent[row.route] = route_absent(row.route, call.device)
        if absent[row.route] is not None:
            return False
        if row.route in ("cudnn", "flash_mla") and not majors:
            majors.append(device_major(call.device))
        return route_unfit(row.route, call, majors[0] if majors else None) is None

    if call.op == "indexer_topk":
        for row in _ROWS[("indexer_topk", "fwd")]:
            if usable(row):
                return Plan(row.route, None, row, None, majors[0] if majors else None)
    else:
        for fwd in _ROWS[("sparse_mla", "fwd")]:
            if not usable(fwd):
                continue
            for bwd in _ROWS[("sparse_mla", "bwd")]:
                if fwd.route in FOLLOWS[bwd.route] and usable(bwd):
                    return Plan(fwd.route, bwd.route, fwd, bwd, majors[0] if majors else None, call.deterministic)
    raise AssertionError("the torch rows are always usable")  # pragma: no cover


#: The GLM-5.2 calls ``longtrain doctor`` reports ``"auto"``'s choice for (bf16; K = 2048).
GLM52_SPARSE_MLA = dict(dtype=torch.bfloat16, heads=64, width=576, topk=2048, d_v=512)
GLM52_INDEXER = dict(
    dtype=torch.bfloat16, heads=32, width=128, topk=2048, key_dtype=torch.bfloat16, weight_dtype=torch.float32
)


def _why(row: RouteRow, skipped: list[str]) -> str:
    if row.tflops is not None:
        report = row.source.split("benchmarks/results/", 1)[-1]
        text = f"{row.tflops:g} TFLOP/s on SM{row.sm} ({report})"
    else:
        text = "not measured (ROUTE_TABLE's source column says why it stands there)"
    if skipped:
        text += f"; rows above it not usable here: {', '.join(skipped)}"
    return text


def auto_status(device: torch.device) -> list[tuple[str, None]]:
    """``longtrain doctor`` rows: what ``"auto"`` picks on ``device`` per op and direction for GLM-5.2 shapes in
    bf16, and which table row it picked by (its figure and report)."""
    out: list[tuple[str, None]] = []
    for op, shape in (("sparse_mla", GLM52_SPARSE_MLA), ("indexer_topk", GLM52_INDEXER)):
        try:
            plan = auto_plan(CallShape(op, device, **shape))
        except Exception as exc:  # doctor must print, whatever a probe does
            out.append((f"auto {op}: cannot decide ({type(exc).__name__}: {str(exc)[:120]})", None))
            continue
        chosen = [("fwd", plan.fwd_row)] + ([("bwd", plan.bwd_row)] if plan.bwd_row is not None else [])
        for direction, row in chosen:
            rows = _ROWS[(op, direction)]
            skipped = [r.route for r in rows[: rows.index(row)]]
            label = f"auto {op} {direction}" if op == "sparse_mla" else f"auto {op}"
            out.append((f"{label} -> {row.route}: {_why(row, skipped)}", None))
    try:  # the FP8 indexer takes the same table's order, without the routes that have no FP8 option
        route = auto_plan(CallShape("indexer_topk", device, **GLM52_INDEXER, fp8=True)).fwd
        out.append((f"auto indexer_topk fp8=True -> {route}: {_FP8_FIGURE} (cudnn has no FP8 option)", None))
    except Exception as exc:
        out.append((f"auto indexer_topk fp8=True: cannot decide ({type(exc).__name__}: {str(exc)[:120]})", None))
    return out


def cudnn_backend_reason(device: torch.device | None = None) -> str | None:
    """Why ``backend="cudnn"`` cannot run (packages, CUDA, SM90+); ``None`` when it can.

    FlashMLA is needed only where our Triton forward cannot stand in for it (no Triton, or not CUDA SM80+).
    """
    from longtrain import _optional

    missing = cudnn_dsa.unavailable_reason()
    stand_in = cudnn_dsa._has_cudnn_dsa() and triton_reason(device or torch.device("cuda")) is None
    if missing and not stand_in:
        return missing
    if device is not None and device.type != "cuda":
        return "needs CUDA tensors"
    ok, why = _optional.cuda_sm(9, 0)
    return None if ok else why
