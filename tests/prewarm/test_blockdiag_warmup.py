"""The ``blockdiag_autotune`` prewarm and ``longtrain.blockdiag_cp.warmup.warmup`` (CPU: the reference backend)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from longtrain import prewarm
from longtrain.blockdiag_cp import configure_cp_varlen
from longtrain.blockdiag_cp.warmup import warmup
from longtrain.models import TinyLM, TinyLMConfig


class ToyAttention(nn.Module):
    def __init__(self, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32):
        super().__init__()
        self.shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)

    def blockdiag_attention_shape(self):
        return dict(self.shape)


@pytest.fixture
def cpu_device(monkeypatch):
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))


def test_warmup_runs_both_layouts_on_the_reference_backend():
    result = warmup(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", num_tokens=16)
    assert result["backend"] == "reference" and result["layouts"] == 2
    assert result["finite"] and not result["fell_back"]
    dense = warmup(num_heads=4, num_kv_heads=4, head_dim=8, dtype=torch.float32, device="cpu", backend="dense")
    assert dense["fell_back"]  # "dense" is not a varlen backend: the layer would take the dense path


def test_warmup_uses_the_configured_backend():
    previous = configure_cp_varlen(attn_backend="reference")
    try:
        assert warmup(num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float64, device="cpu")["backend"] == (
            "reference"
        )
    finally:
        configure_cp_varlen(**previous)


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(head_dim=0), ValueError, "head_dim must be a positive int"),
        (dict(dtype=torch.int32), TypeError, "floating torch.dtype"),
        (dict(num_tokens=4), ValueError, "num_tokens must be an int >= 8"),
    ],
)
def test_warmup_validates(changes, exc, match):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu") | changes
    with pytest.raises(exc, match=match):
        warmup(**args)


def test_collection_dedupes_and_validates():
    model = nn.ModuleList([ToyAttention(), ToyAttention(), ToyAttention(8, 8, 32, torch.bfloat16)])
    assert list(prewarm._collect_blockdiag_attention_shapes([model]).items()) == [
        ((4, 2, 16, torch.float32), "0"),
        ((8, 8, 32, torch.bfloat16), "2"),
    ]
    bad = ToyAttention()
    bad.shape["head_dim"] = 0
    with pytest.raises(ValueError, match="'head_dim'"):
        prewarm._collect_blockdiag_attention_shapes([bad])
    bad.shape = {"num_heads": 4}
    with pytest.raises(ValueError, match="missing"):
        prewarm._collect_blockdiag_attention_shapes([bad])


def test_the_demo_model_exposes_its_attention_shape():
    cfg = TinyLMConfig(layers="GG")
    shapes = prewarm._collect_blockdiag_attention_shapes([TinyLM(cfg)])
    assert list(shapes) == [(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)]


def test_worker_warms_every_unique_shape_and_isolates_failures(cpu_device, caplog):
    model = nn.ModuleList([ToyAttention(4, 3), ToyAttention(), ToyAttention()])  # 4 % 3: that warmup raises
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_blockdiag_autotune([model], "cuda")
    assert "blockdiag autotune prewarm failed for 0; continuing." in caplog.text
    assert "Block-diagonal attention warmed: {'backend': 'reference'" in caplog.text


def test_worker_skips(cpu_device, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert not prewarm._prewarm_blockdiag_autotune([nn.Linear(2, 2)], "cuda")
        monkeypatch.setattr(prewarm, "safe_import_from", lambda module, name: (False, None))
        assert not prewarm._prewarm_blockdiag_autotune([ToyAttention()], "cuda")
    assert "no module exposes blockdiag_attention_shape()" in caplog.text
    assert "longtrain.blockdiag_cp.warmup is not available" in caplog.text


def test_worker_on_cpu_skips(caplog):
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_blockdiag_autotune([ToyAttention()], "cpu") is False
    assert "Skipping block-diagonal attention autotune prewarm: device=cpu" in caplog.text


def _raise_launch_failure(*args, **kwargs):
    raise RuntimeError("simulated kernel launch failure")


def test_backend_that_raises_on_every_pass_is_reported_failed_not_ran(cpu_device, monkeypatch, caplog):
    # warmup() swallows a backend's exception (a training step falls back to the dense path), so nothing was
    # compiled or tuned: the prewarm must not report "ran".
    monkeypatch.setattr("longtrain.blockdiag_cp.warmup.attend", _raise_launch_failure)
    previous = configure_cp_varlen(attn_backend="reference")
    try:
        with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
            report = prewarm.run_prewarms(prewarm.PrewarmConfig(blockdiag_autotune=True), [ToyAttention()], "cuda")
    finally:
        configure_cp_varlen(**previous)
    step = report.step("blockdiag_autotune")
    assert step.status == "failed" and step.result is False and step.errors == 1
    assert "nothing was warmed" in step.reason and "dense path" in step.reason
    assert "blockdiag autotune prewarm failed for" in caplog.text  # logged at ERROR with the reason


def test_dense_backend_is_a_skip_not_a_run(cpu_device):
    previous = configure_cp_varlen(attn_backend="dense")
    try:
        report = prewarm.run_prewarms(prewarm.PrewarmConfig(blockdiag_autotune=True), [ToyAttention()], "cuda")
    finally:
        configure_cp_varlen(**previous)
    step = report.step("blockdiag_autotune")
    assert step.status == "skipped" and step.result is False
    assert "'dense'" in step.reason
