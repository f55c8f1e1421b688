"""One CP step at every world size: ``build_cp_step``, the one-rank path (``cp_mesh=None`` and a real one-rank gloo
group), Hugging Face style batches (``position_ids`` restarts, no ids) at W = 1, 2, 3, and ``cp_varlen_attention``
on gloo W = 2, 3 for every exchange. Everything against the float64 per-document reference: outputs and all
gradients (fp32 runs: max-norm relative error <= 1e-5, a handful of fp32 roundings over <= 130 keys)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longtrain.blockdiag_cp import (
    CPStep,
    build_cp_step,
    configure_cp_varlen,
    cp_blockdiag_sdpa,
    cp_varlen_attention,
    make_cp_blockdiag_batch_and_ctx,
)
from tests.blockdiag import _cp_model as cm

RTOL = 1e-5
MODES = ("allgather", "halo", "a2a")


def test_build_cp_step_fields_and_errors():
    ids = cm.case_ids("straddle_pad")  # 27 positions
    step = build_cp_step(ids[None])
    assert isinstance(step, CPStep) and (step.world_size, step.rank, step.row_offset, step.local_len) == (1, 0, 0, 27)
    assert step.kv_plan is None and step.meta is step.varlen_meta and step.full_len == 27
    assert step.varlen_meta.seg_q == (5, 9, 3, 6) and step.varlen_meta.n_real == 23
    assert step.packed_cu_seqlens.tolist() == [0, 5, 14, 17, 23, 27]
    assert step.doc_ids.shape == (1, 27) and step.doc_ids.dtype == torch.int64
    assert step.model_state.packed_cu_seqlens is step.packed_cu_seqlens
    with pytest.raises(AttributeError):
        step.rank = 1  # frozen
    assert build_cp_step(ids, attn_backend="ref", kv_exchange="Needed").attn_backend == "reference"
    for bad, exc, match in [
        (torch.ones(2, 8, dtype=torch.int64), ValueError, "one packed row"),
        (torch.ones(8), TypeError, "integer"),
        (torch.ones(8, dtype=torch.bool), TypeError, "integer"),
        (torch.tensor([1, 0, 1, 1]), ValueError, "tail"),
        (torch.tensor([1, 2, 1, 0]), ValueError, "runs"),
        (torch.ones(8, dtype=torch.int64, device="meta"), ValueError, "meta device"),
    ]:
        with pytest.raises(exc, match=match):
            build_cp_step(bad)
    with pytest.raises(ValueError, match="attention backend"):
        build_cp_step(ids, attn_backend="fa3")
    with pytest.raises(TypeError, match=r"2-D DeviceMesh.*mesh\[.cp.\]"):
        build_cp_step(ids, type("Mesh2D", (), {"ndim": 2, "mesh_dim_names": ("dp", "cp")})())
    with pytest.raises(TypeError, match="cp_mesh must be"):
        build_cp_step(ids, 3)


def _layer_run(ids: torch.Tensor, mesh, batch_extra: dict | None = None, use_ids: bool = True):
    """The q/k/v/o layer of ``_cp_model`` on this rank through the batch builder; local outputs and reduced grads."""
    s = ids.numel()
    x64, _ = cm.make_inputs(s)
    ref = cm.reference_run(ids)
    params = [p.float().requires_grad_() for p in cm.make_params()]
    x = x64.float().requires_grad_()
    batch = {"inputs_embeds": x, **(batch_extra or {})}
    if use_ids:
        batch["_packed_seq_ids"] = ids[None].clone()
    factory, batch, layout = make_cp_blockdiag_batch_and_ctx(mesh, None, batch)
    with factory() as step:
        y = cm.attention_layer(batch["inputs_embeds"], params, cp_blockdiag_sdpa)
        off, local = step.row_offset, step.local_len
        n_in = max(0, min(s, off + local) - off)
        g_local = torch.zeros(1, local, cm.E)
        g_local[:, :n_in] = ref["g"][:, off : off + n_in].float()
        (y * g_local).sum().backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in [x, *params]]
    if step.world_size > 1:
        for g in grads:
            dist.all_reduce(g)
    real = ids[off : off + n_in] > 0
    errs = [cm.rel_err(y.detach()[:, :n_in][:, real], ref["y"][:, off : off + n_in][:, real])]
    errs += [cm.rel_err(a, b) for a, b in zip(grads, [ref["x_grad"], *ref["param_grads"]])]
    return errs


@pytest.mark.parametrize("case", sorted(cm.CASES))
def test_one_rank_without_a_mesh_equals_the_reference(case):
    errs = _layer_run(cm.case_ids(case), None)
    assert max(errs) <= RTOL, errs


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face packing's position ids: restart at 0 on every document (padding counts on, as a collator's)."""
    pos = torch.zeros_like(ids)
    for i in range(1, ids.numel()):
        pos[i] = 0 if ids[i] != ids[i - 1] else pos[i - 1] + 1
    return pos


