"""Every README and docs/ code block marked ``# run: <launcher>`` runs as shown (the examples are the documentation)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PATTERN = r"```python\n(# run: ([^\n]+)\n.*?)```"
BLOCKS = re.findall(PATTERN, README.read_text(), flags=re.S)
DOC_BLOCKS = [
    (doc.stem, code, launcher)
    for doc in sorted((ROOT / "docs").glob("*.md"))
    for code, launcher in re.findall(PATTERN, doc.read_text(), flags=re.S)
]


def test_readme_has_runnable_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize(
    "code, launcher", [b[1:] for b in DOC_BLOCKS], ids=[f"{name}{i}" for i, (name, *_) in enumerate(DOC_BLOCKS)]
)
def test_docs_block_runs(code, launcher, tmp_path):
    test_readme_block_runs(code, launcher, tmp_path)


@pytest.mark.parametrize("code, launcher", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, launcher, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    if launcher.startswith("torchrun"):
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher.split()[1:], str(script)]
    elif launcher == "python":
        cmd = [sys.executable, str(script)]
    else:
        raise AssertionError(f"unknown launcher {launcher!r}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the examples run as a user would run them
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
