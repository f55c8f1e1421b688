"""The one table of prewarm steps: every switch, its run order, its worker, its failure message and what it needs.

:class:`~longtrain.prewarm.config.PrewarmConfig` reads its switches and ``enabled`` order from it,
:func:`~longtrain.prewarm.report.run_prewarms` its workers and failure messages, and
:func:`~longtrain.prewarm.status.backend_status` what each one needs. A step looks its worker up on the
``longtrain.prewarm`` package when it runs (so ``monkeypatch.setattr(longtrain.prewarm, "_prewarm_...", fake)``
is what runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PREWARM_STEPS", "SWITCHES", "PrewarmStepSpec", "RunContext"]


@dataclass(frozen=True)
class RunContext:
    """What the workers are called with: the model parts, the device, the per-rank batch size, the pipeline mesh
    and the config (for the options of a step)."""

    model_parts: list
    device: Any
    batch_size: int
    pp_mesh: Any
    config: Any


@dataclass(frozen=True)
class PrewarmStepSpec:
    """One row of the table."""

    name: str
    """The step's name in the report (and, for a switch, the ``PrewarmConfig`` field)."""
    switch: str
    """The ``PrewarmConfig`` field that turns it on."""
    call: Callable[[Any, RunContext], Any]
    """``(package, ctx) -> result``: runs the worker found on the package."""
    failure: str
    """Logged at ERROR when the worker raises."""
    needs: str
    """What ``backend_status`` checks: a key of :mod:`longtrain.prewarm.status`'s probes."""
    when: Callable[[Any], bool] | None = None
    """An extra condition on the config (a sub-step); None: the switch alone."""


PREWARM_STEPS: tuple[PrewarmStepSpec, ...] = (
    PrewarmStepSpec(
        "cublas_backward", "cublas_backward", lambda pkg, c: pkg._prewarm_cublas_backward(c.device),
        "cuBLAS backward prewarm failed; continuing without it.", "cuda",
    ),
    PrewarmStepSpec(
        "fla_gdn_autotune", "fla_gdn_autotune",
        lambda pkg, c: pkg._prewarm_fla_gdn_autotune(c.model_parts, c.device, batch_size=c.batch_size),
        "fla GDN autotune prewarm failed; continuing without it.", "fla",
    ),
    PrewarmStepSpec(
        "fla_gdn_l2norm_bucket", "fla_gdn_autotune",
        lambda pkg, c: pkg._prewarm_fla_gdn_l2norm_bucket(c.model_parts, c.device, c.batch_size,
                                                          c.config.fla_gdn_seq_len),
        "fla GDN l2norm bucket prewarm failed; continuing without it.", "fla",
        when=lambda cfg: bool(cfg.fla_gdn_seq_len),
    ),
    PrewarmStepSpec(
        "mamba_ssd_autotune", "mamba_ssd_autotune",
        lambda pkg, c: pkg._prewarm_mamba_ssd_autotune(c.model_parts, c.device),
        "Mamba SSD autotune prewarm failed; continuing without it.", "mamba",
    ),
    PrewarmStepSpec(
        "dsa_autotune", "dsa_autotune", lambda pkg, c: pkg._prewarm_dsa_autotune(c.model_parts, c.device),
        "DSA autotune prewarm failed; continuing without it.", "dsa",
    ),
    PrewarmStepSpec(
        "blockdiag_autotune", "blockdiag_autotune",
        lambda pkg, c: pkg._prewarm_blockdiag_autotune(c.model_parts, c.device),
        "Block-diagonal attention autotune prewarm failed; continuing without it.", "cuda",
    ),
    # last: the only collective, issued once every local warmup is done
    PrewarmStepSpec(
        "comm_groups", "comm_groups",
        lambda pkg, c: pkg._prewarm_comm_groups(c.model_parts, c.device, pp_mesh=c.pp_mesh),
        "Communication-group prewarm failed; continuing without it.", "comm",
    ),
)  # fmt: skip

#: The boolean switches of ``PrewarmConfig``, in run order.
SWITCHES: tuple[str, ...] = tuple(dict.fromkeys(s.switch for s in PREWARM_STEPS))
