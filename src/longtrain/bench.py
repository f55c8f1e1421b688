"""``longtrain bench``: run the GPU benchmark suites and combine their reports.

Each suite is a module of ``longtrain.bench_suites`` (shipped with the package, so an installed wheel runs them as
well as a source checkout; a checkout's ``benchmarks/<module>.py`` are thin entry points to the same modules) that
writes a markdown report and a JSON report (``{"name", "header", "columns", "rows", "notes"}``, see
``longtrain.bench_suites.report``). This command runs the chosen suites one after the other (each as
``python -m longtrain.bench_suites.<module>`` in its own process, so one suite's autotune caches and memory never
leak into the next), prints every table, and writes a combined markdown + JSON + PNG chart of the TFLOP/s columns.
Without CUDA it says what it needs and exits cleanly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
from importlib import resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from longtrain.bench_suites.report import RESULTS_DIR

__all__ = [
    "OURS",
    "SUITES",
    "add_bench_arguments",
    "backend_groups",
    "SUITES_PACKAGE",
    "anchors_path",
    "combine_reports",
    "headline",
    "load_anchors",
    "main",
    "suite_path",
]

#: Substrings of the backend names of rows that run through longtrain's own entry points (the rest are the kernels
#: called directly: the baselines).
OURS = ("cp_varlen_attention", "varlen_attention(", "driver ", "longtrain", "ours")

#: The package that holds the suites and ``anchors.json``.
SUITES_PACKAGE = "longtrain.bench_suites"

#: suite -> (module of ``SUITES_PACKAGE``, the flag that names its output folder, extra arguments)
SUITES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "blockdiag": ("blockdiag_attention", "--out-dir", ()),
    "dsa": ("dsa", "--out-dir", ()),
    "prewarm": ("prewarm", "--out", ()),
}


def suite_path(suite: str) -> Path:
    """The file of ``suite``'s module in the installed (or checked-out) package, found without importing it."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; valid: {list(SUITES)}")
    spec = find_spec(f"{SUITES_PACKAGE}.{SUITES[suite][0]}")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the module of suite {suite!r} is missing from {SUITES_PACKAGE}; reinstall longtrain")
    return Path(spec.origin)


def anchors_path() -> Path:
    """``anchors.json`` of the package (the reference figures of the best public kernels)."""
    return Path(str(resources.files(SUITES_PACKAGE) / "anchors.json"))


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


