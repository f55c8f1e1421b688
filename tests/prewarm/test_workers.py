"""cuBLAS, Mamba SSD and DSA prewarms and the shared helpers (CPU, stub modules)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from torch import nn

import longtrain.prewarm as prewarm
from tests.prewarm import fakes


@pytest.fixture
def cpu_device(monkeypatch):
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- helpers


def test_safe_import_semantics(monkeypatch, caplog):
    ok, mod = prewarm.safe_import("longtrain_no_such_module_xyz")
    assert ok is False and not mod
    with pytest.raises(ImportError, match="unavailable"):
        mod.anything  # noqa: B018 - the placeholder raises on use
    ok, value = prewarm.safe_import_from("math", "pi")
    assert ok and value == pytest.approx(3.14159, abs=1e-5)
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        ok, missing = prewarm.safe_import_from("math", "no_such_symbol")
    assert ok is False and "has no attribute no_such_symbol" in caplog.text

    broken = types.ModuleType("longtrain_broken_mod")

    def explode(name):
        raise RuntimeError("CUDA driver init failed")

    broken.__getattr__ = explode  # a module whose attribute access raises something other than AttributeError
    monkeypatch.setitem(sys.modules, "longtrain_broken_mod", broken)
    with pytest.raises(RuntimeError, match="CUDA driver init failed"):
        prewarm.safe_import_from("longtrain_broken_mod", "x")


def test_resolve_cuda_device_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._resolve_cuda_device(None, "X") is None
        assert prewarm._resolve_cuda_device("cpu", "X") is None
        if not torch.cuda.is_available():
            assert prewarm._resolve_cuda_device(3, "X") is None
            assert prewarm._resolve_cuda_device("cuda", "X") is None
    assert "Skipping X prewarm: no device assigned." in caplog.text
    assert "Skipping X prewarm: device=cpu cuda_available=" in caplog.text
    with pytest.raises(RuntimeError):
        prewarm._resolve_cuda_device("not-a-device", "X")
    with pytest.raises(TypeError, match="bool"):
        prewarm._resolve_cuda_device(True, "X")
    assert not torch.cuda.is_initialized() or torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- cuBLAS


@pytest.mark.parametrize("device", [None, "cpu", 0, "cuda:1"], ids=str)
def test_cublas_skips_without_cuda(device, caplog):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    before = fakes.rng_state()
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_cublas_backward(device) is False
    assert "Skipping cuBLAS backward prewarm" in caplog.text
    assert torch.equal(before, fakes.rng_state())


def test_cublas_failure_is_logged_and_returns_false(monkeypatch, caplog):
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))
    before = fakes.rng_state()
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        # on the CPU device the warmup's torch.cuda.synchronize fails after drawing random numbers
        assert prewarm._prewarm_cublas_backward("cpu", size=4) is False
    assert "Skipping cuBLAS backward prewarm after failure." in caplog.text
    assert torch.equal(before, fakes.rng_state())


# ---------------------------------------------------------------------------------------------- Mamba SSD


def test_mamba_protocols_and_collection(caplog):
    assert isinstance(fakes.ToyMamba(), prewarm._MambaSSDMixer)
    no_cp = fakes.ToyMamba()
    del no_cp.cp
    assert not isinstance(no_cp, prewarm._MambaSSDMixer)
    assert isinstance(fakes.ToyCP(4, 2), prewarm._MambaSSDContextParallel)

    cp_mixer = fakes.ToyMamba(heads=8, groups=4, cp=fakes.ToyCP(4, 2))  # global 8/4, local 4/2
    plain = fakes.ToyMamba(heads=4, groups=2)  # same local geometry: deduplicated
    odd = fakes.ToyMamba(cp=types.SimpleNamespace(heads=1))
    other = fakes.ToyMamba(heads=6, head_dim=64, state=128, groups=1, chunk=256, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="longtrain.prewarm"):
        shapes = prewarm._collect_mamba_ssd_autotune_shapes([nn.ModuleList([cp_mixer, plain, odd, other])])
    assert list(shapes.items()) == [
        ((4, 16, 32, 2, 16, torch.bfloat16), "0"),
        ((6, 64, 128, 1, 256, torch.float32), "3"),
    ]
    assert "Skipping Mamba SSD prewarm for 2: unrecognized context-parallel geometry." in caplog.text


def test_mamba_end_to_end_with_and_without_seq_idx(monkeypatch):
    op = fakes.MambaOpStub()
    fakes.install_modules(monkeypatch, {"mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": op}})
    shapes = {(4, 16, 32, 2, 16, torch.bfloat16): "mixer"}
    before = fakes.rng_state()
    with torch.no_grad():
        assert prewarm._prewarm_mamba_ssd_end_to_end(shapes, torch.device("cpu"))
    assert torch.equal(before, fakes.rng_state())
    with_idx, without = op.calls
    assert with_idx["x"] == (1, 32, 4, 16) and with_idx["B"] == (1, 32, 2, 32) and with_idx["chunk_size"] == 16
    assert with_idx["seq_idx"] == ((1, 32), torch.int32) and without["seq_idx"] is None
    assert with_idx["z"] is None and with_idx["dt_softplus"] is True
    assert with_idx["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16) + (torch.float32,) * 2
    assert with_idx["grad_enabled"] and without["grad_enabled"]


def test_mamba_failures_are_isolated_and_rng_restored(monkeypatch, caplog):
    op = fakes.MambaOpStub(fail=True)
    fakes.install_modules(monkeypatch, {"mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": op}})
    before = fakes.rng_state()
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        ran = prewarm._prewarm_mamba_ssd_end_to_end({(4, 16, 32, 2, 16, torch.float32): "m"}, torch.device("cpu"))
    assert ran is False and len(op.calls) == 2
    assert torch.equal(before, fakes.rng_state())
    assert caplog.text.count("Mamba SSD end-to-end prewarm") == 2


def test_mamba_not_importable(caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert not prewarm._prewarm_mamba_ssd_end_to_end({(1, 1, 1, 1, 1, torch.float32): "m"}, torch.device("cpu"))
    assert "mamba_ssm SSD operators are not importable" in caplog.text


def test_mamba_autotune_flow(monkeypatch, cpu_device, caplog):
    op = fakes.MambaOpStub()
    fakes.install_modules(monkeypatch, {"mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": op}})
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_mamba_ssd_autotune([fakes.ToyModel()], "cuda")
        assert not prewarm._prewarm_mamba_ssd_autotune([nn.Linear(2, 2)], "cuda")
    assert len(op.calls) == 2
    assert "Prewarming Mamba SSD autotune caches for 1 unique shape(s)" in caplog.text
    assert "no Mamba SSD mixer modules were found" in caplog.text


# ---------------------------------------------------------------------------------------------- DSA


def test_dsa_collection_dedupes_and_validates():
    model = nn.ModuleList([fakes.ToyDSA(4), fakes.ToyDSA(4), fakes.ToyDSA(8, torch.float16)])
    shapes = prewarm._collect_dsa_autotune_shapes([model])
    assert list(shapes.items()) == [
        ((4, 576, 512, 2048, 32, 128, torch.bfloat16), "0"),
        ((8, 576, 512, 2048, 32, 128, torch.float16), "2"),
    ]
    bad = fakes.ToyDSA()
    bad.dsa_autotune_shape = lambda: {"num_heads": 4}
    with pytest.raises(ValueError, match="missing"):
        prewarm._collect_dsa_autotune_shapes([bad])
    bad.dsa_autotune_shape = lambda: {**fakes.ToyDSA().dsa_autotune_shape(), "topk": 0}
    with pytest.raises(ValueError, match="'topk'"):
        prewarm._collect_dsa_autotune_shapes([bad])
    bad.dsa_autotune_shape = lambda: {**fakes.ToyDSA().dsa_autotune_shape(), "dtype": "bf16"}
    with pytest.raises(TypeError, match="torch.dtype"):
        prewarm._collect_dsa_autotune_shapes([bad])


def test_dsa_warmup_called_per_unique_shape(monkeypatch, cpu_device, caplog):
    calls = []

    def warmup(**kwargs):
        calls.append(kwargs)
        if kwargs["num_heads"] == 8:
            raise RuntimeError("dsa kernel failure")

    fakes.install_fake_triton(monkeypatch)
    fakes.install_modules(monkeypatch, {"longtrain.dsa.triton": {"warmup": warmup}})
    model = nn.ModuleList([fakes.ToyDSA(8), fakes.ToyDSA(4), fakes.ToyDSA(4)])
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        assert prewarm._prewarm_dsa_autotune([model], "cuda")
    assert [c["num_heads"] for c in calls] == [8, 4]
    assert set(calls[1]) == {"num_heads", "d_qk", "d_v", "topk", "index_heads", "index_dim", "dtype", "device"}
    assert "DSA autotune prewarm failed for 0; continuing." in caplog.text


def test_dsa_skips_when_warmup_or_triton_missing(monkeypatch, cpu_device, caplog):
    fakes.install_fake_triton(monkeypatch)
    fakes.install_modules(monkeypatch, {"longtrain.dsa.triton": {}})
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert not prewarm._prewarm_dsa_autotune([fakes.ToyDSA()], "cuda")
        monkeypatch.setattr(prewarm, "safe_import", lambda name: (False, None))
        assert not prewarm._prewarm_dsa_autotune([fakes.ToyDSA()], "cuda")
        assert not prewarm._prewarm_dsa_autotune([nn.Linear(2, 2)], "cuda")
    assert "longtrain.dsa.triton.warmup is not available" in caplog.text
    assert "triton is not importable" in caplog.text
    assert "no module exposes dsa_autotune_shape()" in caplog.text


@pytest.mark.parametrize(
    ("worker", "label"),
    [("_prewarm_mamba_ssd_autotune", "Mamba SSD autotune"), ("_prewarm_dsa_autotune", "DSA autotune")],
)
def test_model_workers_on_cpu_skip(worker, label, caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert getattr(prewarm, worker)([fakes.ToyModel()], "cpu") is False
    assert f"Skipping {label} prewarm: device=cpu" in caplog.text
