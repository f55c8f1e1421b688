"""The report writer of the benchmark scripts in this folder: ``from _report import machine_header, write_report``.

Its one home is ``longtrain.bench_suites.report`` (shipped with the package, so that ``longtrain bench`` also runs
from an installed wheel); this module puts the checkout's ``src/`` first on ``sys.path`` and re-exports it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[1] / "src"
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

try:
    from longtrain.bench_suites.report import (
        RESULTS_DIR,
        checkout_root,
        fmt,
        machine_header,
        reproduce_args,
        write_report,
    )
except ImportError:  # longtrain already imported from a tree without bench_suites (dsa_overhead.py --src OLD)
    _spec = importlib.util.spec_from_file_location("_longtrain_bench_report", _SRC / "longtrain/bench_suites/report.py")
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    RESULTS_DIR, checkout_root, fmt = _module.RESULTS_DIR, _module.checkout_root, _module.fmt
    machine_header, write_report = _module.machine_header, _module.write_report
    reproduce_args = _module.reproduce_args

__all__ = ["RESULTS_DIR", "checkout_root", "fmt", "machine_header", "reproduce_args", "write_report"]
