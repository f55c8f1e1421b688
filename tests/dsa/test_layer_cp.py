"""Context-parallel DSA layers (2 gloo ranks, all-gathered latent KV and indexer keys) equal one rank exactly:
outputs, input gradients and every parameter gradient, for a full + shared (IndexShare) stack."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longtrain.dsa import DSAAttention, DSAConfig
from longtrain.dsa.layer import gather_tokens

LAYOUTS = {
    # Documents 3, 4, 2 padded to 4, 5, 3 (CP packing pads every document): rank 0 holds rows 0..5.
    "padded": dict(cu=[0, 3, 7, 9], padded=[0, 4, 9, 12], mask=None, total=12),
    # Trailing pack padding absorbed into the last document; the padding mask stays authoritative.
    "absorbed_padding": dict(cu=[0, 5, 12], padded=None, mask=[False] * 9 + [True] * 3, total=12),
}


def _stack(seed: int, indexer_fp8: bool = False) -> tuple[DSAAttention, DSAAttention]:
    config = DSAConfig(
        hidden_size=32,
        num_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        rope_theta=10_000.0,
        backend="torch",
        indexer_fp8=indexer_fp8,
    )
    torch.manual_seed(seed)
    return DSAAttention(config, 0, "full").double(), DSAAttention(config, 1, "shared").double()


def _forward(layers, x, pos, cu, padded, mask, cp_group):
    full, shared = layers
    meta = DSAAttention.prepare_metadata(cu, x.shape[0], cu_seqlens_padded=padded, padding_mask=mask, cp_group=cp_group)
    h, topk = full(x, pos, cu, metadata=meta, return_topk=True, cp_group=cp_group)
    out = shared(x + h, pos, cu, metadata=meta, prev_topk=topk, cp_group=cp_group)
    return h + out, topk


def _positions(cu, padded, total):
    starts = padded if padded is not None else cu
    pos = torch.zeros(total, dtype=torch.int64)
    for d in range(len(starts) - 1):
        pos[starts[d] : starts[d + 1]] = torch.arange(starts[d + 1] - starts[d])
    return pos


def _cp_vs_single(rank: int, world: int, layout_name: str, indexer_fp8: bool = False) -> dict[str, float]:
    layout = LAYOUTS[layout_name]
    total = layout["total"]
    local = total // world
    rows = slice(rank * local, (rank + 1) * local)
    cu = torch.tensor(layout["cu"], dtype=torch.int32)
    padded = None if layout["padded"] is None else torch.tensor(layout["padded"], dtype=torch.int32)
    mask = None if layout["mask"] is None else torch.tensor(layout["mask"])
    pos = _positions(layout["cu"], layout["padded"], total)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(total, 32, dtype=torch.float64, generator=gen)
    weight = torch.randn(total, 32, dtype=torch.float64, generator=gen)

    layers = _stack(seed=11, indexer_fp8=indexer_fp8)
    x_ref = x.clone().requires_grad_()
    out_ref, topk_ref = _forward(layers, x_ref, pos, cu, padded, mask, None)
    (out_ref * weight).sum().backward()
    ref_grads = {
        n: p.grad.clone()
        for layer in layers
        for n, p in layer.named_parameters(prefix=str(layer.layer_idx))
        if p.grad is not None
    }

    layers = _stack(seed=11, indexer_fp8=indexer_fp8)
    x_local = x[rows].clone().requires_grad_()
    out, topk = _forward(layers, x_local, pos[rows], cu, padded, None if mask is None else mask[rows], dist.group.WORLD)
    (out * weight[rows]).sum().backward()
    diffs = {
        "out": (out - out_ref[rows]).abs().max().item(),
        "topk_equal": float(torch.equal(topk, topk_ref[rows])),
        "x_grad": (x_local.grad - x_ref.grad[rows]).abs().max().item(),
    }
    grads = {
        n: p.grad
        for layer in layers
        for n, p in layer.named_parameters(prefix=str(layer.layer_idx))
        if p.grad is not None
    }
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    for name, grad in grads.items():
        dist.all_reduce(grad)  # every rank holds its rows' share of the parameter gradient
        diffs[f"grad:{name}"] = (grad - ref_grads[name]).abs().max().item() / (
            ref_grads[name].abs().max().item() + 1e-30
        )
    return diffs


def _gather_weights(rank: int, world: int) -> list[float]:
    local = torch.full((2, 3), float(rank + 1), requires_grad=True)
    gathered = gather_tokens(local, dist.group.WORLD)
    assert gathered.shape == (2 * world, 3)
    # Rank r weights the gathered rows by (r + 1): the local gradient sums every rank's weight.
    (gathered * float(rank + 1)).sum().backward()
    return [gathered[:, 0].tolist(), local.grad[:, 0].tolist()]


@pytest.mark.dist
def test_gather_tokens_forward_order_and_summed_backward(gloo):
    results = gloo(_gather_weights, 2)
    for gathered, grad in results:
        assert gathered == [1.0, 1.0, 2.0, 2.0]
        assert grad == [3.0, 3.0]  # weights 1 and 2 -> local gradient 3


@pytest.mark.dist
@pytest.mark.parametrize("indexer_fp8", [False, True], ids=["bf16_scores", "fp8_scores"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cp_layers_equal_single_rank(gloo, layout, indexer_fp8):
    """The FP8 indexer quantizes each query row and head and each key row on its own: CP changes none of its codes."""
    for diffs in gloo(_cp_vs_single, 2, layout, indexer_fp8):
        assert diffs["topk_equal"] == 1.0
        # float64 on both sides; CP only reorders sums (all-reduced gradient shares).
        assert diffs["out"] < 1e-12 and diffs["x_grad"] < 1e-12, diffs
        assert all(v < 1e-10 for k, v in diffs.items() if k.startswith("grad:")), diffs


def _step_forward(layers, x, pos, step):
    full, shared = layers
    h, topk = full(x, pos, return_topk=True, cp_step=step)
    return h + shared(x + h, pos, prev_topk=topk, cp_step=step), topk


def _step_vs_single(rank: int, world: int, sharding: str = "contiguous", indexer_fp8: bool = False) -> dict[str, float]:
    """DSA layers driven by a block-diagonal CPStep (no cu_seqlens, no metadata) equal the one-rank step; a balanced
    step owns several ranges of the row (pieces of 2 tokens and more)."""
    from longtrain.blockdiag_cp import build_cp_step
    from tests.blockdiag._cp_model import FakeMesh

    ids = torch.tensor([1] * 5 + [2] * 7 + [3] * 1 + [0] * 3)
    total, local = ids.numel(), ids.numel() // world
    rows = slice(rank * local, (rank + 1) * local)
    pos = torch.cat([torch.arange(n) for n in (5, 7, 1, 3)])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(total, 32, dtype=torch.float64, generator=gen)
    weight = torch.randn(total, 32, dtype=torch.float64, generator=gen) * (ids > 0)[:, None]
    layers = _stack(seed=5, indexer_fp8=indexer_fp8)
    x_ref = x.clone().requires_grad_()
    out_ref, topk_ref = _step_forward(layers, x_ref, pos, build_cp_step(ids))
    (out_ref * weight).sum().backward()
    ref_grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # e.g. the shared layer's unused indexer
        for layer in layers
        for n, p in layer.named_parameters(prefix=str(layer.layer_idx))
    }
    layers = _stack(seed=5, indexer_fp8=indexer_fp8)
    step = build_cp_step(ids, FakeMesh(world, rank, dist.group.WORLD) if world > 1 else None, sharding=sharding,
                         shard_chunk=2)  # fmt: skip
    if sharding == "balanced":
        assert not step.contiguous
        rows = step.token_index
    x_local = x[rows].clone().requires_grad_()
    out, topk = _step_forward(layers, x_local, pos[rows], step)
    assert "dsa_parts" in step.cache  # built once for the step, shared by both layers
    (out * weight[rows]).sum().backward()
    real = ids[rows] > 0
    diffs = {
        "out": (out - out_ref[rows])[real].abs().max().item(),
        "topk_equal": float(torch.equal(topk[real], topk_ref[rows][real])),
        "x_grad": (x_local.grad - x_ref.grad[rows]).abs().max().item(),
    }
    for layer in layers:
        for name, p in layer.named_parameters(prefix=str(layer.layer_idx)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(grad)
            diffs[f"grad:{name}"] = (grad - ref_grads[name]).abs().max().item() / (
                ref_grads[name].abs().max().item() + 1e-30
            )
    return diffs


def _check_step_diffs(diffs):
    assert diffs["topk_equal"] == 1.0
    # float64 on both sides; CP only reorders sums (all-reduced gradient shares).
    assert diffs["out"] < 1e-12 and diffs["x_grad"] < 1e-12, diffs
    assert all(v < 1e-10 for k, v in diffs.items() if k.startswith("grad:")), diffs


def test_layers_with_a_one_rank_cp_step():
    _check_step_diffs(_step_vs_single(0, 1))


@pytest.mark.dist
def test_layers_with_a_cp_step_on_two_ranks(gloo):
    for diffs in gloo(_step_vs_single, 2):
        _check_step_diffs(diffs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_layers_with_a_balanced_cp_step(gloo, world):
    for diffs in gloo(_step_vs_single, world, "balanced"):
        _check_step_diffs(diffs)


@pytest.mark.dist
def test_layers_with_the_fp8_indexer_on_a_balanced_cp_step(gloo):
    """Each rank's FP8 codes are its rows' and heads' own, whatever rows it owns: a balanced step equals one rank."""
    for diffs in gloo(_step_vs_single, 2, "balanced", True):
        _check_step_diffs(diffs)


