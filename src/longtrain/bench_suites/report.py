"""Shared report writer of every benchmark suite and script (``longtrain.bench_suites``, ``benchmarks/``).

API (``from longtrain.bench_suites.report import machine_header, write_report``; the scripts of a checkout's
``benchmarks/`` folder import the same names through ``benchmarks/_report.py``):

- ``machine_header() -> dict[str, str]``: ``gpu``, ``sm``, ``driver``, ``cuda``, ``torch``, ``triton``, ``cudnn``,
  ``python``, ``commit``, ``date`` (UTC, ISO 8601). Never raises: unknown fields read ``"n/a"``. The commit
  comes from the ``LONGTRAIN_COMMIT`` environment variable, else ``git rev-parse HEAD`` of the source checkout
  this package runs from; an installed package outside a checkout reads ``n/a (longtrain <version>)``.
- ``write_report(name, rows, columns, notes="", *, header=None, out_dir=None, title=None) -> (md_path, json_path)``:
  writes ``<out_dir>/<name>_<YYYY-MM-DD>.md`` (the header as a table, then one markdown table of ``rows``
  restricted to ``columns``, then ``notes``) and the matching ``.json``
  (``{"name", "header", "columns", "rows", "notes"}``). ``rows`` are dicts; ``columns`` are keys, or
  ``(key, title)`` pairs; floats print with 3 significant decimals, missing cells as ``-``.
  ``out_dir`` defaults to ``RESULTS_DIR``.
- ``checkout_root() -> Path | None``: the source checkout this package runs from (``None`` for an installed wheel).
- ``RESULTS_DIR``: the checkout's ``benchmarks/results``; outside a checkout, ``benchmarks/results`` under the
  working directory.
- ``fmt(value) -> str``: the cell formatter, for scripts that print tables themselves.
- ``reproduce_args(argv=None) -> str``: a script's command-line arguments (``sys.argv[1:]`` by default) without
  ``--out-dir DIR`` (a path on the machine that ran it), for a report's reproduce line.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "checkout_root", "fmt", "machine_header", "reproduce_args", "write_report"]


def checkout_root() -> Path | None:
    """The repository root when this package runs from a source checkout (``src/longtrain/...``), else ``None``."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "benchmarks").is_dir() and (root / "src").is_dir():
        return root
    return None


RESULTS_DIR = (checkout_root() or Path.cwd()) / "benchmarks" / "results"


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def machine_header() -> dict[str, str]:
    """Versions and hardware of this machine, for the top of every report."""
    head: dict[str, str] = {}
    try:
        import torch

        head["torch"] = torch.__version__
        head["cuda"] = str(torch.version.cuda)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        head["cudnn"] = str(cudnn) if cudnn else "n/a"
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            head["gpu"] = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
            head["sm"] = f"{props.major}{props.minor}"
        else:
            head["gpu"] = "none (CPU only)"
            head["sm"] = "n/a"
    except Exception as exc:  # the header must never break a benchmark
        head["torch"] = f"n/a ({type(exc).__name__})"
    try:
        import triton

        head["triton"] = triton.__version__
    except Exception:
        head["triton"] = "n/a"
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    head["driver"] = driver.splitlines()[0] if driver else "n/a"
    head["python"] = platform.python_version()
    repo = checkout_root()
    # LONGTRAIN_COMMIT first: a copy of the tree run elsewhere may carry a stale .git
    commit = os.environ.get("LONGTRAIN_COMMIT")
    if not commit and repo is not None:
        commit = _run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"])
    if not commit and repo is None:
        from longtrain import __version__

        commit = f"n/a (longtrain {__version__})"
    head["commit"] = commit or "n/a"
    head["date"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    order = ("gpu", "sm", "driver", "cuda", "torch", "triton", "cudnn", "python", "commit", "date")
    return {k: head.get(k, "n/a") for k in order}


def reproduce_args(argv: list[str] | None = None) -> str:
    """``argv`` (``sys.argv[1:]``) joined, less ``--out-dir DIR`` / ``--out-dir=DIR``."""
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if skip or a == "--out-dir" or a.startswith("--out-dir="):
            skip = a == "--out-dir"
            continue
        args.append(a)
    return " ".join(args)


def fmt(value: Any) -> str:
    """Cell text: floats with 3 decimals (or 3 significant digits when small), None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.3f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_report(
    name: str,
    rows: list[dict[str, Any]],
    columns: list[str | tuple[str, str]],
    notes: str = "",
    *,
    header: dict[str, str] | None = None,
    out_dir: str | os.PathLike | None = None,
    title: str | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>_<date>.md`` and ``.json`` and return their paths (see the module docstring)."""
    header = header if header is not None else machine_header()
    cols = [(c, c) if isinstance(c, str) else (c[0], c[1]) for c in columns]
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    day = header.get("date", "")[:10] or _dt.date.today().isoformat()
    stem = out / f"{name}_{day}"
    lines = [f"# {title or name}", "", "| machine | |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in header.items()]
    lines += ["", "| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    if notes:
        lines += ["", notes.strip()]
    md = stem.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    js = stem.with_suffix(".json")
    payload = {"name": name, "header": header, "columns": [k for k, _ in cols], "rows": rows, "notes": notes}
    js.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return md, js
