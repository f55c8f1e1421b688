"""The ``cudnn`` provider's graph route on CPU, through a fake ``cudnn`` frontend module.

The fake records every graph (dims, strides, ragged offsets, mask attributes) and executes a graph by reading
the per-document lengths and ragged element offsets out of the variant pack and running the float64
reference per document, so bucketing, zero-length padding documents, the stats layouts and the autograd
wiring are all exercised. Real cuDNN parity runs in tests/gpu/test_blockdiag_kernels_gpu.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from longtrain.blockdiag_cp import kernels, providers
from longtrain.blockdiag_cp.providers import cudnn
from longtrain.blockdiag_cp.providers import cudnn_graph as cv
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention
from tests.blockdiag._kernels_util import ids_from_lengths, meta_from_lengths, patch_provider


class _T:
    def __init__(self, graph, name, uid=None, dim=None, stride=None, **kw):
        self.graph, self.name, self.uid, self.dim, self.stride, self.ragged = graph, name, uid, dim, stride, None
        self.output = False

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, dt):
        return self


class _Graph:
    built: list = []

    def __init__(self, handle=None, io_data_type=None, **kw):
        self.tensors, self.op, self.kw, self.io = [], None, None, io_data_type
        _Graph.built.append(self)

    def tensor(self, **kw):
        t = _T(self, **kw)
        self.tensors.append(t)
        return t

    def sdpa(self, name, q, k, v, **kw):
        self.op, self.kw, self.ins = "fwd", kw, (q, k, v)
        return _T(self, "o"), _T(self, "stats")

    def sdpa_backward(self, name, q, k, v, o, dO, stats, **kw):
        self.op, self.kw, self.ins = "bwd", kw, (q, k, v)
        self.stats_ragged = stats.ragged is not None
        if self.stats_ragged and _FAKE_REFUSES_RAGGED_BWD:
            raise RuntimeError("cudnnGraphNotSupportedError: packed stats not supported")
        return _T(self, "dq"), _T(self, "dk"), _T(self, "dv")

    def validate(self):
        pass

    build_operation_graph = create_execution_plans = check_support = build_plans = validate

    def create_execution_plans(self, modes):  # noqa: F811
        pass

    def get_workspace_size(self):
        return 16

    def execute(self, pack, workspace, handle=None):
        q, k, v = pack[cv._Q], pack[cv._K], pack[cv._V]
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        cu_q = (pack[cv._RAG_Q].flatten() // (hq * d)).to(torch.int32)
        cu_k = (pack[cv._RAG_K].flatten() // (hkv * d)).to(torch.int32)
        assert torch.equal(pack[cv._SEQ_Q].flatten(), (cu_q[1:] - cu_q[:-1]))
        keep = torch.cat([torch.tensor([True]), cu_q[1:] > cu_q[:-1]])  # drop zero-length padding documents
        cu_q, cu_k = cu_q[keep].contiguous(), cu_k[keep].contiguous()
        scale, causal = self.kw["attn_scale"], "diagonal_alignment" in self.kw
        if self.op == "fwd":
            with torch.no_grad():
                pack[cv._O].copy_(reference_varlen_attention(q, k, v, cu_q, cu_k, scale=scale, causal=causal))
                pack[cv._STATS].fill_(0.5)
            return
        qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = reference_varlen_attention(qq, kk, vv, cu_q, cu_k, scale=scale, causal=causal)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), pack[cv._DO].double())
        pack[cv._DQ].copy_(dq)
        pack[cv._DK].copy_(dk)
        pack[cv._DV].copy_(dv)
        self.stats_seen = pack[cv._STATS]


_FAKE_REFUSES_RAGGED_BWD = False


@pytest.fixture
def fake_cudnn(monkeypatch):
    mod = types.ModuleType("cudnn")
    mod.pygraph = _Graph
    mod.data_type = types.SimpleNamespace(BFLOAT16="bf16", HALF="f16", FLOAT="f32", INT32="i32", INT64="i64")
    mod.heur_mode = types.SimpleNamespace(A="A", FALLBACK="F")
    mod.diagonal_alignment = types.SimpleNamespace(BOTTOM_RIGHT="BR", TOP_LEFT="TL")
    mod.create_handle = lambda: "handle"
    mod.set_stream = lambda handle, stream: None
    mod.backend_version = lambda: 91900
    monkeypatch.setitem(sys.modules, "cudnn", mod)
    monkeypatch.setattr(cv, "_handle", lambda device: "handle")
    monkeypatch.setattr(cv, "RAGGED_STATS_BWD", None)
    _Graph.built = []
    cv.reset_cudnn_graph_cache()
    yield mod
    cv.reset_cudnn_graph_cache()


def _packed(lengths_q, lengths_k, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    """q/k/v of packed segments and their :class:`VarlenMeta` (whose ``cu_q``/``cu_k`` are returned too)."""
    gen = torch.Generator().manual_seed(seed)
    meta = meta_from_lengths(lengths_q, lengths_k)
    q = torch.randn(sum(lengths_q), hq, d, generator=gen, dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(sum(lengths_k), hkv, d, generator=gen, dtype=dtype)
    return q, k, v, meta


def test_bucket_rounding():
    assert cv._bucket(3, 8) == 8
    assert cv._bucket(8025, 64) == 8192 and cv._bucket(5000, 64) == 5120 and cv._bucket(4096, 64) == 4096
    assert cv._bucket(35, 8) == 40 and cv._bucket(513, 8) == 640
    for n in range(1, 3000, 7):
        b = cv._bucket(n, 64)
        assert b >= n and (b <= 64 or b < 1.26 * n)


@pytest.mark.parametrize("refuse_ragged", [False, True], ids=["ragged_stats", "padded_stats"])
def test_fake_graph_contract_forward_backward_and_cache(fake_cudnn, monkeypatch, refuse_ragged):
    monkeypatch.setattr(sys.modules[__name__], "_FAKE_REFUSES_RAGGED_BWD", refuse_ragged)
    q, k, v, meta = _packed([3, 1, 5], [7, 1, 5])  # first document straddles: 3 queries over 7 keys
    cu_q, cu_k = meta.cu_q, meta.cu_k
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = cudnn.attention(qg, kg, vg, meta)
    ref = reference_varlen_attention(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # the fake runs the same float64 reference
    fwd = _Graph.built[0]
    assert fwd.op == "fwd" and fwd.kw["diagonal_alignment"] == "BR" and fwd.kw["diagonal_band_right_bound"] == 0
    assert fwd.kw["use_padding_mask"] is True and fwd.kw["attn_scale"] == pytest.approx(8**-0.5)
    b = next(t for t in fwd.tensors if t.uid == cv._Q).dim[0]
    assert b == 8 and next(t for t in fwd.tensors if t.uid == cv._K).dim[2] == 64  # bucketed docs and max len
    grads = torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out))
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference_varlen_attention(q64, k64, v64, cu_q, cu_k), (q64, k64, v64),
                               torch.ones_like(out))  # fmt: skip
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    bwd = [g for g in _Graph.built if g.op == "bwd"][-1]
    assert bwd.stats_ragged is (not refuse_ragged)
    assert cv.RAGGED_STATS_BWD is (not refuse_ragged)
    if refuse_ragged:
        assert bwd.stats_seen.shape == (8, 4, 64, 1)  # padded [B, Hq, Sq, 1]
    # a second call with another layout in the same buckets reuses both graphs
    before = cv.cudnn_graph_cache_stats()
    q2, k2, v2, meta2 = _packed([2, 2, 1, 6], [2, 4, 1, 6], seed=1)
    q2.requires_grad_()
    out2 = cudnn.attention(q2, k2, v2, meta2)
    torch.autograd.grad(out2.sum(), q2)
    after = cv.cudnn_graph_cache_stats()
    assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 2
    assert 0 < after["hit_rate"] < 1 and after["entries"] == 2


def test_layout_is_cached_in_meta_and_pads_zero_length_documents(fake_cudnn):
    q, k, v, meta = _packed([4, 4, 1], [9, 4, 1])
    cudnn.attention(q, k, v, meta)
    (lay,) = [val for key, val in meta.cache.items() if key[0] == "cudnn_layout"]
    assert lay["seq_q"].flatten().tolist() == [4, 4, 1, 0, 0, 0, 0, 0]
    assert (lay["rag_k"].flatten() // (2 * 8)).tolist() == [0, 9, 13, 14, 14, 14, 14, 14, 14]
    assert (lay["rag_stats"].flatten() // 4).tolist() == [0, 4, 8, 9, 9, 9, 9, 9, 9]
    cudnn.attention(q, k, v, meta)
    assert len([key for key in meta.cache if key[0] == "cudnn_layout"]) == 1


def test_diagonal_follows_the_layout_and_causal_false(fake_cudnn):
    q, k, v, meta = _packed([4, 4, 1], [4, 4, 1])  # every document square: top-left + cuDNN's backward
    cudnn.attention(q, k, v, meta)
    assert _Graph.built[-1].kw["diagonal_alignment"] == "TL"
    q, k, v, meta = _packed([2, 4], [5, 4])
    out = cudnn.attention(q, k, v, meta, causal=False)
    assert "diagonal_alignment" not in _Graph.built[-1].kw
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, meta.cu_q, meta.cu_k, causal=False),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_dropout_is_refused_and_auto_avoids_cudnn(fake_cudnn, monkeypatch):
    q, k, v, meta = _packed([5], [5])
    with pytest.raises(ValueError, match="no attention dropout"):
        cudnn.attention(q, k, v, meta, dropout_p=0.2)
    monkeypatch.setattr(providers, "unavailable_reason", lambda *a, **kw: None)
    assert providers.resolve_backend("auto", torch.bfloat16, "cuda") == "cudnn"
    assert providers.resolve_backend("auto", torch.bfloat16, "cuda", dropout_p=0.1) == "flash"


def test_backward_choice(monkeypatch):
    lay = {"B": 8, "Sq": 64, "Sk": 64}
    q, k = torch.empty(10, 4, 8, dtype=torch.bfloat16), torch.empty(10, 2, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(cv._optional, "torch_varlen", lambda: (True, ""))
    assert cv._params(q, k, lay, 0.3, False, 10, 10)["backward"] == "fa2"
    assert cv._params(q, k, lay, 0.3, True, 10, 10)["backward"] == "cudnn"  # deterministic
    monkeypatch.setattr(cv._optional, "torch_varlen", lambda: (False, "no FA2"))
    assert cv._params(q, k, lay, 0.3, False, 10, 10)["backward"] == "cudnn"
    monkeypatch.setattr(cv, "BACKWARD", "cudnn")
    monkeypatch.setattr(cv._optional, "torch_varlen", lambda: (True, ""))
    assert cv._params(q, k, lay, 0.3, False, 10, 10)["backward"] == "cudnn"


def test_driver_dispatches_cudnn_with_meta(monkeypatch):
    calls = []

    def fake(q, k, v, meta, *, scale=None, dropout_p=0.0, causal=True, deterministic=False):
        calls.append({"meta": meta, "deterministic": deterministic, "dropout_p": dropout_p,
                      "max": (meta.max_q, meta.max_k)})  # fmt: skip
        return reference_varlen_attention(q, k, v, meta.cu_q, meta.cu_k, scale=scale, dropout_p=dropout_p)

    real_reason = providers.unavailable_reason
    monkeypatch.setattr(providers, "unavailable_reason",
                        lambda b, *a, **kw: None if b == "cudnn" else real_reason(b, *a, **kw))  # fmt: skip
    patch_provider(monkeypatch, "cudnn", fake)
    monkeypatch.setattr(kernels, "_CP_FLASH_DETERMINISTIC", True)
    ids = ids_from_lengths([11, 3, 6], 4)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 8, 8, "cpu")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen).bfloat16()
    k = torch.randn(1, 2, 24, 16, generator=gen).bfloat16()
    v = torch.randn(1, 2, 24, 16, generator=gen).bfloat16()
    got = kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="cudnn", meta=meta)
    want = kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="reference", meta=meta)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same math on the same bf16 inputs
    assert calls[0]["meta"].cu_q is meta["cu_q"] and calls[0]["deterministic"] is True and calls[0]["max"] == (3, 11)
    assert kernels._cp_blockdiag_varlen(q.float(), k.float(), v.float(), ids, 8, backend="cudnn", meta=meta) is None
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="cudnn", dropout_p=0.1, meta=meta) is None


def test_cudnn_reasons_on_cpu():
    r = kernels._varlen_backend_unavailable_reason
    assert r("cudnn", torch.float32, torch.device("cpu")) == "varlen CP attention needs fp16/bf16, got torch.float32"
    assert r("cudnn", torch.bfloat16, torch.device("cpu")) == "varlen CP attention requires CUDA, got device=cpu"
    if not torch.cuda.is_available():
        assert "SM90" in r("cudnn", torch.bfloat16, torch.device("cuda"))
        assert "needs CUDA" in dict(providers.backend_status())["cudnn"]
        assert "SM90+" in dict(providers.backend_status())["cudnn"]
