"""``cp_blockdiag_sdpa`` in one process: stock SDPA outside a context, the exchange-path decision list, the
one-rank step (varlen, dense, kernel fallback; no collective), checkpoint recompute after the context exited,
a hand-built legacy state dict, and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longtrain.blockdiag_cp import batch as batch_mod
from longtrain.blockdiag_cp import build_cp_step, compiled, configure_cp_varlen, cp_blockdiag_sdpa, runtime, state
from tests.blockdiag import _cp_model as cm
from tests.blockdiag._kernels_util import patch_provider


@pytest.fixture(autouse=True)
def _restore():
    previous = state.cp_varlen_runtime_config()
    yield
    state.configure_cp_varlen(**previous)
    state._CP_LAST_EXITED_STATE.set(None)


@pytest.fixture
def one_rank(monkeypatch):
    """Stub collectives of a one-rank group (torch.distributed stays uninitialised)."""
    calls = []

    def all_gather(bufs, x, group=None, async_op=False):
        calls.append("all_gather")
        bufs[0].copy_(x)

    def reduce_scatter(out, chunks, op=None, group=None, async_op=False):
        calls.append("reduce_scatter")
        out.copy_(chunks[0])

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "reduce_scatter", reduce_scatter)
    return calls


def _step(ids: torch.Tensor, backend: str = "auto", exchange: str = "allgather", world: int = 1):
    """A step of ``ids`` (padded to a multiple of ``world``) for rank 0 of ``world`` stub ranks."""
    mesh = cm.FakeMesh(world, 0) if world > 1 else None
    ids = torch.cat([ids, ids.new_zeros((-ids.numel()) % world)])
    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: world
    try:
        return build_cp_step(ids, mesh, attn_backend=backend, kv_exchange=exchange)
    finally:
        dist.get_world_size = orig


def test_outside_a_context_is_exactly_stock_sdpa():
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(7, 7) > 0.3
    mask |= torch.eye(7, dtype=torch.bool)
    for kwargs in ({"is_causal": True}, {"attn_mask": mask, "scale": 0.3}):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        got = cp_blockdiag_sdpa(q, k, v, enable_gqa=True, unknown_kwarg="dropped", **kwargs)
        assert torch.equal(got, want)
    assert runtime.ORIGINAL_SDPA is F.scaled_dot_product_attention


def test_decision_list_early_exits_need_no_process_group(monkeypatch):
    ids = cm.case_ids("straddle_pad")
    steps = {key: _step(ids, *key, world=2) for key in [("auto", "allgather"), ("dense", "halo"), ("te", "a2a")]}

    def no_dist(*args, **kwargs):
        raise AssertionError("no distributed call expected before rule 4")

    monkeypatch.setattr(dist, "get_world_size", no_dist)
    sel = runtime.select_kv_exchange_path
    path, reason = sel(steps["auto", "allgather"], "reference", torch.float32)
    assert path == "allgather" and "mode=allgather" in reason
    path, reason = sel(steps["dense", "halo"], "dense", torch.float32)
    assert path == "allgather" and "flash/te" in reason and "dense" in reason
    path, reason = sel(steps["te", "a2a"], "te", torch.bfloat16, dropout_p=0.1)
    assert path == "allgather" and "dropout" in reason
    assert sel(steps["te", "a2a"], "te", torch.bfloat16, dropout_p=0.1) == (path, reason)  # memoised on the step
    assert _step(ids, "reference", "halo").kv_plan is None  # one rank: nothing to exchange
    assert sel(_step(ids, "reference", "halo"), "reference", torch.float32)[0] == "allgather"


def test_cross_node_heuristic(monkeypatch):
    ids = cm.case_ids("straddle_pad")
    step = _step(ids, "reference", "halo", world=4)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv(runtime.ALLOW_XNODE_ENV, raising=False)
    path, reason = runtime.select_kv_exchange_path(step, "reference", torch.float32)
    assert path == "allgather" and "spans nodes" in reason
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert runtime._cp_group_spans_nodes(None) is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv(runtime.ALLOW_XNODE_ENV, "1")
    assert runtime._cp_group_spans_nodes(None) is False


def _qkv(s: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, h, s, cm.D, generator=g, dtype=dtype, requires_grad=True) for h in (cm.HQ, cm.HKV, cm.HKV)]


def _reference(ids, q, k, v):
    out = cm.reference_sdpa(ids)(q.detach().double(), k.detach().double(), v.detach().double())
    return out * (ids > 0).view(1, 1, -1, 1)


@pytest.mark.parametrize("backend", ["auto", "reference", "dense"])
@pytest.mark.parametrize("legacy", [False, True], ids=["step", "hand_built_dict"])
def test_cp_path_on_one_rank_matches_reference(one_rank, backend, legacy):
    ids = cm.case_ids("many_short")
    q, k, v = _qkv(ids.numel())
    published = _step(ids, backend)
    if legacy:  # a hand-built state dict (group, ids, offset, knobs) is converted to a step once
        published = {"group": None, "doc_ids": ids[None], "row_offset": 0, "attn_backend": backend}
    token = state._CP_BLOCKDIAG_STATE.set(published)
    try:
        state.reset_cp_attn_fire_count()
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True)
        assert state.cp_attn_fire_count() == 1
        out.sum().backward()
    finally:
        state._CP_BLOCKDIAG_STATE.reset(token)
    real = ids > 0
    # fp32 vs float64 reference (max-norm relative): a few roundings over <= 4-token documents
    assert cm.rel_err(out[:, :, real], _reference(ids, q, k, v)[:, :, real]) <= 1e-5
    assert one_rank == []  # one rank: block-diagonal with no collective
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_kernel_declining_falls_back_to_dense_on_the_allgather_path(one_rank, monkeypatch):
    ids = cm.case_ids("straddle_pad")
    q, k, v = _qkv(ids.numel())
    calls = []

    def declining(*args, **kwargs):
        calls.append("reference")
        raise RuntimeError("kernel declined")

    patch_provider(monkeypatch, "reference", declining)
    token = state._CP_BLOCKDIAG_STATE.set(_step(ids, "reference"))
    try:
        out = cp_blockdiag_sdpa(q, k, v)
    finally:
        state._CP_BLOCKDIAG_STATE.reset(token)
    assert calls == ["reference"]
    real = ids > 0
    assert cm.rel_err(out[:, :, real], _reference(ids, q, k, v)[:, :, real]) <= 1e-5
    # dense padding rows attend to themselves: finite, equal to V at that position (GQA head repeat)
    pad = ~real
    torch.testing.assert_close(out[:, :, pad], v.detach().repeat_interleave(2, 1)[:, :, pad], rtol=0, atol=0)


def test_recompute_after_the_context_exited_is_a_clear_error(one_rank):
    ids = cm.case_ids("straddle_pad")
    q, k, v = _qkv(ids.numel())
    with batch_mod._step_context(_step(ids, "reference")):
        out = checkpoint(lambda a, b, c: cp_blockdiag_sdpa(a, b, c), q, k, v, use_reentrant=False)
    with pytest.raises(RuntimeError, match="inside `with ctx_factory"):
        out.sum().backward()
    # A forward outside any context means CP is no longer in use: the guard clears itself.
    out = checkpoint(lambda a, b, c: cp_blockdiag_sdpa(a, b, c, enable_gqa=True), q, k, v, use_reentrant=False)
    out.sum().backward()
    assert state._CP_LAST_EXITED_STATE.get() is None


def test_backward_inside_the_context_with_checkpointing(one_rank):
    ids = cm.case_ids("one_doc")
    q, k, v = _qkv(ids.numel())
    grads = []
    for ckpt in (False, True):
        for t in (q, k, v):
            t.grad = None
        with batch_mod._step_context(_step(ids, "reference")):
            fn = lambda a, b, c: cp_blockdiag_sdpa(a, b, c)  # noqa: E731
            out = checkpoint(fn, q, k, v, use_reentrant=False) if ckpt else fn(q, k, v)
            out.pow(2).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_torch_compile_runs_the_runtime_eagerly(one_rank):
    ids = cm.case_ids("straddle_pad")
    q, k, v = (t.detach() for t in _qkv(ids.numel()))
    step = _step(ids, "reference")
    with batch_mod._step_context(step):
        want = cp_blockdiag_sdpa(q, k, v)
    import torch._dynamo  # noqa: F401  (as torch.compile would)

    compiled.maybe_disable_dynamo()
    assert compiled.IMPL["cp_blockdiag_sdpa"] is not runtime._cp_blockdiag_sdpa_impl

    @torch.compile(backend="eager")
    def layer(a, b, c):
        return cp_blockdiag_sdpa(a * 1.0, b, c) + 0.0

    with batch_mod._step_context(step):
        got = layer(q, k, v)
    assert torch.equal(got, want)


def test_unknown_exchange_in_hand_built_state_is_a_clear_error():
    ids = cm.case_ids("straddle_pad")
    with pytest.raises(ValueError, match="kv_exchange"):
        _step(ids, "reference", "ring")
    token = state._CP_BLOCKDIAG_STATE.set({"group": None, "doc_ids": ids[None], "row_offset": 0, "kv_exchange": "ring"})
    try:
        with pytest.raises(ValueError, match="kv_exchange"):
            cp_blockdiag_sdpa(*_qkv(ids.numel()))
    finally:
        state._CP_BLOCKDIAG_STATE.reset(token)
    configure_cp_varlen()  # knobs still valid


def test_calls_that_are_not_this_ranks_shard_are_a_clear_error(one_rank):
    ids = cm.case_ids("straddle_pad")
    q, k, v = _qkv(ids.numel())
    with batch_mod._step_context(_step(ids, "reference")), pytest.raises(ValueError, match="this rank's shard"):
        cp_blockdiag_sdpa(q[:, :, :5], k[:, :, :5], v[:, :, :5])