def load_anchors(path: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """The reference figures of ``anchors.json`` (default: the package's, ``anchors_path()``) per report name (empty
    when the file is absent)."""
    path = anchors_path() if path is None else path
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def backend_groups(report: dict[str, Any]) -> dict[str, list[tuple[str, float | None, float | None]]]:
    """Rows of a report with ``backend`` and ``fwd_tflops``/``bwd_tflops`` grouped by layout: ``{"32768 tokens,
    U[512,8192] seed 1": [(backend, fwd, bwd), ...]}`` in row order (None where a backend did not run)."""
    groups: dict[str, list[tuple[str, float | None, float | None]]] = {}
    for row in report.get("rows", []):
        if "backend" not in row or not ({"fwd_tflops", "bwd_tflops"} & set(row) or row.get("status")):
            continue
        parts = [f"{row['tokens']} tokens" if "tokens" in row else None, row.get("layout") or row.get("docs")]
        key = ", ".join(str(p) for p in parts if p is not None) or "all rows"
        num = [row.get(k) if isinstance(row.get(k), (int, float)) else None for k in ("fwd_tflops", "bwd_tflops")]
        groups.setdefault(key, []).append((str(row["backend"]), num[0], num[1]))
    return groups


def headline(report: dict[str, Any]) -> list[str]:
    """Per layout: our best forward / backward against the best other backend of the same run, as ratios."""
    lines = []
    for key, rows in backend_groups(report).items():
        ours = [r for r in rows if any(m in r[0] for m in OURS)]
        others = [r for r in rows if r not in ours]
        for i, what in ((1, "forward"), (2, "backward")):
            mine = max((r for r in ours if r[i] is not None), key=lambda r: r[i], default=None)
            best = max((r for r in others if r[i] is not None), key=lambda r: r[i], default=None)
            if mine and best:
                lines.append(f"- {key}, {what}: ours {mine[i]:.0f} TFLOP/s ({mine[0]}) vs the best other "
                             f"{best[i]:.0f} ({best[0]}): **{mine[i] / best[i]:.2f}x**")  # fmt: skip
    return lines


def _chart(reports: list[dict[str, Any]], anchors: dict[str, list[dict[str, Any]]], png_path: Path) -> Path | None:
    """One panel per layout: every backend named, forward and backward bars side by side, anchors as marked lines;
    reports without backend rows get one panel of their TFLOP/s cells."""
    panels = []
    for rep in reports:
        groups = backend_groups(rep)
        for key, rows in groups.items():
            panels.append((f"{rep.get('name')}: {key}", rows, anchors.get(str(rep.get("name")), [])))
        if not groups:
            series = _tflops_series(rep)
            if series:
                panels.append((str(rep.get("name")), [(label, value, None) for label, value in series], []))
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    heights = [0.32 * len(rows) + 1.4 for _, rows, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights)), dpi=110, squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")  # fmt: skip
    for ax, (title, rows, marks) in zip(axes[:, 0], panels):
        names = [r[0] for r in rows]
        ypos = list(range(len(rows)))
        fwd = [r[1] or 0.0 for r in rows]
        bwd = [r[2] or 0.0 for r in rows]
        ax.barh([y - 0.2 for y in ypos], fwd, height=0.4, color="#3a7bd5", label="forward")
        ax.barh([y + 0.2 for y in ypos], bwd, height=0.4, color="#e8833a", label="backward")
        for y, (_, f, b) in zip(ypos, rows):
            if f is None and b is None:
                ax.text(1, y, "did not run", va="center", fontsize=6, color="#777777")
        styles = ("--", ":", "-.")
        for i, mark in enumerate(marks):
            for value, color, what in ((mark.get("fwd"), "#1f4e9c", "fwd"), (mark.get("bwd"), "#a84f12", "bwd")):
                if value:
                    ax.axvline(value, color=color, linestyle=styles[i % 3], linewidth=0.9,
                               label=f"anchor {what}: {mark['label']} ({value})")  # fmt: skip
        ax.set_yticks(ypos, names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8, loc="left")
        ax.set_xlabel("TFLOP/s", fontsize=7)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def combine_reports(
    reports: list[dict[str, Any]], out_dir: Path, anchors: dict[str, list[dict[str, Any]]] | None = None
) -> tuple[Path, Path, Path | None]:
    """Write ``bench_<date>.md`` (the headline ratios first), ``.json`` and ``.png`` (one panel per layout, every
    backend named, forward and backward side by side, the anchors of ``anchors.json`` as marked lines)
    combining ``reports`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    anchors = load_anchors() if anchors is None else anchors
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    md_path, json_path, png_path = (out_dir / f"bench_{stamp}.{ext}" for ext in ("md", "json", "png"))
    parts = [f"# longtrain bench ({stamp})", ""]
    heads = [line for rep in reports for line in headline(rep)]
    if heads:
        parts += ["Ours against the best other backend in the same run:", "", *heads, ""]
    if reports:
        header = reports[0].get("header", {})
        parts += ["| machine | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()] + [""]
    for rep in reports:
        parts += [f"## {rep.get('name', '?')}", "", _markdown_table(rep.get("columns", []), rep.get("rows", [])), ""]
        if rep.get("notes"):
            parts += [str(rep["notes"]), ""]
    for rep in reports:
        marks = anchors.get(str(rep.get("name")), [])
        if marks:
            listed = "; ".join(f"{m['label']} {m.get('fwd', '-')} / {m.get('bwd', '-')} ({m.get('where', '')})"
                               for m in marks)  # fmt: skip
            parts += [f"Anchors for {rep.get('name')} (forward / backward TFLOP/s): {listed}", ""]
    md_path.write_text("\n".join(parts))
    json_path.write_text(json.dumps({"reports": reports, "anchors": anchors}, indent=1, default=str) + "\n")
    return md_path, json_path, _chart(reports, anchors, png_path)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all of {', '.join(SUITES)})")
    p.add_argument(
        "--out",
        default=None,
        help="folder for the reports (default: benchmarks/results of the source checkout longtrain runs from, "
        "else benchmarks/results under the working directory)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per suite")


def main(args: argparse.Namespace) -> int:
    import torch

    suites = args.suites or list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"longtrain bench: error: unknown suite(s) {unknown}; valid: {list(SUITES)}", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(f"longtrain bench: error: --timeout must be a positive number of seconds, got {args.timeout}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"longtrain bench: error: --out {args.out}: exists and is not a folder", file=sys.stderr)
        return 2
    try:
        paths = {suite: suite_path(suite) for suite in suites}
    except RuntimeError as exc:
        print(f"longtrain bench: error: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "longtrain bench: the benchmark suites time GPU kernels and need a CUDA device (SM80+; SM90 for the "
            "cuDNN rows); none is visible here, so nothing was run. On this machine `longtrain doctor` lists what "
            "can run (and a source checkout's `make test` checks correctness on the CPU). Suites:"
        )
        for suite, path in paths.items():
            print(f"  {suite}: {path}")
        return 0
    out_dir = Path(args.out) if args.out else RESULTS_DIR
    # The children import the same longtrain as this process, wherever it is installed.
    package_parent = str(paths[suites[0]].parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    reports: list[dict[str, Any]] = []
    failed: list[str] = []
    for suite in suites:
        module, out_flag, extra = SUITES[suite]
        with tempfile.TemporaryDirectory(prefix=f"longtrain-bench-{suite}-") as tmp:
            cmd = [sys.executable, "-m", f"{SUITES_PACKAGE}.{module}", out_flag, tmp, *extra]
            print(f"== {suite}: {' '.join(cmd)}", flush=True)
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
