"""``longtrain bench``: run the GPU benchmark suites of ``benchmarks/`` and combine their reports.

Each suite is a script of the source checkout's ``benchmarks/`` folder that writes a markdown report and a JSON
report (``{"name", "header", "columns", "rows", "notes"}``, see ``benchmarks/_report.py``). This command runs the
chosen suites one after the other (each in its own process, so one suite's autotune caches and memory never
leak into the next), prints every table, and writes a combined markdown + JSON + PNG chart of the TFLOP/s columns.
Without CUDA it says what it needs and exits cleanly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["SUITES", "add_bench_arguments", "combine_reports", "find_benchmarks_dir", "main"]

# suite -> (script, the flag that names its output folder, extra arguments)
SUITES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "blockdiag": ("blockdiag_attention.py", "--out-dir", ()),
    "dsa": ("dsa.py", "--out-dir", ()),
    "prewarm": ("prewarm.py", "--out", ()),
}


def find_benchmarks_dir() -> Path | None:
    """The ``benchmarks/`` folder of the source checkout this package runs from (or of the working directory)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = root / "benchmarks"
        if (candidate / "_report.py").is_file():
            return candidate
    return None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _markdown_table(columns: list[Any], rows: list[dict[str, Any]]) -> str:
    keys = [c[0] if isinstance(c, (list, tuple)) else c for c in columns]
    titles = [c[1] if isinstance(c, (list, tuple)) else c for c in columns]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _tflops_series(report: dict[str, Any]) -> list[tuple[str, float]]:
    """``(label, value)`` for every numeric cell of a column whose key or title mentions TFLOP/s."""
    out: list[tuple[str, float]] = []
    columns = report.get("columns", [])
    keys = [c[0] if isinstance(c, (list, tuple)) else c for c in columns]
    titles = [c[1] if isinstance(c, (list, tuple)) else c for c in columns]
    label_keys = [k for k, t in zip(keys, titles) if "tflop" not in f"{k} {t}".lower()][:3]
    for key, title in zip(keys, titles):
        if "tflop" not in f"{key} {title}".lower():
            continue
        for row in report.get("rows", []):
            value = row.get(key)
            if isinstance(value, (int, float)) and value == value:
                label = " ".join(str(row.get(k)) for k in label_keys if row.get(k) is not None)
                out.append((f"{label} [{title}]", float(value)))
    return out


def combine_reports(reports: list[dict[str, Any]], out_dir: Path) -> tuple[Path, Path, Path | None]:
    """Write ``bench_<date>.md``, ``.json`` and ``.png`` (TFLOP/s bars) combining ``reports`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    md_path, json_path, png_path = (out_dir / f"bench_{stamp}.{ext}" for ext in ("md", "json", "png"))
    parts = [f"# longtrain bench ({stamp})", ""]
    if reports:
        header = reports[0].get("header", {})
        parts += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()] + [""]
    for rep in reports:
        parts += [f"## {rep.get('name', '?')}", "", _markdown_table(rep.get("columns", []), rep.get("rows", [])), ""]
        if rep.get("notes"):
            parts += [str(rep["notes"]), ""]
    md_path.write_text("\n".join(parts))
    json_path.write_text(json.dumps({"reports": reports}, indent=1, default=str) + "\n")
    series = [(f"{rep.get('name')}: {label}", v) for rep in reports for label, v in _tflops_series(rep)]
    if not series:
        return md_path, json_path, None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md_path, json_path, None
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(series) + 1.2), dpi=110)
    ax.barh([s[0] for s in series], [s[1] for s in series], color="#3a7bd5")
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return md_path, json_path, png_path


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all of {', '.join(SUITES)})")
    p.add_argument("--out", default=None, help="folder for the reports (default: benchmarks/results)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per suite")


def main(args: argparse.Namespace) -> int:
    import torch

    suites = args.suites or list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"longtrain bench: error: unknown suite(s) {unknown}; valid: {list(SUITES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "longtrain bench: the benchmark suites time GPU kernels and need a CUDA device (SM80+; SM90 for the "
            "cuDNN rows); none is visible here, so nothing was run. On this machine `longtrain doctor` lists what "
            "can run and `make test` checks correctness on the CPU."
        )
        return 0
    bench_dir = find_benchmarks_dir()
    if bench_dir is None:
        print("longtrain bench: error: the benchmarks/ folder of a source checkout was not found", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else bench_dir / "results"
    reports: list[dict[str, Any]] = []
    failed: list[str] = []
    for suite in suites:
        script, out_flag, extra = SUITES[suite]
        with tempfile.TemporaryDirectory(prefix=f"longtrain-bench-{suite}-") as tmp:
            cmd = [sys.executable, str(bench_dir / script), out_flag, tmp, *extra]
            print(f"== {suite}: {' '.join(cmd)}", flush=True)
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(filter(None, [str(bench_dir.parent), os.environ.get("PYTHONPATH")])),
            )
            try:
                res = subprocess.run(cmd, env=env, timeout=args.timeout)
                ok = res.returncode == 0
            except subprocess.TimeoutExpired:
                ok = False
            produced = sorted(Path(tmp).glob("*.json"))
            if not ok or not produced:
                failed.append(suite)
            for path in produced:
                rep = json.loads(path.read_text())
                reports.append(rep)
                out_dir.mkdir(parents=True, exist_ok=True)
                for sibling in Path(tmp).glob(path.stem + ".*"):
                    (out_dir / sibling.name).write_bytes(sibling.read_bytes())
                print(_markdown_table(rep.get("columns", []), rep.get("rows", [])), flush=True)
    md, js, png = combine_reports(reports, out_dir)
    print(f"reports: {md}, {js}" + (f", {png}" if png else ""))
    if failed:
        print(f"longtrain bench: suite(s) {failed} failed or wrote no report", file=sys.stderr)
        return 1
    return 0
