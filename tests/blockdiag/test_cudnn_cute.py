"""The CuTe DSL route of the ``cudnn`` provider on CPU: the visible-key mask, the plan cache and the dispatch.

The frontend's kernels need a Hopper/Blackwell GPU; here a fake ``cudnn.flex_attention`` executes a mask plan
with plain torch (each query attends to the first ``F0`` keys of its document), so the mask we build is checked
end to end against the float64 bottom-right reference, forward and gradients. Real-kernel parity runs in
tests/gpu/test_blockdiag_kernels_gpu.py (``cudnn:cute``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from longtrain import _optional
from longtrain.blockdiag_cp import providers
from longtrain.blockdiag_cp.providers import cudnn
from longtrain.blockdiag_cp.providers import cudnn_cute as cf
from longtrain.blockdiag_cp.providers import cudnn_graph as cv
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention
from tests.blockdiag._kernels_util import meta_from_lengths

LAYOUTS = {
    "equal": ([5, 1, 7], [5, 1, 7]),
    "straddle": ([4, 3, 1], [11, 3, 1]),
    "one_token_docs": ([1, 1, 1, 2], [1, 1, 1, 2]),
    "empty_query_doc": ([3, 0, 2], [6, 4, 2]),
}


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_visible_key_counts_is_the_bottom_right_causal_prefix(layout):
    seg_q, seg_k = LAYOUTS[layout]
    got = cf.visible_key_counts(_cu(seg_q), _cu(seg_k), sum(seg_q))
    want = [i + 1 + lk - lq for lq, lk in zip(seg_q, seg_k) for i in range(lq)]
    assert got.dtype == torch.int32 and got.shape == (1, 1, sum(seg_q))
    assert got.flatten().tolist() == want
    full = cf.visible_key_counts(_cu(seg_q), _cu(seg_k), sum(seg_q), causal=False)
    assert full.flatten().tolist() == [lk for lq, lk in zip(seg_q, seg_k) for _ in range(lq)]


class _Plan:
    def __init__(self, mask, cu_q, cu_k, max_q, max_k, build_backward):
        self.mask, self.cu_q, self.cu_k = mask, cu_q, cu_k
        self.max_q, self.max_k, self.build_backward = max_q, max_k, build_backward


@pytest.fixture
def fake_flex(monkeypatch):
    """A fake ``cudnn.flex_attention`` that runs a plan with plain torch; returns its call log."""
    log = {"plans": [], "calls": []}

    def create_mask_plan(mask, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, build_backward):
        assert mask.dtype == torch.int32 and mask.shape == (1, 1, q.shape[0]) and mask.is_contiguous()
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        plan = _Plan(mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, build_backward)
        log["plans"].append(plan)
        return plan

    def flex_attn_func(q, k, v, *, mask_plan, softmax_scale, deterministic):
        log["calls"].append({"plan": mask_plan, "scale": softmax_scale, "deterministic": deterministic})
        group = q.shape[1] // k.shape[1]
        pieces = []
        cu_q, cu_k = mask_plan.cu_q.tolist(), mask_plan.cu_k.tolist()
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
            if b == a:
                continue
            kd = k[c:d].repeat_interleave(group, dim=1)
            vd = v[c:d].repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q[a:b], kd) * softmax_scale
            visible = torch.arange(d - c)[None, :] < mask_plan.mask[0, 0, a:b].long()[:, None]
            p = s.masked_fill(~visible, float("-inf")).softmax(-1)
            pieces.append(torch.einsum("hqk,khd->qhd", p, vd))
        return torch.cat(pieces)

    pkg = types.ModuleType("cudnn")
    flex = types.ModuleType("cudnn.flex_attention")
    flex.create_mask_plan, flex.flex_attn_func = create_mask_plan, flex_attn_func
    pkg.flex_attention = flex
    monkeypatch.setitem(sys.modules, "cudnn", pkg)
    monkeypatch.setitem(sys.modules, "cudnn.flex_attention", flex)
    return log


def _inputs(seg_q, seg_k, hq=4, hkv=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(seg_q), hq, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(seg_k), hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(seg_k), hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mask_plan_gives_the_reference_attention_and_gradients(fake_flex, layout):
    seg_q, seg_k = LAYOUTS[layout]
    meta = meta_from_lengths(seg_q, seg_k)
    cu_q, cu_k = meta.cu_q, meta.cu_k
    q, k, v = _inputs(seg_q, seg_k)
    got = cf.cute_attention(q, k, v, meta, scale=0.3)
    want = reference_varlen_attention(q, k, v, cu_q, cu_k, scale=0.3)
    grad = torch.randn_like(want)
    # float64 on both sides, same math up to summation order
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_plan_is_built_once_per_meta_and_autograd_mode(fake_flex, monkeypatch):
    monkeypatch.setattr(cf, "PLAN_STATS", {"built": 0, "reused": 0, "build_s": 0.0})
    seg = [6, 2, 5]
    meta = meta_from_lengths(seg, seg)
    cu_q, cu_k = meta.cu_q, meta.cu_k
    q, k, v = _inputs(seg, seg)
    for _ in range(3):  # three layers of one step
        cf.cute_attention(q, k, v, meta, scale=0.5, deterministic=True)
    with torch.no_grad():
        cf.cute_attention(q, k, v, meta, scale=0.5)
    assert [p.build_backward for p in fake_flex["plans"]] == [True, False]
    assert cf.PLAN_STATS["built"] == 2 and cf.PLAN_STATS["reused"] == 2
    assert all(c["scale"] == 0.5 for c in fake_flex["calls"])
    assert [c["deterministic"] for c in fake_flex["calls"]] == [True, True, True, False]
    plan = fake_flex["plans"][0]
    assert plan.cu_q is cu_q and plan.cu_k is cu_k and (plan.max_q, plan.max_k) == (6, 6)
    cf.cute_attention(q, k, v, meta_from_lengths(seg, seg), scale=0.5)  # another step: a new plan
    assert len(fake_flex["plans"]) == 3


def test_route_dispatch(monkeypatch):
    seg = [3, 4]
    q, k, v = (t.detach().bfloat16() for t in _inputs(seg, seg))
    meta = meta_from_lengths(seg, seg)
    seen = []

    def fake_route(q_, k_, v_, meta_, *, scale, causal, deterministic):
        seen.append((scale, deterministic, meta_))
        return torch.zeros_like(q_)

    monkeypatch.setattr(cf, "cute_attention", fake_route)
    monkeypatch.setattr(cf, "cute_unavailable_reason", lambda q_, k_: None)
    cudnn.attention(q, k, v, meta, deterministic=True)
    assert seen == [(8**-0.5, True, meta)]

    class GraphReached(Exception):
        pass

    def graph(*args, **kwargs):
        raise GraphReached

    monkeypatch.setattr(cv, "_layout", graph)
    monkeypatch.setattr(cudnn, "ROUTE", "graph")
    with pytest.raises(GraphReached):
        cudnn.attention(q, k, v, meta)
    monkeypatch.setattr(cf, "cute_unavailable_reason", lambda q_, k_: "no cutlass here")
    monkeypatch.setattr(cudnn, "ROUTE", "auto")
    with pytest.raises(GraphReached):  # auto falls back to the graph API
        cudnn.attention(q, k, v, meta)
    monkeypatch.setattr(cudnn, "ROUTE", "cute")
    with pytest.raises(RuntimeError, match="no cutlass here"):
        cudnn.attention(q, k, v, meta)
    monkeypatch.setattr(cudnn, "ROUTE", "flex")  # the route's old name is not accepted
    with pytest.raises(ValueError, match="'auto', 'cute', 'graph'"):
        cudnn.attention(q, k, v, meta)
    assert len(seen) == 1


def test_graph_alignment_and_backward_follow_the_layout(monkeypatch):
    q = torch.zeros(7, 4, 8, dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(cv, "_layout", lambda *a: {"B": 8, "Sq": 64, "Sk": 64})
    monkeypatch.setattr(cv._CudnnVarlen, "apply", lambda q_, k_, v_, lay, p: seen.append(p["align"]))
    cv.graph_attention(q, q[:, :2], q[:, :2], meta_from_lengths([4, 3], [4, 3]), scale=0.3)
    cv.graph_attention(q, q[:, :2], q[:, :2], meta_from_lengths([4, 3], [9, 3]), scale=0.3)
    assert seen == ["TOP_LEFT", "BOTTOM_RIGHT"]  # from the metadata's host ints: no sync
    lay = {"B": 8, "Sq": 64, "Sk": 64}
    q, k = torch.empty(10, 4, 8, dtype=torch.bfloat16), torch.empty(10, 2, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(cv._optional, "torch_varlen", lambda: (True, ""))
    assert cv._params(q, k, lay, 0.3, False, 10, 10, "TOP_LEFT")["backward"] == "cudnn"
    # CPU tensors: our Triton backward is not used by this backend off CUDA, so bottom-right takes FA2's
    assert "CUDA" in cv._triton_bwd_reason(q)
    assert cv._params(q, k, lay, 0.3, False, 10, 10, "BOTTOM_RIGHT")["backward"] == "fa2"
    monkeypatch.setattr(cv, "_triton_bwd_reason", lambda q_: None)
    assert cv._params(q, k, lay, 0.3, False, 10, 10, "BOTTOM_RIGHT")["backward"] == "triton"
    assert cv._params(q, k, lay, 0.3, True, 10, 10, "BOTTOM_RIGHT")["backward"] == "triton"  # deterministic too
    monkeypatch.setattr(cv, "BACKWARD", "fa2")
    assert cv._params(q, k, lay, 0.3, False, 10, 10, "TOP_LEFT")["backward"] == "fa2"
    monkeypatch.setattr(cv, "BACKWARD", "fastest")
    with pytest.raises(ValueError, match="'auto', 'triton', 'fa2', 'cudnn'"):
        cv._params(q, k, lay, 0.3, False, 10, 10, "TOP_LEFT")


def test_reasons_without_the_package(monkeypatch):
    q = torch.empty(2, 4, 8)
    assert cf.cute_unavailable_reason(q, q) == "the cuDNN CuTe DSL attention requires CUDA, got device=cpu"
    monkeypatch.setattr(_optional, "_spec", lambda name: False)
    _optional.reset_probe_cache()
    try:
        ok, reason = _optional.cudnn_cute()
        assert not ok and "nvidia-cudnn-frontend" in reason
    finally:
        monkeypatch.undo()
        _optional.reset_probe_cache()


def test_a_failing_cute_forward_falls_back_to_the_graph_route_once(monkeypatch, caplog):
    monkeypatch.setattr(cv, "FAILED", {})
    seg = [3, 4]
    q, k, v = (t.detach().bfloat16() for t in _inputs(seg, seg))
    meta = meta_from_lengths(seg, seg)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cute compile failed for this head count")

    class GraphReached(Exception):
        pass

    def graph(*args, **kwargs):
        raise GraphReached

    monkeypatch.setattr(cf, "cute_unavailable_reason", lambda q_, k_: None)
    monkeypatch.setattr(cf, "cute_attention", broken)
    monkeypatch.setattr(cv, "_layout", graph)
    with caplog.at_level("WARNING", logger=cv.__name__), pytest.raises(GraphReached):
        cudnn.attention(q, k, v, meta)
    assert "cute compile failed" in caplog.text and "using the graph API" in caplog.text
    with pytest.raises(GraphReached):  # remembered: the CuTe route is not tried again for this shape
        cudnn.attention(q, k, v, meta)
    assert len(calls) == 1
    monkeypatch.setattr(cudnn, "ROUTE", "cute")  # forced: the error is the caller's to see
    with pytest.raises(RuntimeError, match="cute compile failed"):
        cudnn.attention(q, k, v, meta)


def test_a_failing_triton_backward_falls_back_to_fa2(monkeypatch):
    monkeypatch.setattr(cv, "FAILED", {})
    seg_q, seg_k = [3, 4], [6, 4]
    q, k, v = _inputs(seg_q, seg_k)
    cu_q, cu_k = _cu(seg_q), _cu(seg_k)
    used = []

    def forward(q_, k_, v_, lay, p):
        out = reference_varlen_attention(q_, k_, v_, cu_q, cu_k, scale=p["scale"])
        return out, torch.zeros(q_.shape[0], q_.shape[1], 1)

    def broken(*args):
        used.append("triton")
        raise RuntimeError("no Triton config fits")

    def fa2(dout, q_, k_, v_, out, stats, lay, p):
        used.append("fa2")
        return torch.ones_like(q_), torch.ones_like(k_), torch.ones_like(v_)

    monkeypatch.setattr(cv, "cudnn_varlen_fwd", forward)
    monkeypatch.setattr(cv, "triton_bwd_from_cudnn", broken)
    monkeypatch.setitem(cv._BACKWARD_FNS, "fa2", fa2)
    monkeypatch.setattr(cv._optional, "torch_varlen", lambda: (True, ""))
    p = {"scale": 0.3, "backward": "triton", "deterministic": False, "causal": True}
    out = cv._CudnnVarlen.apply(q, k, v, {}, p)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert used == ["triton", "fa2"] and bool((dq == 1).all())
    assert ("triton", 4, 2, 8, torch.float64) in cv.FAILED
    monkeypatch.setattr(cv, "_triton_bwd_reason", lambda q_: None)  # would otherwise be chosen again
    lay = {"B": 8, "Sq": 64, "Sk": 64}
    assert cv._params(q, k, lay, 0.3, False, 7, 10, "BOTTOM_RIGHT")["backward"] == "fa2"


def test_doctor_row_names_the_cudnn_route(monkeypatch):
    from dataclasses import replace

    entries = [replace(p, unavailable_reason=lambda dtype, device: None) for p in providers._ENTRIES]
    entries = [replace(p, status_hint=lambda: cudnn.route_hint("cpu")) if p.name == "cudnn" else p for p in entries]
    monkeypatch.setattr(providers, "_ENTRIES", tuple(entries))  # the route probe runs on CPU tensors here
    monkeypatch.setattr(cf, "cute_unavailable_reason", lambda q, k: None)
    names = [name for name, _ in providers.backend_status()]
    assert names[names.index("cudnn") + 1] == "cudnn route -> CuTe DSL"
    monkeypatch.setattr(cf, "cute_unavailable_reason", lambda q, k: "no cutlass")
    assert "cudnn route -> graph API (CuTe DSL: no cutlass)" in dict(providers.backend_status())
