"""``varlen_attention`` (flash-attn's calling convention) on every CPU backend against a brute-force float64 oracle:
GQA, bottom-right causal when a document has fewer queries than keys, query rows that see no key (exact zeros),
empty documents, rows after the last offset, ``causal=False``, forward and every gradient; offsets validated once.

Tolerances: float64 backends against the float64 oracle differ only in summation order (1e-10); fp32 against the
float64 oracle: a handful of fp32 roundings over <= 40 keys (max-norm relative 1e-5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import meta as meta_mod
from longtrain.blockdiag_cp import varlen_attention
from tests.blockdiag._cp_model import rel_err


def brute(q, k, v, cu_q, cu_k, causal=True, scale=None):
    """Per document: query i of Lq sees key j of Lk iff not causal or j <= i + Lk - Lq; no visible key -> 0."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    rep = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        lq, lk = b - a, d - c
        if lq == 0 or lk == 0:
            continue
        kk, vv = k[c:d].repeat_interleave(rep, 1), v[c:d].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * scale
        allow = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allow = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        p = s.masked_fill(~allow, float("-inf")).softmax(-1).nan_to_num(0.0)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, vv)
    return out


LAYOUTS = {
    "square": ([5, 1, 7], [5, 1, 7], 0, 0),
    "more_keys": ([4, 3, 1], [11, 3, 2], 0, 0),  # bottom-right in every document, not only the first
    "fewer_keys": ([6, 2, 3], [2, 2, 5], 0, 0),  # queries that see no key give zeros
    "empty_docs": ([3, 0, 2, 0], [3, 4, 2, 0], 0, 0),
    "trailing_rows": ([3, 4], [3, 4], 2, 3),  # rows after cu[-1]: zero output, never keys
    "one_token_docs": ([1, 1, 1, 2], [1, 1, 1, 2], 0, 0),
}


def _case(layout, dtype=torch.float64, hq=4, hkv=2, d=8, seed=0):
    seg_q, seg_k, extra_q, extra_k = LAYOUTS[layout]
    cu_q = [0, *torch.tensor(seg_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(seg_k).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1] + extra_q, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(cu_k[-1] + extra_k, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(cu_k[-1] + extra_k, hkv, d, generator=gen, dtype=torch.float64)
    g = torch.randn(q.shape[0], hq, d, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g)], cu_q, cu_k, max(seg_q), max(seg_k)


def _run(fn, q, k, v, g):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    if not out.requires_grad:  # the oracle when no query sees a key: constant zeros
        return [out.detach(), *(torch.zeros_like(t) for t in (q, k, v))]
    grads = torch.autograd.grad((out * g).sum(), (q, k, v), allow_unused=True)
    return [out.detach(), *(torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, (q, k, v)))]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["reference", "dense", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_the_oracle(backend, layout, causal, dtype):
    (q, k, v, g), cu_q, cu_k, mq, mk = _case(layout, dtype)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    got = _run(lambda a, b, c: varlen_attention(a, b, c, cq, ck, mq, mk, causal=causal, backend=backend), q, k, v, g)
    want = _run(lambda a, b, c: brute(a, b, c, cu_q, cu_k, causal), *(t.double() for t in (q, k, v, g)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        else:
            assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    assert bool((got[0][cu_q[-1] :] == 0).all())  # rows after the last offset


@pytest.mark.parametrize("layout", ["square", "more_keys", "fewer_keys", "trailing_rows"])
def test_flex_forward_on_cpu(layout):
    """FlexAttention has no CPU backward in torch: its forward is checked here, the rest on the GPU."""
    (q, k, v, _), cu_q, cu_k, mq, mk = _case(layout, torch.float32)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    from longtrain.blockdiag_cp import runtime
    from longtrain.blockdiag_cp.providers import flex

    plan = meta_mod.meta_from_cu_seqlens(cq, ck, q.shape[0], k.shape[0], mq, mk, causal=True, device=q.device)
    with torch.no_grad():
        if plan.q_index is None:
            out = runtime.attend(q, k, v, plan.meta, "flex")
        else:
            part = runtime.attend(q[plan.q_index], k[plan.k_index], v[plan.k_index], plan.meta, "flex")
            out = torch.zeros_like(q).index_copy(0, plan.q_index, part)
    assert flex.unavailable_reason(torch.float32, q.device) is not None  # not offered for training on CPU
    assert rel_err(out, brute(q.double(), k.double(), v.double(), cu_q, cu_k)) <= 1e-5


_docs = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=_docs, causal=st.booleans(), heads=st.sampled_from([(4, 1), (2, 2), (6, 3)]))
def test_random_layouts(docs, causal, heads):
    cu_q, cu_k = [0], [0]
    for lq, lk in docs:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    if cu_q[-1] == 0 or cu_k[-1] == 0:
        return
    gen = torch.Generator().manual_seed(len(docs))
    q = torch.randn(cu_q[-1], heads[0], 4, generator=gen, dtype=torch.float64)
    k = torch.randn(cu_k[-1], heads[1], 4, generator=gen, dtype=torch.float64)
    v = torch.randn(cu_k[-1], heads[1], 4, generator=gen, dtype=torch.float64)
    g = torch.randn_like(q)
    cq, ck = torch.tensor(cu_q), torch.tensor(cu_k)  # int64 offsets are accepted too
    mq, mk = max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:]))
    got = _run(lambda a, b, c: varlen_attention(a, b, c, cq, ck, mq, mk, causal=causal, softmax_scale=0.4), q, k, v, g)
    want = _run(lambda a, b, c: brute(a, b, c, cu_q, cu_k, causal, 0.4), q, k, v, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)  # float64, summation order only


