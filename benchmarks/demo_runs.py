"""Recorded runs of ``longtrain demo``: one preset's full run, or a row-length sweep of ours next to the plain-PyTorch
path, each run a fresh ``python -m longtrain demo`` process; a report with the machine header.

Usage (repository root)::

    python benchmarks/demo_runs.py --preset h200-32k --steps 300 --name demo_h200_32k
        # the preset's run; its summary.json, metrics.jsonl and loss curve are copied next to the report
    python benchmarks/demo_runs.py --preset h200-32k --sweep 4096 8192 16384 32768 --sweep-steps 4 \\
        --name demo_dense_sweep
        # per row length: the plain-PyTorch path (--attn-backend dense --dsa-backend torch) until its first run
        # that fails (recorded as OOM, timeout or error), then ours (the preset's backends) at the lengths the
        # plain path fitted; both without prewarm and the parity check

Each row is the run's ``summary.json`` (tokens/s and model TFLOP/s are means over steps 2..N; peak memory is
``torch.cuda.max_memory_allocated`` of step 1 and of the steady steps) or the reason it has none (OOM, timeout,
error: the last lines of its log are kept in the JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _report import machine_header, write_report

COLUMNS = [
    ("label", "run"), ("seq_len", "tokens/row"), ("attn_backend", "attn"), ("dsa_backend", "dsa"),
    ("steps", "steps"), ("mean_tokens_per_s", "tokens/s"), ("model_tflops_per_s", "model TFLOP/s"),
    ("mfu", "MFU"), ("step1_peak_memory_gib", "step-1 peak GiB"), ("steady_peak_memory_gib", "steady peak GiB"),
    ("first_loss", "first loss"), ("final_loss", "final loss"), ("wall_s", "wall s"), ("status", "status"),
]  # fmt: skip


def run_demo(label: str, args: list[str], out: Path, timeout: float) -> dict:
    """One ``longtrain demo`` process writing to ``out``; its summary as a row, or the reason there is none."""
    if timeout < 20:
        return {"label": label, "args": " ".join(args), "status": "not run (out of --budget)"}
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "longtrain", "demo", *args, "--out", str(out)]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log, rc = log + f"\n[timed out after {timeout:.0f} s]", None
    (out / "log.txt").write_text(log)
    row: dict = {"label": label, "args": " ".join(args), "process_s": round(time.perf_counter() - start, 1)}
    summary = out / "summary.json"
    if rc == 0 and summary.exists():
        row.update(json.loads(summary.read_text()), status="ok")
    elif rc is None:
        row["status"] = f"timeout ({timeout:.0f} s)"
    elif "OutOfMemoryError" in log or "out of memory" in log:
        row["status"] = "OOM"
    else:
        row["status"] = f"error (exit {rc})"
    if row["status"] != "ok":
        row["log_tail"] = log.splitlines()[-15:]
    print({k: row.get(k) for k, _ in COLUMNS}, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h200-32k")
    parser.add_argument("--steps", type=int, default=None, help="steps of the preset's run (default: the preset's)")
    parser.add_argument("--sweep", type=int, nargs="*", default=None, help="row lengths of the ours-vs-dense sweep")
    parser.add_argument("--sweep-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds per demo process")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all runs: a run gets what is left")
    parser.add_argument("--run-dir", default="runs/demo_runs")
    parser.add_argument("--out-dir", default=None, help="report folder (default benchmarks/results)")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    deadline = time.monotonic() + (args.budget if args.budget is not None else float("inf"))

    def timeout() -> float:
        return min(args.timeout, deadline - time.monotonic())

    header = machine_header()
    rows: list[dict] = []
    if args.sweep is None:
        name = args.name or f"demo_{args.preset.replace('-', '_')}"
        extra = [] if args.steps is None else ["--steps", str(args.steps)]
        rows.append(run_demo(f"{args.preset} (ours)", ["--preset", args.preset, *extra], run_dir / name, timeout()))
        notes = (
            f"`longtrain demo --preset {args.preset}` on its defaults"
            + ("" if args.steps is None else f" with --steps {args.steps}")
            + " (prewarm and the step-1 parity check on); wall s includes process start, model build, prewarm and "
            "the parity run. Steady state = steps 2..N."
        )
    else:
        name = args.name or f"demo_sweep_{args.preset.replace('-', '_')}"
        paths = [("plain PyTorch", ["--attn-backend", "dense", "--dsa-backend", "torch"]), ("ours", [])]
        fits = list(args.sweep)
        for label, backend_args in paths:
            for seq_len in fits if label == "ours" else args.sweep:
                demo_args = ["--preset", args.preset, "--seq-len", str(seq_len), "--steps", str(args.sweep_steps),
                             "--no-prewarm", "--no-parity", *backend_args]  # fmt: skip
                out = run_dir / f"{name}_{label.replace(' ', '_')}_{seq_len}"
                row = run_demo(label, demo_args, out, timeout())
                row.setdefault("seq_len", seq_len)
                rows.append(row)
                if row["status"] != "ok":
                    if label == "plain PyTorch":  # ours runs at the lengths the plain path fits
                        fits = [length for length in args.sweep if length < seq_len]
                    break
        notes = (
            f"`longtrain demo --preset {args.preset} --seq-len L --steps {args.sweep_steps} --no-prewarm --no-parity`"
            ", ours with the preset's backends (auto), plain PyTorch with `--attn-backend dense --dsa-backend torch` "
            "(one masked SDPA per GQA layer; the chunked reference indexer and gather-based sparse MLA); one process "
            "per run; the plain path's sweep stops at its first run that fails, ours runs at the lengths the plain "
            "path fitted. Steady state = steps 2..N."
        )
    md, js = write_report(name, rows, COLUMNS, notes, header=header, out_dir=args.out_dir,
                          title=f"longtrain demo runs ({args.preset})")  # fmt: skip
    if args.sweep is None and rows[0]["status"] == "ok":
        for src in ("summary.json", "metrics.jsonl", "loss_curve.png"):
            shutil.copy(run_dir / name / src, md.with_name(f"{md.stem}_{src}"))
    print(f"wrote {md} and {js}")
    return 0 if all(r["status"] == "ok" or args.sweep is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
