"""``longtrain.blockdiag_cp.warmup.warmup`` on a GPU: the configured backend compiles / tunes before step 1."""

from __future__ import annotations

import pytest
import torch

from longtrain.blockdiag_cp import kernels
from longtrain.blockdiag_cp.providers import cudnn
from longtrain.blockdiag_cp.warmup import warmup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["auto", "flash", "flex", "fa4"])
def test_warmup_runs_finite(backend):
    reason = kernels._varlen_backend_unavailable_reason(
        "cudnn" if backend == "auto" else backend, torch.bfloat16, torch.device("cuda")
    )
    if backend != "auto" and reason is not None:
        pytest.skip(reason)
    result = warmup(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda", backend=backend)
    assert result["finite"] and not result["fell_back"]


def test_warmup_tunes_the_graph_routes_triton_backward(monkeypatch):
    if kernels._varlen_backend_unavailable_reason("cudnn", torch.bfloat16, torch.device("cuda")) is not None:
        pytest.skip("the cudnn backend cannot run here")
    from longtrain.blockdiag_cp.providers import triton_varlen_bwd as _triton_varlen

    monkeypatch.setattr(cudnn, "ROUTE", "graph")
    warmup(num_heads=12, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16, device="cuda", backend="cudnn")
    assert any(key[:3] == (64, 12, 4) for key in _triton_varlen.tuned_configs())  # straddling rank: Triton bwd
