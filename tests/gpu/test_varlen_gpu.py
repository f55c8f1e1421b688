"""GPU parity of ``varlen_attention`` on every provider, and the one-rank CP step's host-sync budget (skipped without
CUDA).

Layouts beyond the CP invariant: documents with more keys than queries anywhere (bottom-right causal), documents
with fewer keys than queries (those queries give zeros), empty documents, ``causal=False``. Tolerance
(tests/gpu/_tolerance.py): a bf16 kernel's max error against the float64 reference may be at most 2x
the error of the same-dtype torch reference (the ``reference`` provider in bf16) plus one bf16 rounding step.
"""

from __future__ import annotations

import pytest
import torch

from longtrain.blockdiag_cp import batch as batch_mod
from longtrain.blockdiag_cp import build_cp_step, cp_blockdiag_sdpa, cp_varlen_attention, providers, varlen_attention
from tests.gpu._tolerance import assert_flash_rule_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ["cudnn:cute", "cudnn:graph", "fa4", "cudnn_fa4", "fa4_cudnn", "flash", "flex", "te"]
LAYOUTS = {
    "square": ([300, 1, 700, 24], [300, 1, 700, 24]),
    "more_keys": ([200, 64, 1, 500], [900, 300, 7, 500]),
    "fewer_keys": ([400, 50, 3], [100, 50, 9]),
    "empty_docs": ([128, 0, 256, 5], [128, 77, 256, 5]),
}


def _balanced_rank_segments() -> tuple[list[int], list[int]]:
    """The one varlen call of rank 1 of a balanced plan (documents 3000, 700, 5000, 300; W = 4): pieces of one
    document twice (head and tail), each over its own copy of the document's prefix."""
    from longtrain.blockdiag_cp import plan_cp_shards
    from longtrain.blockdiag_cp.sharding import rank_pieces

    meta = rank_pieces(plan_cp_shards([3000, 700, 5000, 300], 4), 1, "cpu").meta
    return list(meta.seg_q), list(meta.seg_k)


LAYOUTS["balanced_rank"] = _balanced_rank_segments()


@pytest.fixture(autouse=True)
def _route(request, monkeypatch):
    backend = request.node.callspec.params.get("backend", "") if hasattr(request.node, "callspec") else ""
    if backend.startswith("cudnn:"):
        from longtrain.blockdiag_cp.providers import cudnn

        monkeypatch.setattr(cudnn, "ROUTE", backend.split(":")[1])


def _name(backend: str) -> str:
    name, _, route = backend.partition(":")
    reason = providers.unavailable_reason(name, torch.bfloat16, torch.device("cuda"))
    if reason is None and route == "cute":
        from longtrain.blockdiag_cp.providers.cudnn_cute import cute_unavailable_reason

        probe = torch.empty(1, 8, 128, device="cuda", dtype=torch.bfloat16)
        reason = cute_unavailable_reason(probe, probe)
    if reason is not None:
        pytest.skip(reason)
    return name


def _run(q, k, v, cu_q, cu_k, mq, mk, dout, backend, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, causal=causal, backend=backend)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_attention_matches_float64(backend, layout, causal):
    name = _name(backend)
    seg_q, seg_k = LAYOUTS[layout]
    cu_q = torch.tensor([0, *torch.tensor(seg_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(seg_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(seg_q), 8, 128, device="cuda", generator=gen)
    k = torch.randn(sum(seg_k), 2, 128, device="cuda", generator=gen)
    v = torch.randn(sum(seg_k), 2, 128, device="cuda", generator=gen)
    dout = torch.randn_like(q)
    args = (cu_q, cu_k, max(seg_q), max(seg_k))
    ref64 = _run(q.double(), k.double(), v.double(), *args, dout.double(), "reference", causal)
    ref16 = _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args, dout.bfloat16(), "reference", causal)
    got = _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args, dout.bfloat16(), name, causal)
    assert_flash_rule_all(f"{backend} {layout}", ("out", "dq", "dk", "dv"), got, ref16, ref64)


def test_one_rank_step_makes_no_host_sync_per_layer():
    """``cp_varlen_attention`` and ``cp_blockdiag_sdpa`` on a one-rank step: the first call of the step may sync
    (plan building of the CuTe route), every later layer call makes none."""
    ids = torch.repeat_interleave(torch.arange(1, 8), torch.tensor([700, 300, 900, 1, 2, 500, 1100]))
    ids = torch.cat([ids, torch.zeros(593, dtype=torch.int64)]).cuda()
    step = build_cp_step(ids)
    length = ids.numel()
    q = torch.randn(length, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(length, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    qs, ks, vs = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
    for _ in range(2):  # the step's first calls build plans, graphs and compile
        cp_varlen_attention(q, k, v, step).sum().backward()
        with batch_mod._step_context(step):
            cp_blockdiag_sdpa(qs, ks, vs).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cp_varlen_attention(q, k, v, step).sum().backward()
        with batch_mod._step_context(step):
            cp_blockdiag_sdpa(qs, ks, vs).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("layout", ["square", "more_keys"])
@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn:cute"])
def test_varlen_attention_under_fullgraph_compile_matches_float64(backend, layout):
    """``varlen_attention`` compiled with ``fullgraph=True`` (the custom op of ``blockdiag_cp.compiled``, inductor): the
    provider runs inside the op, the backward recomputes it under autograd; output and every gradient pass the
    flash-attention rule against float64, over two layouts through one compiled function."""
    name = "auto" if backend == "auto" else _name(backend)
    torch._dynamo.reset()

    def attend(q, k, v, cu_q, cu_k, mq, mk):
        return varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=name)

    compiled = torch.compile(attend, fullgraph=True)
    for lay in (layout, "empty_docs"):
        seg_q, seg_k = LAYOUTS[lay]
        cu_q = torch.tensor([0, *torch.tensor(seg_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *torch.tensor(seg_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(sum(seg_q), 8, 128, device="cuda", generator=gen)
        k = torch.randn(sum(seg_k), 2, 128, device="cuda", generator=gen)
        v = torch.randn(sum(seg_k), 2, 128, device="cuda", generator=gen)
        dout = torch.randn_like(q)
        args = (cu_q, cu_k, max(seg_q), max(seg_k))
        ref64 = _run(q.double(), k.double(), v.double(), *args, dout.double(), "reference", True)
        ref16 = _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args, dout.bfloat16(), "reference", True)
        leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        out = compiled(*leaves, *args)
        got = [out.detach(), *torch.autograd.grad(out, leaves, dout.bfloat16())]
        assert_flash_rule_all(f"compiled {backend} {lay}", ("out", "dq", "dk", "dv"), got, ref16, ref64)
