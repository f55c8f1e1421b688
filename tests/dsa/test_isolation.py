"""Non-finite values in sparse MLA: ignored slots contribute nothing whatever the key row they would point to holds
(every backend that runs here: torch, and the Triton kernels under the interpreter), a document's NaN never reaches
another document through ``DSAAttention``, and non-finite sinks (+inf: zero rows and zero gradient, -inf: no sink,
NaN: visible) behave the same in every backend."""

from __future__ import annotations

import pytest
import torch

from longtrain.dsa import DSAAttention, DSAConfig
from longtrain.dsa.ops import sparse_mla_attention

NAN = float("nan")


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 4, 32, generator=g, dtype=dtype)
    kv = torch.randn(6, 1, 32, generator=g, dtype=dtype)
    # row 0 sees key 0; rows 1..4 see two keys and a -1 slot; row 5 sees nothing at all
    idx = torch.tensor([[0, -1, -1], [1, 2, -1], [1, 3, -1], [2, 4, -1], [3, 4, -1], [-1, -1, -1]], dtype=torch.int32)
    return q, kv, idx


def _run(backend, q, kv, idx, sink=None):
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    leaves = [q, kv]
    if sink is not None:
        sink = sink.detach().requires_grad_()
        leaves.append(sink)
    out = sparse_mla_attention(q, kv, idx, 0.3, d_v=16, attn_sink=sink, backend=backend)
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    return [out.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))]


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "triton":
        request.getfixturevalue("triton_interpret")
        from longtrain.dsa import triton as dsa_triton  # noqa: F401

    return request.param


@pytest.mark.parametrize("row", [0, 5], ids=["kv0_clamp_target", "kv_last"])
@pytest.mark.parametrize("value", [NAN, float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_ignored_slots_contribute_nothing(backend, row, value):
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, kv, idx = _inputs(dtype)
    if row == 0:
        idx = idx.clone()
        idx[0] = torch.tensor([1, -1, -1])  # nothing selects key 0: it is only what -1 clamps to
    clean = _run(backend, q, kv, idx)
    kv_bad = kv.clone()
    kv_bad[row, 0, 5] = value
    bad = _run(backend, q, kv_bad, idx)
    for name, a, b in zip(("out", "dq"), clean[:2], bad[:2]):
        assert torch.isfinite(b).all(), f"{name}: a non-finite key that no slot selects leaked"
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    keep = torch.ones(6, dtype=torch.bool)
    keep[row] = False
    torch.testing.assert_close(bad[2][keep], clean[2][keep], rtol=0, atol=0)  # dkv of every other key
    assert torch.equal(bad[0][5], torch.zeros_like(bad[0][5]))  # the empty row stays exact zeros


def test_dsa_attention_keeps_documents_apart():
    config = DSAConfig(hidden_size=32, num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=3,
                       rope_theta=10_000.0, backend="torch")  # fmt: skip
    torch.manual_seed(0)
    layer = DSAAttention(config).double()
    cu = torch.tensor([0, 6, 11, 16], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in (6, 5, 5)])
    x = torch.randn(16, 32, dtype=torch.float64)

    def run(inp):
        inp = inp.clone().requires_grad_()
        out = layer(inp, pos, cu)
        (grad,) = torch.autograd.grad(out.sum(), inp)
        return out.detach(), grad

    clean = run(x)
    x_bad = x.clone()
    x_bad[8, 3] = NAN  # document 2
    bad = run(x_bad)
    other = torch.ones(16, dtype=torch.bool)
    other[6:11] = False
    for a, b in zip(clean, bad):
        assert torch.isfinite(b[other]).all()
        torch.testing.assert_close(b[other], a[other], rtol=1e-12, atol=1e-12)  # float64, summation order only


def test_non_finite_sinks(backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, kv, idx = _inputs(dtype, seed=1)
    base = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype)
    ref = _run(backend, q, kv, idx, base)
    no_sink = _run(backend, q, kv, idx)
    heads = torch.arange(4)
    for h, value in ((1, float("inf")), (2, NAN), (3, float("-inf"))):
        sink = base.clone()
        sink[h] = value
        out, dq, dkv, dsink = _run(backend, q, kv, idx, sink)
        others = heads != h
        torch.testing.assert_close(out[:, others], ref[0][:, others], rtol=0, atol=0)
        if value == float("inf"):  # the sink takes all the mass: zero rows, zero gradient
            assert torch.equal(out[:, h], torch.zeros_like(out[:, h])) and float(dsink[h]) == 0.0
            assert torch.equal(dq[:, h], torch.zeros_like(dq[:, h]))
        elif value != value:  # NaN: visible, never a finite wrong result
            assert bool(torch.isnan(out[:5, h]).all())
        else:  # -inf: no sink
            torch.testing.assert_close(out[:, h], no_sink[0][:, h], rtol=1e-6, atol=1e-6)
            assert float(dsink[h]) == 0.0
        assert torch.isfinite(dsink[others]).all()
