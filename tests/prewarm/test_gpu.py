"""GPU checks of the prewarm contract (skipped without CUDA): cuBLAS warmup, RNG, released memory, the report."""

from __future__ import annotations

import pytest
import torch

import longtrain.prewarm as prewarm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU test of the prewarm contract)"),
]


def _rng_states(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.get_rng_state().clone(), torch.cuda.get_rng_state(index).clone()


@pytest.mark.parametrize("device", [0, "cuda", "cuda:0", torch.device("cuda", 0)], ids=str)
def test_cublas_backward_runs_rng_neutral_and_releases_memory(device):
    # cuBLAS workspaces come from the caching allocator and persist (that is the point): after a first warmup,
    # a second one must leave memory_allocated exactly where it was (nothing transient survives).
    prewarm._prewarm_cublas_backward(0)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(0)
    cpu, cuda = _rng_states(0)
    assert prewarm._prewarm_cublas_backward(device) is True
    cpu_after, cuda_after = _rng_states(0)
    assert torch.equal(cpu, cpu_after) and torch.equal(cuda, cuda_after)
    assert torch.cuda.memory_allocated(0) == allocated


def test_report_has_memory_snapshots_and_apply_is_rng_neutral():
    prewarm._prewarm_cublas_backward(0)  # workspaces exist: the report's step must then be memory-neutral
    cpu, cuda = _rng_states(0)
    report = prewarm.run_prewarms(prewarm.PrewarmConfig(cublas_backward=True), [], 0)
    assert report.ran == ["cublas_backward"]
    step = report.step("cublas_backward")
    assert step.memory_before is not None and step.memory_after is not None
    assert step.memory_after.allocated == step.memory_before.allocated
    assert step.memory_after.device_total > 0
    assert "outside allocator" in report.format()
    prewarm.PrewarmConfig(cublas_backward=True, fla_gdn_autotune=True, mamba_ssd_autotune=True).apply([], 0)
    cpu_after, cuda_after = _rng_states(0)
    assert torch.equal(cpu, cpu_after) and torch.equal(cuda, cuda_after)
