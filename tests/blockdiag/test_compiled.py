"""``varlen_attention`` under ``torch.compile(..., fullgraph=True)``: one opaque custom op whose real implementation
is the eager function, so every packed layout gives the eager output and gradients (the recomputing backward runs
the same eager attention again), each call hands the op its own offsets and maximum lengths, bad offsets are the
eager ``ValueError`` at run time, and the CP path says it cannot be traced.

Tolerance: none. The compiled function adds only exact operations (``* 1.0``) around the op, the op runs the eager
float64 attention and the backward differentiates the same eager computation, so outputs and gradients are
bitwise equal to eager."""

from __future__ import annotations

import pytest
import torch

from longtrain.blockdiag_cp import build_cp_step, cp_varlen_attention, runtime, varlen_attention

T, HQ, HKV, D = 24, 4, 2, 8
#: (document lengths, max_seqlen) of one packed row of T tokens; a tail after the last offset is padding.
LAYOUTS = [([10, 14], 14), ([3, 12, 5], 12), ([22, 2], 22)]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV)]


def _attention(q, k, v, cu, max_len):
    return varlen_attention(q * 1.0, k * 1.0, v * 1.0, cu, cu, max_len, max_len, softmax_scale=0.3)


def _run(fn, qkv, cu, max_len):
    q, k, v = (t.clone().requires_grad_(True) for t in qkv)
    out = fn(q, k, v, cu, max_len)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weight).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_equals_eager_over_changing_layouts(backend, monkeypatch):
    """Three layouts of the same 24 tokens, different offsets and maximum lengths (one with a padding tail): output
    and the gradients of q, k and v equal eager bitwise; the op's eager body sees each call's own maximum lengths."""
    seen = []
    validate = runtime.meta_from_cu_seqlens

    def spy(cu_q, cu_k, total_q, total_k, max_q, max_k, **kwargs):
        seen.append((max_q, max_k))
        return validate(cu_q, cu_k, total_q, total_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(runtime, "meta_from_cu_seqlens", spy)
    torch._dynamo.reset()
    compiled = torch.compile(_attention, fullgraph=True, backend=backend)
    for i, (lens, max_len) in enumerate(LAYOUTS):
        qkv, cu = _qkv(i), _cu(lens)
        want = _run(_attention, qkv, cu, max_len)
        seen.clear()
        got = _run(compiled, qkv, cu, max_len)
        assert seen == [(max_len, max_len)] * 2, seen  # the forward op, then the backward's recompute
        for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
            assert torch.equal(a, b), name


def test_bad_offsets_after_good_ones_raise_the_eager_error():
    """Offsets are data: a compiled function that ran with good offsets raises, at run time, the ValueError eager
    raises for bad ones (not monotone, past the tokens, a maximum below the longest document)."""
    torch._dynamo.reset()
    compiled = torch.compile(_attention, fullgraph=True, backend="aot_eager")
    q, k, v = _qkv(0)
    compiled(q, k, v, _cu([10, 14]), 14)
    bad = [
        (torch.tensor([0, 14, 10, 24], dtype=torch.int32), 14),
        (torch.tensor([0, 10, 25], dtype=torch.int32), 15),
        (_cu([10, 14]), 12),
    ]
    for cu, max_len in bad:
        with pytest.raises(ValueError) as eager:
            _attention(q, k, v, cu, max_len)
        with pytest.raises(ValueError) as got:
            compiled(q, k, v, cu, max_len)
        assert str(got.value) == str(eager.value)
    torch.testing.assert_close(compiled(q, k, v, _cu([3, 21]), 21), _attention(q, k, v, _cu([3, 21]), 21))


def test_cp_attention_under_fullgraph_is_a_clear_error():
    """``cp_varlen_attention`` (collectives, host syncs) is not traced: under ``fullgraph=True`` dynamo stops with a
    message that says which paths ``fullgraph=True`` supports."""
    torch._dynamo.reset()
    step = build_cp_step(torch.tensor([1] * 10 + [2] * 14))  # builds after torch._dynamo is loaded: hides the runtime
    compiled = torch.compile(lambda q, k, v: cp_varlen_attention(q * 1.0, k, v, step), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    with pytest.raises(torch._dynamo.exc.Unsupported, match="fullgraph=True supports varlen_attention"):
        compiled(*_qkv(0))


def test_backend_none_compiles_as_in_eager():
    """Eager takes ``backend=None`` (the default, ``auto``); the op's schema takes a str, and tracing failed with a
    fake-tensor error before the name was normalised."""
    torch._dynamo.reset()
    cu = _cu([10, 14])
    fn = lambda q, k, v: varlen_attention(q * 1.0, k, v, cu, cu, 14, 14, backend=None)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*_qkv(0)), fn(*_qkv(0)))