def _balanced_refusals(rank: int, world: int) -> bool:
    from longtrain.blockdiag_cp import build_cp_step
    from tests.blockdiag._cp_model import FakeMesh

    ids = torch.tensor([1] * 5 + [2] * 7 + [3] * 1 + [0] * 3)
    step = build_cp_step(ids, FakeMesh(world, rank, dist.group.WORLD), sharding="balanced", shard_chunk=2)
    full, _ = _stack(seed=1)
    x, pos = torch.randn(8, 32, dtype=torch.float64), torch.arange(8)
    with pytest.raises(ValueError, match="pass neither metadata nor cu_seqlens"):
        full(x, pos, torch.tensor([0, 16], dtype=torch.int32), cp_step=step)
    with pytest.raises(ValueError, match="use parts_for_step"):
        DSAAttention.metadata_for_step(step)
    return True


@pytest.mark.dist
def test_balanced_step_refuses_external_metadata(gloo):
    assert all(gloo(_balanced_refusals, 2))


def _disagreeing(rank: int, world: int, sharding: str = "contiguous", knob: bool = False):
    """Rank 1 builds its step from other ids, or (``knob``) its DSA layer scores the FP8 indexer where rank 0's
    scores bf16 (they would select different keys): every rank raises the same CPMismatchError before any
    collective. Returns ``(message, collectives issued)``."""
    from longtrain.blockdiag_cp import CPMismatchError, build_cp_step
    from tests.blockdiag._cp_model import FakeMesh, count_collectives

    ids = torch.tensor([1] * 5 + [2] * 7 + [3] * 1 + [0] * 3)
    if rank == 1 and not knob:
        ids[5] = 1  # document 1 one token longer on this rank only
    step = build_cp_step(ids, FakeMesh(world, rank, dist.group.WORLD), sharding=sharding, shard_chunk=2)
    full, _ = _stack(seed=1, indexer_fp8=knob and rank == 1)
    x = torch.randn(step.local_len, 32, dtype=torch.float64)
    try:
        with count_collectives() as counts:
            full(x, torch.arange(step.local_len), cp_step=step)
    except CPMismatchError as exc:
        return str(exc), dict(counts)
    return "no error", dict(counts)


