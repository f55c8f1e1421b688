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


def _stack(seed: int) -> tuple[DSAAttention, DSAAttention]:
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


def _cp_vs_single(rank: int, world: int, layout_name: str) -> dict[str, float]:
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

    layers = _stack(seed=11)
    x_ref = x.clone().requires_grad_()
    out_ref, topk_ref = _forward(layers, x_ref, pos, cu, padded, mask, None)
    (out_ref * weight).sum().backward()
    ref_grads = {
        n: p.grad.clone()
        for layer in layers
        for n, p in layer.named_parameters(prefix=str(layer.layer_idx))
        if p.grad is not None
    }

    layers = _stack(seed=11)
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
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cp_layers_equal_single_rank(gloo, layout):
    for diffs in gloo(_cp_vs_single, 2, layout):
        assert diffs["topk_equal"] == 1.0
        # float64 on both sides; CP only reorders sums (all-reduced gradient shares).
        assert diffs["out"] < 1e-12 and diffs["x_grad"] < 1e-12, diffs
        assert all(v < 1e-10 for k, v in diffs.items() if k.startswith("grad:")), diffs
