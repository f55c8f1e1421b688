"""The pieces of ``longtrain demo`` (the command itself is :mod:`longtrain.train`).

- :mod:`~longtrain.demo.presets`: the one table of presets (``tiny``, ``h200-32k``);
- :mod:`~longtrain.demo.config`: :class:`DemoConfig`, how presets, ``--config`` files and flags combine, the checks
  before any rank starts;
- :mod:`~longtrain.demo.loop`: one rank's training loop, the step-1 parity check, per-step measurements;
- :mod:`~longtrain.demo.launch`: the ranks (its own spawned processes, or ``torchrun``'s);
- :mod:`~longtrain.demo.report`: ``summary.json``, ``loss_curve.png`` and the printed summary.

The FLOP counter behind the TFLOP/s and MFU figures is :mod:`longtrain.models.flops`.
"""

from longtrain.demo.config import DemoConfig, DemoConfigError, make_config
from longtrain.demo.presets import PRESETS, DemoPreset

__all__ = ["PRESETS", "DemoConfig", "DemoConfigError", "DemoPreset", "make_config"]
