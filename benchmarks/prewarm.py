"""``python benchmarks/prewarm.py [ARGS]``: the suite ``longtrain.bench_suites.prewarm``, run from this checkout.

Its one home is ``src/longtrain/bench_suites/prewarm.py`` (shipped with the package, so that ``longtrain bench``
runs from an installed wheel too); its docstring says what it measures and which arguments it takes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# The other scripts of this folder import the suite's names from here (``from prewarm import ...``).
from longtrain.bench_suites.prewarm import *  # noqa: E402, F403
from longtrain.bench_suites.prewarm import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