def test_offsets_are_validated_once_per_tensor(monkeypatch):
    (q, k, v, _), cu_q, cu_k, mq, mk = _case("more_keys")
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    calls = []
    real = meta_mod._plan_uncached
    monkeypatch.setattr(meta_mod, "_plan_uncached", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):  # three layers of one step
        varlen_attention(q, k, v, cq, ck, mq, mk)
    assert len(calls) == 1
    cq.add_(0)  # an in-place write bumps the version: validated again
    varlen_attention(q, k, v, cq, ck, mq, mk)
    assert len(calls) == 2


@pytest.mark.parametrize("layout", ["fewer_keys", "trailing_rows", "square"])
def test_inference_mode_then_training_on_the_same_offsets(layout):
    """A forward under ``torch.inference_mode`` equals the oracle and leaves nothing behind that breaks a training
    call with the same offsets (a cached plan holding inference tensors could not be saved for backward; offsets
    made under inference mode track no version and could not be cache keys)."""
    (q, k, v, g), cu_q, cu_k, mq, mk = _case(layout)
    want = _run(lambda a, b, c: brute(a, b, c, cu_q, cu_k), q, k, v, g)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    with torch.inference_mode():
        out = varlen_attention(q, k, v, cq, ck, mq, mk)
        fresh = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]  # inference tensors
        again = varlen_attention(q, k, v, *fresh, mq, mk)
    torch.testing.assert_close(out, want[0], rtol=1e-10, atol=1e-10)  # float64, summation order only
    torch.testing.assert_close(again, want[0], rtol=1e-10, atol=1e-10)
    got = _run(lambda a, b, c: varlen_attention(a, b, c, cq, ck, mq, mk), q, k, v, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_offsets_changed_in_place_under_inference_mode_are_read_again():
    """Inference tensors have no version counter: offsets rewritten in place must never hit a stale plan."""
    (q, k, v, _), _, _, _, _ = _case("square")  # 13 rows
    one, two = [0, 5, 6, 13], [0, 9, 13, 13]
    with torch.inference_mode():
        cu = torch.tensor(one, dtype=torch.int32)
        first = varlen_attention(q, k, v, cu, cu, 9, 9)
        cu.copy_(torch.tensor(two, dtype=torch.int32))
        second = varlen_attention(q, k, v, cu, cu, 9, 9)
    torch.testing.assert_close(first, brute(q, k, v, one, one), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(second, brute(q, k, v, two, two), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: a.update(cu_q=torch.tensor([1, 4, 7, 8], dtype=torch.int32)), ValueError, "must start at 0"),
        (lambda a: a.update(cu_q=torch.tensor([0, 4, 3, 8], dtype=torch.int32)), ValueError, "non-decreasing"),
        (lambda a: a.update(cu_k=torch.tensor([0, 11, 14, 99], dtype=torch.int32)), ValueError, "exceeds"),
        (lambda a: a.update(cu_k=torch.tensor([0, 11, 14], dtype=torch.int32)), ValueError, "3 and 2 documents"),
        (lambda a: a.update(cu_q=torch.tensor([0.0, 4.0, 7.0, 8.0])), ValueError, "int32/int64"),
        (lambda a: a.update(max_q=3), ValueError, "smaller than the longest"),
        (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of key/value heads"),
        (lambda a: a.update(k=a["k"][:, :0], v=a["v"][:, :0]), ValueError, "positive multiple"),
        (lambda a: a.update(q=a["q"].float()), ValueError, "dtypes differ"),
        (lambda a: a.update(q=a["q"][0]), ValueError, "packed \\[tokens, heads, head_dim\\]"),
        (lambda a: a.update(backend="flash"), ValueError, "backend 'flash' cannot run this call"),
        (lambda a: a.update(backend="fa3"), ValueError, "attention backend 'fa3'"),
        (lambda a: a.update(dropout_p=1.5), ValueError, "dropout_p"),
    ],
    ids=[
        "cu_start",
        "cu_decreasing",
        "cu_past_end",
        "cu_counts",
        "cu_float",
        "max_small",
        "gqa",
        "no_kv_heads",
        "dtype",
        "rank",
        "unavailable",
        "unknown",
        "dropout",
    ],  # fmt: skip
)
def test_bad_calls_are_clear_errors(change, exc, match):
    (q, k, v, _), cu_q, cu_k, mq, mk = _case("more_keys")
    args = {"q": q, "k": k, "v": v, "cu_q": torch.tensor(cu_q, dtype=torch.int32),
            "cu_k": torch.tensor(cu_k, dtype=torch.int32), "max_q": mq, "max_k": mk, "backend": "auto",
            "dropout_p": 0.0}  # fmt: skip
    change(args)
    with pytest.raises(exc, match=match):
        varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"], args["max_k"],
                         backend=args["backend"], dropout_p=args["dropout_p"])  # fmt: skip


def test_reference_dropout_runs_and_differs():
    (q, k, v, _), cu_q, cu_k, mq, mk = _case("square")
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    base = varlen_attention(q, k, v, cq, ck, mq, mk)
    torch.manual_seed(0)
    dropped = varlen_attention(q, k, v, cq, ck, mq, mk, dropout_p=0.5)
    assert not torch.allclose(base, dropped) and torch.isfinite(dropped).all()


def test_offsets_and_maxima_of_the_wrong_type_are_clear_errors():
    """A list of offsets was an ``AttributeError`` ('list' object has no attribute 'is_inference') and a ``None``
    maximum a bare ``int()`` error; both name the argument now."""
    (q, k, v, _), cu_q, cu_k, mq, mk = _case("square")
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D int32/int64 tensor"):
        varlen_attention(q, k, v, cu_q, ck, mq, mk)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a 1-D int32/int64 tensor"):
        varlen_attention(q, k, v, cq, cu_k, mq, mk)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        varlen_attention(q, k, v, cq, ck, mq, None)
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        varlen_attention(q, k, v, cq, ck, mq, mk, dropout_p=None)
