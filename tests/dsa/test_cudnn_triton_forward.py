"""``sparse_mla_attention(backend="cudnn")`` without FlashMLA: our Triton forward stands in, cuDNN runs the backward.

On CPU the cuDNN DSA kernels are the fakes of ``test_cudnn_dsa.py`` (the backward by autograd on the reference);
``flash_mla_style_fwd`` itself runs under the Triton interpreter in fp32 against the float64 reference. The real
kernels together run in tests/gpu/test_dsa_cudnn_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from longtrain.dsa import cudnn_dsa as cd
from longtrain.dsa import ops, routes
from longtrain.dsa import reference as ref
from tests.dsa.test_cudnn_dsa import FakeFlashMLA, _assert_bf16_close, _reference_grads, _sparse_inputs, fakes  # noqa: F401


def test_flash_mla_style_fwd_matches_the_reference(triton_interpret):
    from longtrain.dsa.triton.sparse_mla import flash_mla_style_fwd

    gen = torch.Generator().manual_seed(4)
    rows, heads, keys, d_qk, d_v = 6, 16, 9, 48, 32
    q = torch.randn(rows, heads, d_qk, generator=gen)
    kv = torch.randn(keys, 1, d_qk, generator=gen)
    idx = torch.randint(0, keys, (rows, 1, 16), generator=gen).to(torch.int32)
    idx[:, :, 5:] = -1
    length = torch.tensor([5, 3, 0, 1, 5, 2], dtype=torch.int32)
    sink = torch.full((heads,), -math.inf)
    out, max_logits, lse = flash_mla_style_fwd(q, kv, idx, 0.2, d_v=d_v, attn_sink=sink, topk_length=length)
    want_out, want_lse = ref.sparse_mla_reference(q.double(), kv.double(), idx[:, 0], 0.2, d_v=d_v, topk_length=length)
    assert max_logits is None
    # fp32 kernel (ieee dots) against float64
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    empty = length == 0
    assert torch.isposinf(lse[empty]).all() and (out[empty] == 0).all()  # FlashMLA's convention: +inf
    torch.testing.assert_close(lse[~empty].double(), want_lse[~empty], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="indexer_topk must be 0"):
        flash_mla_style_fwd(q, kv, idx, 0.2, d_v=d_v, attn_sink=None, topk_length=length, indexer_topk=8)


def test_split_path_with_a_given_forward_needs_no_flash_mla(fakes, monkeypatch):  # noqa: F811 (fixture)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", False)
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", None)
    forward = FakeFlashMLA()
    q, kv, idx = _sparse_inputs()
    lengths = torch.tensor([6, 3, 0, 1, 0], dtype=torch.int32)
    canonical = torch.where(torch.arange(idx.shape[1])[None] < lengths[:, None], idx, -1).to(torch.int32)
    out = cd._cudnn_sparse_attention_with_forward(q, kv, canonical[:, None], 0.0417, forward)
    grad = torch.randn(out.shape).bfloat16()
    out.backward(grad)
    want_out, want_dq, want_dkv = _reference_grads(q, kv, idx, 0.0417, lengths, grad)
    _assert_bf16_close(out, want_out)
    _assert_bf16_close(q.grad, want_dq)
    _assert_bf16_close(kv.grad, want_dkv)
    assert forward.calls[-1]["heads"] == 64 and forward.calls[-1]["lens"] == [6, 3, 0, 1, 0]
    assert fakes.dsa.calls[-1]["op"] == "backward" and fakes.dsa.calls[-1]["rows"] == 3
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", False)
    with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
        cd._cudnn_sparse_attention_with_forward(q, kv, canonical[:, None], 0.0417, forward)


def test_ops_cudnn_backend_uses_the_triton_forward_without_flash_mla(fakes, monkeypatch):  # noqa: F811 (fixture)
    from longtrain.dsa.triton import sparse_mla

    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", False)
    stand_in = FakeFlashMLA()
    monkeypatch.setattr(sparse_mla, "flash_mla_style_fwd", stand_in)
    monkeypatch.setattr(routes, "triton_reason", lambda device: None)
    q, kv, idx = _sparse_inputs()
    out = ops.sparse_mla_attention(q, kv, idx, 0.05, backend="cudnn")
    out.sum().backward()
    assert len(stand_in.calls) == 1 and fakes.dsa.calls[-1]["op"] == "backward"
    want_out, want_dq, _ = _reference_grads(q, kv, idx, 0.05, None, torch.ones(out.shape))
    _assert_bf16_close(out, want_out)
    _assert_bf16_close(q.grad, want_dq)
    # with FlashMLA the documented split path runs (and the stand-in is not called)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", True)
    ops.sparse_mla_attention(q.detach(), kv.detach(), idx, 0.05, backend="cudnn")
    assert len(stand_in.calls) == 1 and len(fakes.fwd.calls) == 1
    # neither FlashMLA nor a runnable Triton forward: the documented error
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", False)
    monkeypatch.setattr(routes, "triton_reason", lambda device: "triton not installed")
    with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
        ops.sparse_mla_attention(q.detach(), kv.detach(), idx, 0.05, backend="cudnn")


def test_cudnn_reason_accepts_the_triton_forward_in_place_of_flash_mla(monkeypatch):
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", True)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", False)
    from longtrain import _optional

    monkeypatch.setattr(_optional, "cuda_sm", lambda major, minor: (True, ""))
    monkeypatch.setattr(routes, "triton_reason", lambda device: None)
    assert routes.cudnn_backend_reason(torch.device("cuda")) is None
    monkeypatch.setattr(routes, "triton_reason", lambda device: "no triton")
    assert "flash_mla" in routes.cudnn_backend_reason(torch.device("cuda"))
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", False)
    monkeypatch.setattr(routes, "triton_reason", lambda device: None)
    assert "cudnn" in routes.cudnn_backend_reason(torch.device("cuda")).lower()


def test_ops_cudnn_indexer_needs_no_flash_mla(fakes, monkeypatch):  # noqa: F811 (fixture)
    from tests.dsa.test_cudnn_dsa import _bf16_inputs, i32

    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", False)
    q, keys, w = _bf16_inputs(15, 15, seed=3)
    cu = i32([0, 5, 14, 15])
    out = ops.indexer_topk(q, keys, w, cu, 3, backend="cudnn")
    want = ops.indexer_topk(q.float(), keys.float(), w, cu, 3, backend="torch")
    assert torch.equal(out, want) and [c["op"] for c in fakes.dsa.calls] == ["scores", "topk"]
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", False)  # the error names only what the indexer needs
    with pytest.raises(RuntimeError, match=r"indexer_topk requires nvidia-cudnn-frontend\[cutedsl\] \("):
        ops.indexer_topk(q, keys, w, cu, 3, backend="cudnn")
