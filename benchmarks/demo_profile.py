"""Where a ``longtrain demo`` run spends its time: the whole run (one rank, in this process) under torch.profiler,
the top ops by device time (by CPU time without CUDA) written to a text file.

Usage (repository root)::

    python benchmarks/demo_profile.py --out prof.txt -- --preset h200-32k --seq-len 4096 --steps 2 \\
        --attn-backend dense --dsa-backend torch --no-prewarm --no-parity

Everything after ``--`` goes to ``longtrain demo`` unchanged; ``--cp`` must stay 1 (the ranks of a CP run are
other processes, which the profiler does not see). Model build and data loading are inside the profile too: read
the kernels' rows, not the total.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import _report  # noqa: F401  (puts the checkout's src/ first on sys.path)
from longtrain import cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, demo_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="text file for the table")
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args(ours)
    if "--cp" in demo_args and demo_args[demo_args.index("--cp") + 1] != "1":
        parser.error("--cp must be 1: the profiler sees this process only")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        rc = cli.main(["demo", "--cp", "1", *demo_args] if "--cp" not in demo_args else ["demo", *demo_args])
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=70)
    Path(args.out).write_text(f"longtrain demo {' '.join(demo_args)} (exit {rc}); sorted by {sort_by}\n{table}\n")
    print(f"wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