def _hf_batch(ids: torch.Tensor) -> dict:
    """position_ids restarting per document and, when the row has padding, a 0/1 attention mask; no ids."""
    extra = {"position_ids": _positions(ids)[None]}
    if bool((ids == 0).any()):
        extra["attention_mask"] = (ids > 0).to(torch.int64)[None]
    return extra


def _one_rank_group_worker(rank: int, world: int):
    out = {}
    for case in sorted(cm.CASES):
        ids = cm.case_ids(case)
        out[case] = max(_layer_run(ids, dist.group.WORLD)) if rank == 0 else None
        out[f"hf:{case}"] = max(_layer_run(ids, dist.group.WORLD, _hf_batch(ids), use_ids=False))
    return out


@pytest.mark.dist
def test_real_one_rank_group_equals_the_reference(gloo):
    (res,) = gloo(_one_rank_group_worker, 1, timeout=120)
    assert all(err <= RTOL for err in res.values()), res


def test_hf_style_batch_on_one_rank_equals_the_reference():
    for case in sorted(cm.CASES):
        ids = cm.case_ids(case)
        errs = _layer_run(ids, None, _hf_batch(ids), use_ids=False)
        assert max(errs) <= RTOL, (case, errs)


def _hf_worker(rank: int, world: int):
    failures = []
    for case in sorted(cm.CASES):
        ids = cm.case_ids(case)
        for mode in MODES:
            previous = configure_cp_varlen(kv_exchange=mode)
            try:
                errs = _layer_run(ids, cm.FakeMesh(world, rank, dist.group.WORLD), _hf_batch(ids), use_ids=False)
            finally:
                configure_cp_varlen(**previous)
            if max(errs) > RTOL:
                failures.append(f"W={world} rank={rank} {case} {mode}: {errs}")
    return failures


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_hf_style_batch_on_several_ranks_equals_the_reference(gloo, world):
    failures = [f for per_rank in gloo(_hf_worker, world, timeout=240) for f in per_rank]
    assert not failures, "\n".join(failures[:10])