@pytest.mark.dist
def test_ranks_with_other_dsa_knobs_raise_before_the_gather(gloo):
    results = gloo(_disagreeing, 2, "contiguous", True, timeout=60)
    assert all("DSA indexer fp8" in msg for msg, _ in results), results
    assert len({msg for msg, _ in results}) == 1 and all(counts == {} for _, counts in results)


def test_rank_knobs_name_every_setting_that_changes_the_selection():
    full, shared = _stack(seed=0, indexer_fp8=True)
    knobs = dict(full.rank_knobs())
    expected = {"DSA backend": "torch", "DSA indexer fp8": True, "DSA top-k": 3, "DSA indexer heads x dim": (2, 16)}
    assert knobs == expected
    assert shared.rank_knobs() == full.rank_knobs()


@pytest.mark.dist
@pytest.mark.parametrize("sharding", ["contiguous", "balanced"])
def test_disagreeing_ranks_raise_before_the_gather(gloo, sharding):
    results = gloo(_disagreeing, 2, sharding, timeout=60)
    assert all("document layout" in msg for msg, _ in results), results
    assert len({msg for msg, _ in results}) == 1 and all(counts == {} for _, counts in results)


def _one_rank_fails(rank: int, world: int, case: str) -> str:
    full, _ = _stack(0)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    rows = 7 if case == "uneven_rows" and rank == 1 else 6
    mask = None
    if case == "padding_hole" and rank == 1:  # a padding row followed by a real row of its document: refused there
        mask = torch.tensor([False, True, False, False, False, False])
    x = torch.randn(rows, 32, dtype=torch.float64)
    try:
        full(x, torch.arange(rows), cu, padding_mask=mask, cp_group=dist.group.WORLD)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case", ["uneven_rows", "padding_hole"])
