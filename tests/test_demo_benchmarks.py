"""The demo's recording scripts: ``benchmarks/demo_runs.py`` classifies every run (ok with its summary, OOM, timeout,
error, out of budget), stops the plain-PyTorch sweep at its first failure and runs ours only where the plain path
fitted; ``benchmarks/demo_profile.py`` profiles a one-rank run and refuses ``--cp`` > 1."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _fake_demo(monkeypatch, module, outcome):
    """Replace the demo process: ``outcome(args) -> (returncode, log)``; a 0 writes a summary.json."""
    calls = []
    real_run = subprocess.run

    def run(cmd, *a, timeout=None, **kw):
        if "demo" not in cmd:  # the report's machine header (nvidia-smi, git)
            return real_run(cmd, *a, timeout=timeout, **kw)
        args = cmd[cmd.index("demo") + 1 :]
        out = Path(args[args.index("--out") + 1])
        calls.append(args)
        rc, log = outcome(args)
        if rc is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=log)
        if rc == 0:
            seq = int(args[args.index("--seq-len") + 1]) if "--seq-len" in args else 32768
            (out / "summary.json").write_text(json.dumps({"seq_len": seq, "mean_tokens_per_s": 1.0}))
            for name in ("metrics.jsonl", "loss_curve.png"):
                (out / name).write_text("x")
        return subprocess.CompletedProcess(cmd, rc, stdout=log, stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def _rows(out_dir):
    (report,) = [p for p in Path(out_dir).glob("*.json") if not p.name.endswith("_summary.json")]
    return json.loads(report.read_text())["rows"]


def test_sweep_stops_the_plain_path_at_its_first_failure(monkeypatch, tmp_path):
    demo_runs = _load("demo_runs")

    def outcome(args):
        plain = "dense" in args
        seq = int(args[args.index("--seq-len") + 1])
        if plain and seq == 4096:
            return 1, "torch.OutOfMemoryError: CUDA out of memory"
        return 0, "ok"

    calls = _fake_demo(monkeypatch, demo_runs, outcome)
    argv = ["--sweep", "1024", "2048", "4096", "8192", "--out-dir", str(tmp_path / "r"), "--run-dir", str(tmp_path)]
    assert demo_runs.main(argv) == 0
    rows = _rows(tmp_path / "r")
    assert [(r["label"], r["seq_len"], r["status"]) for r in rows] == [
        ("plain PyTorch", 1024, "ok"),
        ("plain PyTorch", 2048, "ok"),
        ("plain PyTorch", 4096, "OOM"),
        ("ours", 1024, "ok"),
        ("ours", 2048, "ok"),
    ]
    assert all("--no-prewarm" in c and "--no-parity" in c for c in calls)
    assert rows[2]["log_tail"] == ["torch.OutOfMemoryError: CUDA out of memory"]


def test_preset_run_timeout_error_and_budget(monkeypatch, tmp_path):
    demo_runs = _load("demo_runs")
    _fake_demo(monkeypatch, demo_runs, lambda args: (0, "ok"))
    assert demo_runs.main(["--steps", "3", "--out-dir", str(tmp_path / "a"), "--run-dir", str(tmp_path)]) == 0
    (row,) = _rows(tmp_path / "a")
    assert row["status"] == "ok" and row["args"] == "--preset h200-32k --steps 3"
    for suffix in ("summary.json", "metrics.jsonl", "loss_curve.png"):  # the run's outputs beside the report
        assert len(list((tmp_path / "a").glob(f"demo_h200_32k_*_{suffix}"))) == 1

    _fake_demo(monkeypatch, demo_runs, lambda args: (None, "step 1/3"))
    assert demo_runs.main(["--out-dir", str(tmp_path / "b"), "--run-dir", str(tmp_path), "--timeout", "30"]) == 1
    assert _rows(tmp_path / "b")[0]["status"] == "timeout (30 s)"

    _fake_demo(monkeypatch, demo_runs, lambda args: (2, "longtrain demo: error: bad option"))
    assert demo_runs.main(["--out-dir", str(tmp_path / "c"), "--run-dir", str(tmp_path)]) == 1
    assert _rows(tmp_path / "c")[0]["status"] == "error (exit 2)"

    calls = _fake_demo(monkeypatch, demo_runs, lambda args: (0, "ok"))
    argv = ["--sweep", "1024", "--budget", "5", "--out-dir", str(tmp_path / "d"), "--run-dir", str(tmp_path)]
    assert demo_runs.main(argv) == 0
    assert calls == [] and _rows(tmp_path / "d")[0]["status"] == "not run (out of --budget)"


def test_demo_profile_writes_the_table_and_refuses_several_ranks(tmp_path):
    demo_profile = _load("demo_profile")
    out = tmp_path / "prof.txt"
    argv = ["--out", str(out), "--rows", "5", "--", "--preset", "tiny", "--steps", "1", "--seq-len", "256"]
    argv += ["--no-prewarm", "--no-parity", "--out", str(tmp_path / "run")]
    assert demo_profile.main(argv) == 0
    text = out.read_text()
    assert "(exit 0)" in text and "Name" in text
    with pytest.raises(SystemExit):
        demo_profile.main(["--out", str(out), "--", "--preset", "tiny", "--cp", "2"])
