"""The ``longtrain`` command: doctor lists every backend with a reason; bench degrades cleanly without CUDA and
finds its suites in the package (the wheel's copy: ``tests/infra/test_package.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longtrain
from longtrain import bench, cli

LONGTRAIN = [sys.executable, "-m", "longtrain.cli"]
ROOT = Path(__file__).resolve().parents[1]


def test_doctor_lists_every_module_backend_with_reasons():
    res = subprocess.run(LONGTRAIN + ["doctor"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for module in ("blockdiag_cp", "dsa", "prewarm"):
        assert module in out
    for backend in ("flash", "te", "flex", "reference", "cudnn", "triton", "torch", "cublas_backward", "comm_groups"):
        assert backend in out
    rows = cli.doctor_rows()
    assert rows and all(avail in ("yes", "no", "auto") for _, _, avail, _ in rows)
    # Every unavailable backend says why, and every auto choice which table row it follows.
    assert all(reason for _, _, avail, reason in rows if avail in ("no", "auto"))
    assert [b.split(" -> ")[0] for m, b, avail, _ in rows if avail == "auto"] == [
        "auto sparse_mla fwd", "auto sparse_mla bwd", "auto indexer_topk", "auto indexer_topk fp8=True"
    ]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_without_cuda_says_what_it_needs_and_lists_the_suites(capsys):
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "need a CUDA device" in out
    for suite in bench.SUITES:
        assert f"  {suite}: {bench.suite_path(suite)}" in out


def test_bench_unknown_suite_is_an_error(capsys):
    assert cli.main(["bench", "blockdiag", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite(s) ['nope']" in err and "'blockdiag', 'dsa', 'prewarm'" in err


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "inf"])
def test_bench_bad_timeout_is_an_error_before_any_suite(capsys, timeout):
    assert cli.main(["bench", f"--timeout={timeout}"]) == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_bench_out_that_is_a_file_is_an_error_before_any_suite(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    assert cli.main(["bench", "--out", str(tmp_path / "taken")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


def test_bench_suites_resolve_to_the_package_not_the_checkout_folder():
    package = Path(longtrain.__file__).resolve().parent / "bench_suites"
    for suite, (module, _, _) in bench.SUITES.items():
        assert bench.suite_path(suite) == package / f"{module}.py", suite
    assert bench.anchors_path() == package / "anchors.json" and bench.anchors_path().is_file()
    with pytest.raises(ValueError, match="unknown suite 'nope'; valid: \\['blockdiag'"):
        bench.suite_path("nope")


@pytest.mark.parametrize("script", ["blockdiag_attention", "dsa", "prewarm"])
def test_checkout_benchmark_scripts_are_entry_points_to_the_suites(script):
    """``python benchmarks/<suite>.py`` (README, benchmarks/README.md) runs the package's module; the other scripts
    of that folder import the suite's names through it."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.startswith("usage:"), res.stderr


def test_bench_runs_a_suite_as_a_module_and_combines_its_report(tmp_path, monkeypatch, capsys):
    """The runner end to end on any machine: the prewarm suite with no time budget starts no child and still writes
    its report, which bench copies to --out and combines (CUDA is claimed for this process only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(bench.SUITES, "prewarm", ("prewarm", "--out", ("--budget-s", "0")))
    assert cli.main(["bench", "prewarm", "--out", str(tmp_path)]) == 0
    assert "-m longtrain.bench_suites.prewarm --out" in capsys.readouterr().out
    assert len(list(tmp_path.glob("prewarm_*.json"))) == 1
    (md,) = tmp_path.glob("bench_*.md")
    assert "## prewarm" in md.read_text()


def test_combine_reports_writes_markdown_json_and_chart(tmp_path):
    reports = [
        {
            "name": "blockdiag_attention",
            "header": {"gpu": "test"},
            "columns": [["backend", "backend"], ["fwd_tflops", "fwd TFLOP/s"], ["bwd_tflops", "bwd TFLOP/s"]],
            "rows": [{"backend": "flash", "fwd_tflops": 311.0, "bwd_tflops": 286.0}, {"backend": "dense"}],
            "notes": "a note",
        },
        {"name": "prewarm", "header": {}, "columns": ["mode", "autotune runs"], "rows": [{"mode": "on"}]},
    ]
    md, js, png = bench.combine_reports(reports, tmp_path)
    text = md.read_text()
    assert "| flash | 311.0 | 286.0 |" in text and "| dense | - | - |" in text and "a note" in text
    assert json.loads(js.read_text())["reports"][0]["rows"][0]["backend"] == "flash"
    assert png is not None and png.stat().st_size > 1000


def test_bench_report_on_a_committed_run(tmp_path):
    """The combiner on a fixed JSON (the committed H200 run): one panel per layout with every backend named, forward
    and backward side by side, the anchors as lines, and the headline ratio first in the markdown."""
    report = json.loads((ROOT / "benchmarks/results/blockdiag_attention_isolation_2026-12-01.json").read_text())
    groups = bench.backend_groups(report)
    assert len(groups) == 2 and all(len(rows) == len(report["rows"]) // 2 for rows in groups.values())
    names = [name for name, _, _ in next(iter(groups.values()))]
    assert "cp_varlen_attention (W=1 step, auto)" in names and "flex (compiled, block mask)" in names
    anchors = bench.load_anchors()
    assert {"blockdiag_attention", "dsa"} <= set(anchors)
    md, js, png = bench.combine_reports([report], tmp_path, anchors=anchors)
    text = md.read_text()
    first = text.split("\n## ")[0]
    assert "Ours against the best other backend" in first and first.count("x**") == 4  # 2 layouts x fwd/bwd
    assert "FA3 varlen causal-document" in text
    assert png is not None and png.stat().st_size > 20000


def test_reproduce_args_drop_the_machine_local_out_dir():
    """A report's reproduce line keeps a script's arguments but not ``--out-dir DIR`` (a path on the GPU machine)."""
    from longtrain.bench_suites.report import reproduce_args

    argv = ["--rounds", "2", "--out-dir", "/root/out/s", "--case", "16384,64,2048", "--out-dir=/x", "--ws"]
    assert reproduce_args(argv) == "--rounds 2 --case 16384,64,2048 --ws"
    assert reproduce_args([]) == ""