def _thd_worker(rank: int, world: int):
    """``cp_varlen_attention`` on THD shards of a step (no batch builder, no published context)."""
    failures = []
    for case in sorted(cm.CASES):
        ids = cm.case_ids(case)
        s = ids.numel()
        full = s + (-s) % world
        ids_full = torch.cat([ids, ids.new_zeros(full - s)])
        gen = torch.Generator().manual_seed(5)
        q64 = torch.randn(full, cm.HQ, cm.D, generator=gen, dtype=torch.float64)
        k64 = torch.randn(full, cm.HKV, cm.D, generator=gen, dtype=torch.float64)
        v64 = torch.randn(full, cm.HKV, cm.D, generator=gen, dtype=torch.float64)
        g64 = torch.randn(full, cm.HQ, cm.D, generator=gen, dtype=torch.float64) * (ids_full > 0)[:, None, None]
        ref_in = [t.clone().requires_grad_() for t in (q64, k64, v64)]
        sdpa = cm.reference_sdpa(ids_full)
        ref = sdpa(*(t.transpose(0, 1)[None] for t in ref_in))[0].transpose(0, 1)
        ref_grads = torch.autograd.grad((ref * g64).sum(), ref_in)
        for mode in MODES:
            step = build_cp_step(ids_full, cm.FakeMesh(world, rank, dist.group.WORLD), kv_exchange=mode)
            rows = slice(step.row_offset, step.row_offset + step.local_len)
            local = [t[rows].float().requires_grad_() for t in (q64, k64, v64)]
            out = cp_varlen_attention(*local, step)
            (out * g64[rows].float()).sum().backward()
            grads = [t.grad.clone() for t in local]
            full_grads = []
            for g in grads:  # every rank's slice of dq/dk/dv, gathered
                parts = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(parts, g)
                full_grads.append(torch.cat(parts))
            real = ids_full[rows] > 0
            errs = [cm.rel_err(out.detach()[real], ref.detach()[rows][real])]
            errs += [cm.rel_err(g, r) for g, r in zip(full_grads, ref_grads)]
            paths = [v[0] for key, v in step.cache.items() if key[0] == "path"]
            if max(errs) > RTOL:
                failures.append(f"W={world} rank={rank} {case} {mode} path={paths}: {errs}")
            if mode != "allgather" and paths != [mode if mode == "a2a" or step.kv_plan.use_halo else "a2a"]:
                failures.append(f"W={world} rank={rank} {case} {mode}: path {paths}")
    return failures


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_cp_varlen_attention_every_exchange(gloo, world):
    failures = [f for per_rank in gloo(_thd_worker, world, timeout=240) for f in per_rank]
    assert not failures, "\n".join(failures[:10])


def test_cp_varlen_attention_checks_its_arguments():
    step = build_cp_step(cm.case_ids("one_doc"))
    q, k = torch.randn(22, cm.HQ, cm.D), torch.randn(22, cm.HKV, cm.D)
    with pytest.raises(TypeError, match="CPStep"):
        cp_varlen_attention(q, k, k, {"doc_ids": None})
    with pytest.raises(ValueError, match="22 rows"):
        cp_varlen_attention(q[:10], k[:10], k[:10], step)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        cp_varlen_attention(q[:, :3], k, k, step)
    with pytest.raises(ValueError, match="positive multiple"):
        cp_varlen_attention(q, k[:, :0], k[:, :0], step)
    with pytest.raises(ValueError, match="head dims"):
        cp_varlen_attention(q, k[..., :4], k[..., :4], step)
    # stock SDPA would run -0.1 as no dropout and 1.0 as an all-zero output, silently
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            cp_varlen_attention(q, k, k, step, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        cp_varlen_attention(q, k, k, step, dropout_p=None)
    with pytest.raises(ValueError, match="empty row"):  # an IndexError before
        build_cp_step(torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["reference", "dense"])
def test_the_step_keeps_its_own_ids(backend):
    """A frozen step copies the caller's ids: reusing the ids buffer for the next row changes neither the step's
    ``doc_ids`` nor its answer (the dense path reads ``doc_ids``, the varlen path the metadata)."""
    from longtrain.blockdiag_cp import build_cp_step, cp_varlen_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    ids = torch.tensor([1] * 5 + [2] * 7)
    step = build_cp_step(ids, None, attn_backend=backend)
    before = cp_varlen_attention(q, k, v, step)
    ids.fill_(1)
    assert step.doc_ids.data_ptr() != ids.data_ptr()
    assert step.doc_ids[0].tolist() == [1] * 5 + [2] * 7
    assert torch.equal(cp_varlen_attention(q, k, v, step), before)
