"""The examples under ``examples/`` run as their headers say (CPU, gloo ranks): Hugging Face and torchtitan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_hf_llama_packed_cp_runs_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "hf_llama_packed_cp.py")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "step 2 loss" in res.stdout


def test_hf_glm_dsa_runs(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, str(EXAMPLES / "hf_glm_dsa.py")], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    assert "equal transformers' eager model" in res.stdout and "step 2 loss" in res.stdout


def test_torchtitan_llama_cp_runs_on_two_ranks(tmp_path):
    pytest.importorskip("torchtitan.models.llama3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "torchtitan_llama_cp.py")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "step 2 loss" in res.stdout
