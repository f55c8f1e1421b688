"""``run_prewarms``: run the enabled prewarms in order, each isolated and RNG-neutral, and report what happened."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from longtrain.prewarm._common import _collect_notes, _log, _normalize_device, _pkg, _rng_neutral
from longtrain.prewarm.steps import PREWARM_STEPS, RunContext

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from longtrain.prewarm.config import PrewarmConfig

_MIB = 2**20


@dataclass
class MemorySnapshot:
    """CUDA memory of one device at one instant, in bytes."""

    allocated: int
    """Bytes in live tensors of the torch caching allocator (``torch.cuda.memory_allocated``)."""
    reserved: int
    """Bytes the caching allocator holds from the driver (``torch.cuda.memory_reserved``)."""
    device_used: int
    """``total - free`` from ``torch.cuda.mem_get_info``: everything on the device, every process included."""
    device_total: int
    """The device's memory (``torch.cuda.mem_get_info``)."""

    @property
    def outside_allocator(self) -> int:
        """Device memory the caching allocator does not hold: CUDA context, cuBLAS workspaces, NCCL buffers,
        Triton modules, other processes. Prewarms that move one-time allocations out of step 1 grow this."""
        return self.device_used - self.reserved


def _memory_snapshot(device: torch.device | None) -> MemorySnapshot | None:
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            device_used=total - free,
            device_total=total,
        )
    except Exception:  # the report must never break a prewarm
        return None


@dataclass
class PrewarmStep:
    """One prewarm's outcome."""

    name: str
    """The ``PrewarmConfig`` field that enabled it (``fla_gdn_l2norm_bucket`` rides on ``fla_gdn_seq_len``)."""
    status: str
    """``"ran"``, ``"skipped"`` (nothing to do or nothing available, see ``reason``) or ``"failed"``."""
    result: Any
    """The worker's return value (bool; the number of groups for ``comm_groups``; None when it raised)."""
    seconds: float
    reason: str | None = None
    """Why it was skipped, or the error when it failed."""
    shapes: list[str] = field(default_factory=list)
    """What it warmed: kernel shapes and module names, or process-group ranks."""
    errors: int = 0
    """Per-shape / per-kernel failures caught (and logged at ERROR) inside the prewarm."""
    memory_before: MemorySnapshot | None = None
    memory_after: MemorySnapshot | None = None


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f}"


def _memory_line(before: MemorySnapshot | None, after: MemorySnapshot | None) -> str:
    if before is None or after is None:
        return "memory n/a (no CUDA device)"
    parts = []
    for label, b, a in (
        ("allocated", before.allocated, after.allocated),
        ("reserved", before.reserved, after.reserved),
        ("outside allocator", before.outside_allocator, after.outside_allocator),
    ):
        parts.append(f"{label} {_mib(b)}->{_mib(a)} MiB ({(a - b) / _MIB:+.1f})")
    return ", ".join(parts)


@dataclass
class PrewarmReport:
    """What ``run_prewarms`` did: one :class:`PrewarmStep` per enabled prewarm, in run order."""

    steps: list[PrewarmStep]
    seconds: float
    device: str | None
    memory_before: MemorySnapshot | None = None
    memory_after: MemorySnapshot | None = None

    def step(self, name: str) -> PrewarmStep | None:
        return next((s for s in self.steps if s.name == name), None)

    def _names(self, status: str) -> list[str]:
        return [s.name for s in self.steps if s.status == status]

    @property
    def ran(self) -> list[str]:
        return self._names("ran")

    @property
    def skipped(self) -> list[str]:
        return self._names("skipped")

    @property
    def failed(self) -> list[str]:
        return self._names("failed")

    def format(self) -> str:
        """A readable multi-line summary (this is what ``run_prewarms`` logs at INFO)."""
        if not self.steps:
            return "prewarm: nothing enabled"
        lines = [
            f"prewarm: {len(self.ran)} ran, {len(self.skipped)} skipped, {len(self.failed)} failed "
            f"in {self.seconds:.2f} s (device {self.device or 'none'})"
        ]
        width = max(len(s.name) for s in self.steps)
        for s in self.steps:
            line = f"  {s.name:<{width}}  {s.status:<7}  {s.seconds:7.2f} s"
            if s.status == "ran" and s.name == "comm_groups":
                line += f"  {s.result} group(s)"
            if s.errors:
                line += f"  ({s.errors} error(s) logged)"
            if s.reason and s.status != "ran":
                line += f"  reason: {s.reason}"
            lines.append(line)
            for shape in s.shapes:
                lines.append(f"  {'':<{width}}    - {shape}")
            if s.memory_before is not None and s.memory_after is not None:
                lines.append(f"  {'':<{width}}    {_memory_line(s.memory_before, s.memory_after)}")
        if self.memory_before is not None:
            lines.append(f"  total: {_memory_line(self.memory_before, self.memory_after)}")
        return "\n".join(lines)


