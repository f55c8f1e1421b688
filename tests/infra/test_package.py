"""Packaging contract: importing longtrain is cheap and side-effect free; probes are lazy and cached."""

from __future__ import annotations

import subprocess
import sys

from longtrain import _optional

_IMPORT_CHECK = r"""
import sys, warnings
warnings.simplefilter("error")
before = set(sys.modules)
import longtrain, longtrain._optional
{extra}
new = set(sys.modules) - before
extras = ("flash_attn", "transformer_engine", "cudnn", "flash_mla", "fla", "mamba_ssm", "triton", "yaml", "matplotlib")
bad = sorted(m for m in new if m.split(".")[0] in extras)
assert not bad, bad
import torch
assert not torch.cuda.is_initialized()
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_longtrain_imports_no_extra_and_does_not_warn():
    res = _run(_IMPORT_CHECK.format(extra=""))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_import_subpackages_imports_no_extra():
    extra = "\n".join(
        f"import {m}"
        for m in ("longtrain.blockdiag_cp", "longtrain.dsa", "longtrain.prewarm", "longtrain.cli")
        if _module_exists(m)
    )
    res = _run(_IMPORT_CHECK.format(extra=extra))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def _module_exists(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_probes_return_reason_and_are_cached(monkeypatch):
    _optional.reset_probe_cache()
    ok, reason = _optional.flash_attn()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not ok:
        assert "flash" in reason
    calls = []
    real = _optional._spec
    monkeypatch.setattr(_optional, "_spec", lambda name: calls.append(name) or real(name))
    _optional.flash_attn()
    assert calls == []  # cached
    _optional.reset_probe_cache()
    _optional.flash_attn()
    assert calls  # recomputed after reset


def test_missing_package_reason_names_the_install(monkeypatch):
    _optional.reset_probe_cache()
    monkeypatch.setattr(_optional, "_spec", lambda name: False)
    ok, reason = _optional.mamba_ssm()
    assert not ok and "not installed" in reason and "pip install mamba-ssm" in reason
    _optional.reset_probe_cache()


def test_cuda_probe_reason_on_cpu():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    ok, reason = _optional.cuda_sm(9, 0)
    assert not ok and "SM90+" in reason


def test_wheel_ships_the_bench_suites_and_bench_runs_them_from_the_install(tmp_path):
    """``pip install .`` (not editable) carries what ``longtrain bench`` runs: the suites, their report writer and
    ``anchors.json``; installed away from the checkout, bench resolves them from the install. Builds from a copy of
    the tree (the checkout's own ``build/`` may hold stale files); about 3 s."""
    import importlib.util
    import os
    import shutil
    import zipfile
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (the wheel is built with --no-build-isolation)")
    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    shutil.copytree(root / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, tree / name)

    def pip(command: str, *args: str) -> None:
        cmd = [sys.executable, "-m", "pip", command, "-q", "--disable-pip-version-check", "--no-deps", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr

    pip("wheel", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(tree))
    (wheel,) = (tmp_path / "dist").glob("longtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    suites = [f"longtrain/bench_suites/{m}" for m in ("__init__.py", "report.py", "anchors.json")]
    suites += [f"longtrain/bench_suites/{m}.py" for m in ("blockdiag_attention", "dsa", "prewarm")]
    assert set(suites) <= names, sorted(set(suites) - names)

    site = tmp_path / "site"
    pip("install", "--no-index", "--no-compile", "--target", str(site), str(wheel))
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of the checkout that an editable install puts on the path
    work = tmp_path / "elsewhere"
    work.mkdir()

    def longtrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "longtrain.cli", *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=work)  # fmt: skip

    where = subprocess.run([sys.executable, "-c", "import longtrain.bench as b; print(b.suite_path('dsa'), "
                            "b.anchors_path(), len(b.load_anchors()))"], capture_output=True, text=True, timeout=120,
                           env=env, cwd=work)  # fmt: skip
    assert where.returncode == 0, where.stderr
    installed = site / "longtrain" / "bench_suites"
    assert where.stdout.split() == [str(installed / "dsa.py"), str(installed / "anchors.json"), "2"]
    res = longtrain("bench", "--help")
    assert res.returncode == 0 and "suites to run" in res.stdout, res.stderr
    res = longtrain("bench", "nope")
    assert res.returncode == 2 and "unknown suite" in res.stderr
    import torch

    if not torch.cuda.is_available():
        res = longtrain("bench")
        assert res.returncode == 0 and "need a CUDA device" in res.stdout, res.stderr
        assert f"  prewarm: {installed / 'prewarm.py'}" in res.stdout
