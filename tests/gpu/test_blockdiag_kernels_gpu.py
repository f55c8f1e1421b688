"""GPU parity of the block-diagonal varlen backends with the float64 reference (skipped without CUDA).

Tolerance (tests/gpu/_tolerance.py): a bf16 kernel's max error against the float64 reference
may be at most 2x the error of the same-dtype torch reference (the ``reference`` backend run in bf16) plus
one bf16 rounding step of the reference values.
"""

from __future__ import annotations

import pytest
import torch

from longtrain.blockdiag_cp import kernels
from longtrain.packing import ids_from_lengths
from tests.gpu._tolerance import assert_flash_rule_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# "cudnn:<route>" runs the cudnn provider with providers.cudnn.ROUTE forced: the CuTe DSL route and the graph API
# (which picks its diagonal alignment and backward from the layout).
GPU_BACKENDS = ["flash", "te", "cudnn:cute", "cudnn:graph", "fa4", "cudnn_fa4", "fa4_cudnn", "flex"]


@pytest.fixture(autouse=True)
def _cudnn_route(request, monkeypatch):
    backend = request.node.callspec.params.get("backend", "") if hasattr(request.node, "callspec") else ""
    if backend.startswith("cudnn:"):
        from longtrain.blockdiag_cp.providers import cudnn

        monkeypatch.setattr(cudnn, "ROUTE", backend.split(":")[1])


_ids_from_lengths = ids_from_lengths


def _layouts():
    gen = torch.Generator().manual_seed(3)
    many = torch.randint(1, 31, (600,), generator=gen).tolist()  # ~512 short docs per 8192-token rank
    cases = {
        "straddles_w4": (_ids_from_lengths([37, 200, 1, 1, 90, 300, 5, 150], 240), 4),
        "one_token_docs_w2": (_ids_from_lengths([1] * 60 + [70, 1, 1], 123), 2),
        "single_doc_w4": (_ids_from_lengths([1024], 0), 4),
        "all_padding_rank_w4": (_ids_from_lengths([300, 211], 513), 4),
        "many_docs_8192_w2": (_ids_from_lengths(many, 0)[: 2 * 8192], 2),
    }
    return cases


LAYOUTS = _layouts()


def _skip_unavailable(backend: str, dtype=torch.bfloat16) -> str:
    """Skip when ``backend`` (``name`` or ``cudnn:<route>``) cannot run; return the backend name to call."""
    name, _, route = backend.partition(":")
    reason = kernels._varlen_backend_unavailable_reason(name, dtype, torch.device("cuda"))
    if reason is None and route == "cute":
        from longtrain.blockdiag_cp.providers.cudnn_cute import cute_unavailable_reason

        probe = torch.empty(1, 8, 128, device="cuda", dtype=dtype)
        reason = cute_unavailable_reason(probe, probe)
    if reason is not None:
        pytest.skip(reason)
    return name


def _run(backend, q, k, v, ids, offset, meta, dout):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    v = v.detach().requires_grad_()
    out = kernels._cp_blockdiag_varlen(q, k, v, ids, offset, backend=backend, meta=meta)
    assert out is not None, f"{backend} fell back"
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    return [out.detach(), *[g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (q, k, v))]]


def _assert_flash_rule(kernel, same_dtype_ref, ref64, what):
    assert_flash_rule_all(what, ("out", "dq", "dk", "dv"), kernel, same_dtype_ref, ref64)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backend_matches_float64_reference(backend, layout):
    backend = _skip_unavailable(backend)
    ids, world = LAYOUTS[layout]
    ids = ids.cuda()
    total = ids.numel()
    local = total // world
    hq, hkv, d = 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_all = torch.randn(1, hq, total, d, device="cuda", generator=gen)
    k = torch.randn(1, hkv, total, d, device="cuda", generator=gen)
    v = torch.randn(1, hkv, total, d, device="cuda", generator=gen)
    for rank in range(world):
        off = rank * local
        q = q_all[:, :, off : off + local]
        meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cuda")
        real = (ids[off : off + local] > 0).view(1, 1, local, 1)
        dout = torch.randn(1, hq, local, d, device="cuda", generator=gen) * real
        ref64 = _run("reference", q.double(), k.double(), v.double(), ids, off, meta, dout.double())
        ref16 = _run("reference", q.bfloat16(), k.bfloat16(), v.bfloat16(), ids, off, meta, dout.bfloat16())
        got = _run(backend, q.bfloat16(), k.bfloat16(), v.bfloat16(), ids, off, meta, dout.bfloat16())
        assert (got[0] * ~real).abs().max().item() == 0.0, "padding rows must be exactly zero"
        _assert_flash_rule(got, ref16, ref64, f"{backend} {layout} rank {rank}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("prefix", [8191, 8192])
def test_asymmetric_prefix_under_activation_checkpointing(backend, prefix):
    """One document whose first ``prefix`` tokens live on the previous rank, through non-reentrant AC."""
    backend = _skip_unavailable(backend)
    from torch.utils.checkpoint import checkpoint

    local = 8192
    filler = [local - prefix] if prefix < local else []
    ids = _ids_from_lengths([*filler, prefix + 3000, 2000, local - 5000], 0).cuda()
    off = local
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, hq, local, d, device="cuda", generator=gen)
    k = torch.randn(1, hkv, 2 * local, d, device="cuda", generator=gen)
    v = torch.randn(1, hkv, 2 * local, d, device="cuda", generator=gen)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cuda")
    assert meta["first_k"] > meta["first_q"]
    dout = torch.randn(1, hq, local, d, device="cuda", generator=gen)

    def run_ac(backend, dtype):
        qq, kk, vv = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))

        def layer(a, b, c):
            return kernels._cp_blockdiag_varlen(a, b, c, ids, off, backend=backend, meta=meta)

        out = checkpoint(layer, qq, kk, vv, use_reentrant=False)
        return [out.detach(), *torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype))]

    ref64 = run_ac("reference", torch.float64)
    ref16 = run_ac("reference", torch.bfloat16)
    got = run_ac(backend, torch.bfloat16)
    _assert_flash_rule(got, ref16, ref64, f"{backend} prefix {prefix}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_layer_call_with_validated_meta_makes_no_host_sync(backend):
    backend = _skip_unavailable(backend)
    ids = _ids_from_lengths([700, 300, 900, 1, 2, 500, 1100], 593).cuda()
    local = ids.numel() // 2
    meta = kernels.precompute_blockdiag_varlen_meta(ids, local, local, "cuda")
    q = torch.randn(1, 8, local, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 2 * local, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    for _ in range(2):  # first call validates (one sync) and warms compile / graph caches
        out = kernels._cp_blockdiag_varlen(q, k, v, ids, local, backend=backend, meta=meta)
        out.sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = kernels._cp_blockdiag_varlen(q, k, v, ids, local, backend=backend, meta=meta)
        assert out is not None, "the layer call fell back (a host sync raised inside it?)"
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
