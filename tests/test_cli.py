"""The ``longtrain`` command: doctor lists every backend with a reason; bench degrades cleanly without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from longtrain import bench, cli

LONGTRAIN = [sys.executable, "-m", "longtrain.cli"]


def test_doctor_lists_every_module_backend_with_reasons():
    res = subprocess.run(LONGTRAIN + ["doctor"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for module in ("blockdiag_cp", "dsa", "prewarm"):
        assert module in out
    for backend in ("flash", "te", "flex", "reference", "cudnn", "triton", "torch", "cublas_backward", "comm_groups"):
        assert backend in out
    rows = cli.doctor_rows()
    assert rows and all(avail in ("yes", "no") for _, _, avail, _ in rows)
    # Every unavailable backend says why.
    assert all(reason for _, _, avail, reason in rows if avail == "no")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_without_cuda_says_what_it_needs():
    res = subprocess.run(LONGTRAIN + ["bench"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    assert "need a CUDA device" in res.stdout


def test_bench_unknown_suite_is_an_error():
    res = subprocess.run(LONGTRAIN + ["bench", "nope"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown suite" in res.stderr


def test_bench_finds_every_suite_script():
    bench_dir = bench.find_benchmarks_dir()
    assert bench_dir is not None
    for script, _, _ in bench.SUITES.values():
        assert (bench_dir / script).is_file(), script


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