def _report_device(device: torch.device | int | str | None) -> torch.device | None:
    """The CUDA device whose memory and generator the report tracks (None for CPU, None or unusable devices)."""
    try:
        dev = _normalize_device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index) if index < torch.cuda.device_count() else None
    except Exception:
        return None


_FAILURE_MESSAGES = {step.name: step.failure for step in PREWARM_STEPS}


def _planned_steps(
    config: PrewarmConfig,
    model_parts: list[torch.nn.Module],
    device: torch.device | int | str | None,
    batch_size: int,
    pp_mesh: DeviceMesh | None,
) -> list[tuple[str, Callable[[], Any]]]:
    """The enabled steps of the table (:mod:`longtrain.prewarm.steps`) as closures, in its run order; each looks
    its worker up on the package when run."""
    pkg = _pkg()
    ctx = RunContext(model_parts, device, batch_size, pp_mesh, config)
    return [
        (step.name, lambda step=step: step.call(pkg, ctx))
        for step in PREWARM_STEPS
        if getattr(config, step.switch) and (step.when is None or step.when(config))
    ]


def run_prewarms(
    config: PrewarmConfig,
    model_parts: list[torch.nn.Module],
    device: torch.device | int | str | None,
    batch_size: int = 1,
    pp_mesh: DeviceMesh | None = None,
) -> PrewarmReport:
    """Run the prewarms ``config`` enables and return (and log at INFO) a :class:`PrewarmReport`.

    Order: the table of :mod:`longtrain.prewarm.steps`: ``cublas_backward``, ``fla_gdn_autotune`` (then its
    l2-norm bucket pass when ``fla_gdn_seq_len`` is set), ``mamba_ssd_autotune``, ``dsa_autotune``,
    ``blockdiag_autotune``, ``comm_groups``. Each runs inside its own
    ``try/except Exception`` (a failure is logged at ERROR with a fixed message and the next one still runs)
    and inside a fork of the CPU and target-CUDA generators, so the RNG state is unchanged afterwards even
    when a warmup failed. ``KeyboardInterrupt``/``SystemExit`` are not caught. Never raises an ``Exception``.

    Args: as :meth:`PrewarmConfig.apply`.
    """
    start = time.perf_counter()
    cuda_dev = _report_device(device)
    report = PrewarmReport(steps=[], seconds=0.0, device=None if device is None else str(device))
    report.memory_before = _memory_snapshot(cuda_dev)
    try:
        planned = _planned_steps(config, model_parts, device, batch_size, pp_mesh)
    except Exception:
        _log().exception("Prewarm planning failed; no prewarm runs.")
        planned = []
    for name, worker in planned:
        step_start = time.perf_counter()
        before = _memory_snapshot(cuda_dev)
        result: Any = None
        error: str | None = None
        with _collect_notes() as notes:
            try:
                with _rng_neutral(cuda_dev):
                    result = worker()
            except Exception as exc:
                _log().exception(_FAILURE_MESSAGES[name])
                error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - step_start
        if error is not None:
            status, reason = "failed", error
        elif result:
            status, reason = "ran", notes["reason"]
        else:
            status = "failed" if notes["errors"] else "skipped"
            failure = f"every warmup failed (last: {notes['failure']})"
            reason = failure if notes["errors"] else (notes["reason"] or "nothing to do")
        report.steps.append(
            PrewarmStep(
                name=name,
                status=status,
                result=result,
                seconds=seconds,
                reason=reason,
                shapes=list(notes["shapes"]),
                errors=notes["errors"],
                memory_before=before,
                memory_after=_memory_snapshot(cuda_dev),
            )
        )
    report.memory_after = _memory_snapshot(cuda_dev)
    report.seconds = time.perf_counter() - start
    if report.steps:
        _log().info("%s", report.format())
    return report
