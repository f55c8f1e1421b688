"""The multi-GPU scaling script runs end to end on CPU ranks (gloo) and its parity rows pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cp_scaling.py"


def test_cp_scaling_smoke_on_gloo(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--device",
        "cpu",
        "--quick",
        "--dsa",
        "--out-dir",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    (report,) = tmp_path.glob("cp_scaling_2ranks_*.json")
    rows = json.loads(report.read_text())["rows"]
    parity = [r for r in rows if r["section"] == "parity"]
    assert len(parity) == 12 and all(r["ok"] for r in parity)  # 4 layouts x 3 exchanges
    scaling = [r for r in rows if r["section"] == "scaling"]
    assert {r["exchange"] for r in scaling} == {"allgather", "halo", "a2a"}
    assert all(r["fwd_bwd_tflops_per_gpu"] > 0 and r["kept_fwd_bwd"] > 0 for r in scaling)
    assert [r["section"] for r in rows].count("dsa") == 1