def test_a_check_failing_on_one_rank_fails_every_rank(gloo, case):
    """With ``cp_group=``, a rank whose rows or layout fail its checks raises its reason, and every other rank a
    ``CPMismatchError`` naming the disagreement, before the all-gather (never a rank left waiting in it)."""
    first, second = gloo(_one_rank_fails, 2, case, timeout=60)
    field = "local_rows" if case == "uneven_rows" else "checks"
    assert first.startswith("CPMismatchError") and f"CP ranks disagree on {field}" in first, first
    assert second.startswith("ValueError") and second != "no error", second


def _one_rank_fails_on_a_step(rank: int, world: int, case: str) -> str:
    """With ``cp_step=``, rank 1's first DSA call fails its own checks (x of the wrong row count; a shared layer's
    prev_topk of the wrong shape): it raises its ValueError, and rank 0, which would wait for it in the step's rank
    check, a CPMismatchError at once."""
    from longtrain.blockdiag_cp import CPMismatchError, build_cp_step
    from tests.blockdiag._cp_model import FakeMesh

    step = build_cp_step(torch.tensor([1] * 5 + [2] * 7), FakeMesh(world, rank, dist.group.WORLD))
    full, shared = _stack(seed=1)
    rows = step.local_len - 1 if case == "rows" and rank == 1 else step.local_len
    x, pos = torch.randn(rows, 32, dtype=torch.float64), torch.arange(rows)
    topk = torch.zeros(rows, 2 if rank == 1 else 3, dtype=torch.int32)
    try:
        (full if case == "rows" else shared)(x, pos, cp_step=step, prev_topk=topk)
    except (CPMismatchError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case", ["rows", "prev_topk"])
def test_a_check_failing_on_one_rank_of_a_cp_step_fails_every_rank(gloo, case):
    first, second = gloo(_one_rank_fails_on_a_step, 2, case, timeout=60)
    assert first.startswith("CPMismatchError") and "argument checks" in first, first
    assert second.startswith("ValueError") and ("rows" in second or "prev_topk" in second), second
