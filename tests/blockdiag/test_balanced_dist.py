"""Balanced CP sharding on gloo (CPU): for W in {2, 3, 4}, every K/V exchange and every parity layout of
``_cp_model.CASES``, a q/k/v/o layer through ``make_cp_blockdiag_batch_and_ctx(..., sharding="balanced")`` +
``cp_blockdiag_sdpa`` equals the single-process float64 dense reference in this rank's outputs (at its planned
positions), the input gradients and the all-reduced parameter gradients; ``layout.unshard`` gives the row back;
a token-sum loss over ranks equals the single-process loss. ``shard_chunk=1`` so that the tiny layouts are cut
head-tail (the default 128 would keep their documents whole)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.blockdiag import _cp_model as cm

pytestmark = pytest.mark.dist

RTOL = 1e-5  # fp32 against the float64 reference, as in test_runtime_dist.py
MODES = ("allgather", "halo", "a2a")


def _run(rank, world, name, mode, backend):
    from longtrain.blockdiag_cp import configure_cp_varlen, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    ids, s, ref, params, x, batch = cm.fp32_case(name)
    previous = configure_cp_varlen(attn_backend=backend, kv_exchange=mode)
    try:
        factory, batch, layout = make_cp_blockdiag_batch_and_ctx(
            cm.FakeMesh(world, rank, dist.group.WORLD), None, batch, sharding="balanced", shard_chunk=1
        )
        with factory() as step:
            pos = step.token_index if not step.contiguous else torch.arange(step.local_len) + step.row_offset
            inside = pos < s
            g_local = torch.zeros(1, pos.numel(), cm.E)
            g_local[:, inside] = ref["g"][:, pos[inside]].float()
            y = cm.attention_layer(batch["inputs_embeds"], params, cp_blockdiag_sdpa)
            (y * g_local).sum().backward()
            labels_row = layout.unshard(batch["labels"])
            y_row = layout.unshard(y.detach())
    finally:
        configure_cp_varlen(**previous)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in [x, *params]]
    for gr in grads:
        dist.all_reduce(gr)
    real = inside.clone()
    real[inside] = ids[pos[inside]] > 0
    failures = []
    tag = f"W={world} rank={rank} case={name} mode={mode} backend={backend}"
    err = cm.rel_err(y.detach()[0, real], ref["y"][0, pos[real]])
    if err > RTOL:
        failures.append(f"{tag}: output rel err {err:.2e}")
    for i, (got, want) in enumerate(zip(grads, [ref["x_grad"], *ref["param_grads"]])):
        err = cm.rel_err(got, want)
        if err > RTOL:
            failures.append(f"{tag}: grad[{i}] rel err {err:.2e}")
    if not torch.equal(labels_row, torch.arange(s)[None]):
        failures.append(f"{tag}: layout.unshard(labels) is not the row")
    row_real = ids > 0
    err = cm.rel_err(y_row[0, row_real], ref["y"][0, row_real])
    if err > RTOL:
        failures.append(f"{tag}: unsharded output rel err {err:.2e}")
    return failures, bool(step.contiguous)


def _worker(rank, world):
    failures, contiguous = [], []
    for name in cm.CASES:
        for mode, backend in [*((m, "auto") for m in MODES), ("allgather", "dense")]:
            f, c = _run(rank, world, name, mode, backend)
            failures += f
            contiguous.append(c)
    return failures, contiguous


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_balanced_parity_every_exchange_and_case(gloo, world):
    results = gloo(_worker, world, timeout=300)
    flat = [f for failures, _ in results for f in failures]
    assert not flat, "\n".join(flat[:20])
    assert not all(c for _, cs in results for c in cs)  # the balanced plans do cut pieces on these layouts


def _loss_worker(rank, world):
    """A token-sum loss over ranks equals the single-process loss (tiny LM: embedding, the layer, a head)."""
    from longtrain.blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    ids = cm.case_ids("straddle_pad")
    s = ids.numel()
    torch.manual_seed(0)
    emb = torch.randn(50, cm.E, dtype=torch.float64)
    head = torch.randn(50, cm.E, dtype=torch.float64)
    params = cm.make_params()
    tokens = torch.randint(0, 50, (1, s))
    labels = torch.where((ids > 0) & (ids == ids.roll(-1)), tokens.roll(-1, 1), -100)
    ref_y = cm.attention_layer(emb[tokens], params, cm.reference_sdpa(ids))
    ref_loss = torch.nn.functional.cross_entropy((ref_y @ head.T)[0], labels[0], ignore_index=-100, reduction="sum")
    batch = {"input_ids": tokens, "labels": labels, "_packed_seq_ids": ids[None]}
    factory, batch, _ = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch, sharding="balanced",
                                                        shard_chunk=1)  # fmt: skip
    with factory():
        y = cm.attention_layer(emb[batch["input_ids"]], params, cp_blockdiag_sdpa)
        loss = torch.nn.functional.cross_entropy((y @ head.T)[0], batch["labels"][0], ignore_index=-100,
                                                 reduction="sum")  # fmt: skip
    dist.all_reduce(loss)
    return float(loss), float(ref_loss)


@pytest.mark.parametrize("world", [2, 3])
def test_token_sum_loss_unchanged(gloo, world):
    for loss, ref in gloo(_loss_worker, world, timeout=120):
        assert abs(loss - ref) <= 1e-9 * abs(ref)


def _keys_worker(rank, world):
    """Every sharded key of a balanced batch is this rank's planned positions of the (padded) full row."""
    from longtrain.blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    lens, s = [5, 9, 3, 7], 24
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor(lens))[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    batch = {
        "input_ids": torch.arange(100, 100 + s)[None],
        "labels": torch.arange(200, 200 + s)[None],
        "position_ids": torch.stack([pos, pos + 1000, pos + 2000]),  # mRoPE planes [3, 1, S]
        "_packed_seq_ids": ids,
    }
    full = {k: v.clone() for k, v in batch.items()}
    loss_mask = (torch.arange(s) % 3 != 0)[None].float()
    _, local, layout = make_cp_blockdiag_batch_and_ctx(
        cm.FakeMesh(world, rank, dist.group.WORLD), None, batch, loss_mask=loss_mask, sharding="balanced",
        shard_chunk=2,
    )  # fmt: skip
    index = layout.step.token_index
    assert not layout.step.contiguous
    grow = layout.padded_seq_len - s
    fills = {"input_ids": 0, "labels": -100, "position_ids": 0, "_packed_seq_ids": 0}
    for key, value in full.items():
        padded = torch.nn.functional.pad(value, (0, grow), value=fills[key])
        assert torch.equal(local[key], padded.index_select(-1, index)), key
        assert torch.equal(layout.unshard(local[key], dim=value.dim() - 1), value), key
    padded_mask = torch.nn.functional.pad(loss_mask, (0, grow), value=0.0)
    assert torch.equal(local["loss_mask"], padded_mask.index_select(-1, index))
    assert torch.equal(local["padding_mask"], torch.nn.functional.pad(ids == 0, (0, grow), value=True)[:, index])
    return True


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_balanced_gathers_every_key_with_the_plan(gloo, world):
    assert all(gloo(_keys_worker, world))
