"""``benchmarks/cp_imbalance.py`` on CPU: a contiguous row and one balanced row per ``--chunks`` value for every
layout and world size, one varlen call per rank, the planner's work ratio and the exchange sizes; no timing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("_bench_cp_imbalance", BENCH / "cp_imbalance.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_rows_per_layout_world_and_chunk(tmp_path):
    module = _script()
    argv = ["--worlds", "2", "4", "--tokens", "8192", "--chunks", "128", "512", "--out-dir", str(tmp_path)]
    assert module.main(argv) == 0
    (report,) = tmp_path.glob("cp_imbalance_*.json")
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == 3 * 2 * 3  # layouts x worlds x (contiguous + two chunks)
    assert [(r["sharding"], r["chunk"]) for r in rows[:3]] == [
        ("contiguous", "-"),
        ("balanced", 128),
        ("balanced", 512),
    ]
    for r in rows:
        assert r["calls_max"] <= 1 and r["work_max_over_mean"] >= 1.0
        assert r["kv_recv_a2a_max"] <= r["kv_recv_allgather"] == 8192 - 8192 // r["W"]
    one_doc_w4 = [r for r in rows if r["docs"].startswith("one document") and r["W"] == 4]
    assert one_doc_w4[0]["work_max_over_mean"] > 1.5 and one_doc_w4[1]["work_max_over_mean"] < 1.01
    # one document: a contiguous rank holds one run of it, a balanced (head-tail) rank at most two
    assert [r["segments_max"] for r in one_doc_w4] == [1, 2, 2]
    assert all(r["segments_max"] >= 1 for r in rows)


def test_whole_first_rows_are_valid_plans_with_fewer_segments(tmp_path):
    """``--whole-first`` adds the planner experiment's rows: same exchange sizes and invariants, and on the long
    documents of a 32K row over 2 ranks far fewer query segments than the default balanced plan."""
    module = _script()
    argv = ["--worlds", "2", "--tokens", "32768", "--chunks", "128", "--whole-first", "--out-dir", str(tmp_path)]
    assert module.main(argv) == 0
    (report,) = tmp_path.glob("cp_imbalance_*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [r["sharding"] for r in rows[:3]] == ["contiguous", "balanced", "balanced (whole-first)"]
    by = {(r["docs"].split(" ")[0], r["sharding"]): r for r in rows}
    long_default, long_first = by[("U[512,8192]", "balanced")], by[("U[512,8192]", "balanced (whole-first)")]
    assert long_first["segments_max"] < long_default["segments_max"] / 2
    assert long_first["kv_recv_a2a_max"] < long_default["kv_recv_a2a_max"] / 4
    assert long_first["work_max_over_mean"] <= 1.01
