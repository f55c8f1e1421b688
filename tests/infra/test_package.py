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
