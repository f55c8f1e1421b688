"""``benchmarks/dsa.py``'s cuDNN rows: each backend's forward + backward, and its backward alone as the median of
forward + backward minus the median of the forward (timing stubbed, the torch backend standing in for both)."""

from __future__ import annotations

import pytest
import torch

from longtrain import _optional
from longtrain.bench_suites import dsa as suite
from longtrain.dsa import ops

T, H, K = 6, 2, 4
PAIR_MS, FWD_MS = 10.0, 3.0


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, suite.D_QK, generator=gen)
    kv = torch.randn(T, 1, suite.D_QK, generator=gen)
    idx = torch.tensor([[min(j, t) if j <= t else -1 for j in range(K)] for t in range(T)], dtype=torch.int32)
    length = torch.tensor([min(t + 1, K) for t in range(T)], dtype=torch.int32)
    dout = torch.randn(T, H, suite.D_V, generator=gen)
    return q, kv, idx, length, dout


@pytest.fixture
def stubs(monkeypatch):
    """The torch backend for every requested backend (the names recorded) and a bench that runs the function once:
    a forward returns the output (FWD_MS), forward + backward returns None (PAIR_MS)."""
    asked = []
    real = ops.sparse_mla_attention

    def attention(*args, backend, **kwargs):
        asked.append(backend)
        return real(*args, backend="torch", **kwargs)

    def bench(fn, rep_ms=100):
        ms = PAIR_MS if fn() is None else FWD_MS
        return ms, ms - 0.5, ms + 0.5

    monkeypatch.setattr(ops, "sparse_mla_attention", attention)
    monkeypatch.setattr(suite, "bench", bench)
    monkeypatch.setattr(_optional, "flash_mla", lambda: (False, "not installed"))
    return asked


def test_both_backends_give_a_pair_row_and_a_backward_row(stubs, monkeypatch):
    monkeypatch.setattr(_optional, "cudnn_dsa", lambda: (True, ""))
    rows = []
    suite._cudnn_rows(lambda **r: rows.append(r), *_inputs(), "shape", 2e10, 7e9)
    assert stubs.count("cudnn") >= 2 and stubs.count("triton") >= 2  # each backend's pair and forward ran
    pairs = [r for r in rows if r["op"] == "sparse_mla_fwd+bwd"]
    alone = [r for r in rows if r["op"] == "sparse_mla_bwd"]
    assert [r["impl"] for r in pairs] == ["cudnn backend: our Triton fwd + cuDNN frontend bwd", "triton (ours)"]
    assert all(r["ms"] == PAIR_MS and r["tflops"] == 2e10 / PAIR_MS / 1e9 for r in pairs)
    assert [r["impl"] for r in alone] == [f"{p['impl']}: backward (forward + backward minus forward)" for p in pairs]
    assert all(r["ms"] == PAIR_MS - FWD_MS and r["tflops"] == 7e9 / (PAIR_MS - FWD_MS) / 1e9 for r in alone)


def test_without_cudnn_its_row_says_why_and_ours_still_run(stubs, monkeypatch):
    monkeypatch.setattr(_optional, "cudnn_dsa", lambda: (False, "cudnn.DSA unavailable (no cutlass.cute)"))
    rows = []
    suite._cudnn_rows(lambda **r: rows.append(r), *_inputs(), "shape", 2e10)
    assert set(stubs) == {"triton"}
    assert rows[0] == dict(op="sparse_mla_fwd+bwd", impl="cudnn backend", shape="shape",
                           note="unavailable: cudnn.DSA unavailable (no cutlass.cute)")  # fmt: skip
    assert [r["op"] for r in rows[1:]] == ["sparse_mla_fwd+bwd"]  # no backward-alone row without bwd_flops
