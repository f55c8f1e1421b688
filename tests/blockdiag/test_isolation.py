"""A non-finite value in one document never changes another document: every CPU path of block-diagonal attention,
q / k / v x NaN / +inf / -inf x a document or the padding tail, outputs and all gradients (float64: the other
documents' values equal the clean run to 1e-12, summation order only), and the rows that attend the value are not
finite (NaN where the runtime isolated a provider, the natural inf/NaN of the heads involved otherwise).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longtrain.blockdiag_cp import (
    build_cp_step,
    configure_cp_varlen,
    cp_blockdiag_sdpa,
    cp_varlen_attention,
    kernels,
    make_cp_blockdiag_batch_and_ctx,
    varlen_attention,
)
from tests.blockdiag import _cp_model as cm

LENGTHS = [5, 6, 4]  # documents 1, 2, 3 and a padding tail of 3
IDS = torch.tensor([1] * 5 + [2] * 6 + [3] * 4 + [0] * 3)
DOC2 = (IDS == 2).nonzero().flatten()
POSITIONS = {"doc2": int(DOC2[1]), "doc2_last": int(DOC2[-1]), "padding": 16}
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _qkv():
    gen = torch.Generator().manual_seed(0)
    s = IDS.numel()
    return [torch.randn(s, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]


def _poison(tensors, which, pos, value):
    out = [t.clone() for t in tensors]
    out["qkv".index(which)][pos, 1, 3] = value
    return out


def _thd(fn):
    """Run ``fn(q, k, v) -> [S, Hq, D]`` with gradients: ``(out, dq, dk, dv)``."""

    def run(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        g = torch.ones_like(out) * (IDS > 0)[:, None, None]
        grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
        return [out.detach(), *(torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, (q, k, v)))]

    return run


def _sdpa_layout(fn):
    return _thd(lambda q, k, v: fn(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1))


def _hooked_dense(q, k, v):
    from longtrain.blockdiag_cp import (
        attach_cp1_packed_varlen_hooks,
        disable_cp1_packed_varlen,
        enable_cp1_packed_varlen,
    )

    class SelfAttn(torch.nn.Module):
        def forward(self, a, b, c):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

    model = torch.nn.ModuleDict({"self_attn": SelfAttn()})
    attach_cp1_packed_varlen_hooks(model)
    enable_cp1_packed_varlen(IDS, "dense")
    try:
        return model["self_attn"](q, k, v)
    finally:
        disable_cp1_packed_varlen()


def _fallback(q, k, v):
    """The all-gather path when the provider raises: the dense fallback."""
    from dataclasses import replace

    from longtrain.blockdiag_cp import providers

    real = providers.PROVIDERS["reference"]

    def broken(*args, **kwargs):
        raise RuntimeError("kernel declined")

    providers.PROVIDERS["reference"] = replace(real, attention=broken)
    try:
        return cp_varlen_attention(q, k, v, build_cp_step(IDS, attn_backend="reference"))
    finally:
        providers.PROVIDERS["reference"] = real


CU = torch.tensor([0, 5, 11, 15], dtype=torch.int32)
PATHS = {
    "dense_blockdiag_sdpa": _sdpa_layout(lambda q, k, v: kernels.dense_blockdiag_sdpa(q, k, v, IDS, 0)),
    "cp1_hooks_dense": _sdpa_layout(_hooked_dense),
    "step_reference": _thd(lambda q, k, v: cp_varlen_attention(q, k, v, build_cp_step(IDS, attn_backend="ref"))),
    "step_dense": _thd(lambda q, k, v: cp_varlen_attention(q, k, v, build_cp_step(IDS, attn_backend="dense"))),
    "sdpa_fallback": _thd(_fallback),
    "varlen_dense": _thd(lambda q, k, v: varlen_attention(q, k, v, CU, CU, 6, 6, backend="dense")),
    "varlen_reference": _thd(lambda q, k, v: varlen_attention(q, k, v, CU, CU, 6, 6, backend="reference")),
}


def _check(clean, poisoned, which, pos, value):
    """Documents 1 and 3 unchanged; in document 2 (or the tail) only rows that attend ``pos`` are non-finite."""
    other = (IDS == 1) | (IDS == 3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), clean, poisoned):
        torch.testing.assert_close(b[other], a[other], rtol=1e-12, atol=1e-12, msg=f"{name} of another document")
    out = poisoned[0]
    if IDS[pos] == 0:
        return  # padding rows carry label -100: nothing to check beyond the other documents
    sees = (IDS[pos] == IDS) & (torch.arange(IDS.numel()) >= pos)
    if which == "q":
        sees = torch.arange(IDS.numel()) == pos
    visible = ~torch.isfinite(out[sees]).flatten(1).all(1)
    assert bool(visible.all()), "rows that attend the non-finite value must not be finite (visibly wrong)"
    before = (IDS[pos] == IDS) & ~sees
    torch.testing.assert_close(out[before], clean[0][before], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("path", list(PATHS))
def test_isolation_matrix(path, which, where, value):
    run = PATHS[path]
    tensors = _qkv()
    clean = run(*tensors)
    poisoned = run(*_poison(tensors, which, POSITIONS[where], VALUES[value]))
    _check(clean, poisoned, which, POSITIONS[where], value)


def test_flex_forward_on_cpu_isolates():
    from longtrain.blockdiag_cp import runtime

    step = build_cp_step(IDS)
    for which in "qkv":
        tensors = _qkv()
        with torch.no_grad():
            clean = runtime.attend(*tensors, step.varlen_meta, "flex")
            bad = runtime.attend(*_poison(tensors, which, POSITIONS["doc2"], float("nan")), step.varlen_meta, "flex")
        other = (IDS == 1) | (IDS == 3)
        torch.testing.assert_close(bad[other], clean[other], rtol=1e-12, atol=1e-12)


def _dist_worker(rank: int, world: int):
    """cp_blockdiag_sdpa over gloo, every exchange: a NaN in document 2 changes no other document."""
    failures = []
    s = IDS.numel()
    full = s + (-s) % (2 * world)
    ids = torch.cat([IDS, IDS.new_zeros(full - s)])
    for mode in ("allgather", "halo", "a2a"):
        for which in "qkv":
            results = []
            for value in (None, float("nan")):
                tensors = [t.clone() for t in _qkv()]
                tensors = [torch.cat([t, t.new_zeros(full - s, *t.shape[1:])]) for t in tensors]
                if value is not None:
                    tensors["qkv".index(which)][POSITIONS["doc2"], 0, 1] = value
                previous = configure_cp_varlen(kv_exchange=mode)
                try:
                    ctx, _, _ = make_cp_blockdiag_batch_and_ctx(
                        cm.FakeMesh(world, rank, dist.group.WORLD), None,
                        {"inputs_embeds": torch.zeros(1, full, 1), "_packed_seq_ids": ids[None]},
                    )  # fmt: skip
                    with ctx() as step:
                        rows = slice(step.row_offset, step.row_offset + step.local_len)
                        local = [t[rows].transpose(0, 1)[None].requires_grad_() for t in tensors]
                        out = cp_blockdiag_sdpa(*local)
                        out.sum().backward()
                finally:
                    configure_cp_varlen(**previous)
                results.append([out.detach()[0].transpose(0, 1), *(t.grad[0].transpose(0, 1) for t in local)])
            other = ((ids == 1) | (ids == 3))[rows]
            for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
                if not torch.allclose(a[other], b[other], rtol=1e-12, atol=1e-12) or not torch.isfinite(b[other]).all():
                    failures.append(f"W={world} rank={rank} {mode} {which}: {name} of another document changed")
    return failures


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_isolation_over_gloo_every_exchange(gloo, world):
    failures = [f for per_rank in gloo(_dist_worker, world, timeout=120) for f in per_rank]
    assert not failures, "\n".join(failures[:10])


def test_bad_shapes_are_clear_errors():
    q, k, v = (t.transpose(0, 1)[None] for t in _qkv())
    with pytest.raises(ValueError, match="positive multiple of key/value heads"):
        kernels.dense_blockdiag_sdpa(q, k[:, :0], v[:, :0], IDS, 0)
    with pytest.raises(ValueError, match="head dims differ"):
        kernels.dense_blockdiag_sdpa(q, k[..., :4], v[..., :4], IDS, 0)
    step = build_cp_step(IDS)
    qt, kt, vt = _qkv()
    with pytest.raises(ValueError, match="positive multiple"):
        cp_varlen_attention(qt, kt[:, :0], vt[:, :0], step)
    with pytest.raises(ValueError, match="head dims differ"):
        cp_varlen_attention(qt, kt[..., :4], vt[..., :4], step)
    bool_ids = IDS > 0
    with pytest.raises(TypeError, match="integer"):
        kernels.precompute_blockdiag_varlen_meta(bool_ids, 0, IDS.numel(), "cpu")
    with pytest.raises(ValueError, match="meta device"):
        kernels.precompute_blockdiag_varlen_meta(IDS.to("meta"), 0, IDS.numel(), "cpu")


def test_prewarm_section_whose_to_dict_raises_is_a_config_error():
    from longtrain.prewarm import PrewarmConfig, PrewarmConfigError

    class Node:
        def to_dict(self):
            raise RuntimeError("interpolation failed")

    with pytest.raises(PrewarmConfigError, match="to_dict\\(\\) raised RuntimeError: interpolation failed"):
        PrewarmConfig.from_dict(Node())


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_sanitize_zeroes_non_finite_elements_and_flags_their_tokens(kernel, dtype, request):
    from longtrain.blockdiag_cp.sanitize import sanitize

    if kernel:
        request.getfixturevalue("triton_interpret")
    x = torch.randn(37, 3, 20, dtype=torch.float64).to(dtype)
    x[5, 1, 3], x[9, 0, 0], x[36, 2, 19] = float("nan"), float("inf"), float("-inf")
    x[20, 0, 0] = torch.finfo(dtype).max  # the largest finite value stays
    clean, bad = sanitize(x, kernel=kernel)
    assert bad.dtype == torch.bool and bad.nonzero().flatten().tolist() == [5, 9, 36]
    expect = x.clone()
    expect[5, 1, 3] = expect[9, 0, 0] = expect[36, 2, 19] = 0
    assert torch.equal(clean, expect)
    y = torch.randn(300, 2, 1100, dtype=dtype).requires_grad_()  # rows longer than one block
    clean, bad = sanitize(y, kernel=kernel)
    assert torch.equal(clean, y.detach()) and not bad.any()
    clean.backward(torch.full_like(clean, 2.0))
    assert torch.equal(y.grad, torch.full_like(y, 2.0))


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fill_rows_sets_flagged_rows_and_zeroes_their_gradient(kernel, dtype, request):
    from longtrain.blockdiag_cp.sanitize import fill_rows

    if kernel:
        request.getfixturevalue("triton_interpret")
    x = torch.randn(50, 3, 700, dtype=dtype).requires_grad_()
    flags = torch.zeros(50, dtype=torch.bool)
    flags[[0, 17, 49]] = True
    out = fill_rows(x, flags, float("nan"), kernel=kernel)
    assert torch.isnan(out[flags]).all() and torch.equal(out[~flags], x.detach()[~flags])
    out.backward(torch.full_like(out, 3.0))
    assert torch.equal(x.grad[flags], torch.zeros_like(x.grad[flags]))
    assert torch.equal(x.grad[~flags], torch.full_like(x.grad[~flags], 3.0))


def test_nonfinite_knob(monkeypatch):
    from longtrain.blockdiag_cp import runtime, state

    calls = []
    real = runtime.sanitize
    monkeypatch.setattr(runtime, "sanitize", lambda x, **kw: calls.append(1) or real(x, **kw))
    q, k, v = _qkv()
    step = build_cp_step(IDS)
    previous = configure_cp_varlen(attn_backend="reference")
    try:
        clean = cp_varlen_attention(q, k, v, step)
        assert len(calls) == 3  # reference does not isolate by itself: q, k and v are sanitized
        configure_cp_varlen(attn_backend="reference", nonfinite="propagate")
        assert state.cp_varlen_runtime_config()["nonfinite"] == "propagate"
        step = build_cp_step(IDS)
        assert torch.equal(cp_varlen_attention(q, k, v, step), clean) and len(calls) == 3  # no pass: same result
        with pytest.raises(ValueError, match="nonfinite must be one of"):
            configure_cp_varlen(nonfinite="ignore")
        assert state.nonfinite_mode() == "propagate"
    finally:
        configure_cp_varlen(**previous)
    assert state.nonfinite_mode() == "isolate" and "nonfinite" not in state.cp_varlen_runtime_config()
