"""The demo model: its CP forward/backward equals the single-rank run (outputs, every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

from longtrain.models import TinyLMConfig


def _row(seq_len: int, seed: int, layout: str):
    from longtrain.corpus import PackedStream, pack_row

    if layout == "stream":
        return PackedStream(seq_len, seed=seed, min_doc=2, max_doc=seq_len // 3).next_row()
    g = torch.Generator().manual_seed(seed)
    text = bytes(torch.randint(97, 123, (seq_len,), generator=g).tolist())
    if layout == "one-doc":  # one document spanning every rank
        return pack_row([text], seq_len)
    if layout == "padding-rank":  # the last rank holds only padding
        return pack_row([text[:7], text[7 : seq_len // 2 - 3]], seq_len)
    if layout == "short-docs":  # many short documents, incl. 2-token ones
        spans, pos = [], 0
        while pos + 6 <= seq_len - 4:
            n = 2 + (pos % 5)
            spans.append(text[pos : pos + n])
            pos += n
        return pack_row(spans, seq_len)
    raise ValueError(layout)


def _cp_vs_single(rank: int, world: int, layout: str, exchange: str) -> dict:
    import torch.distributed as dist

    from longtrain.blockdiag_cp import (
        attach_cp1_packed_varlen_hooks,
        configure_cp_varlen,
        current_blockdiag_cp_state,
        make_cp_blockdiag_batch_and_ctx,
    )
    from longtrain.dsa.layer import DSAAttention
    from longtrain.models import StepInputs, TinyLM
    from longtrain.train import _Mesh, _packed_cu_seqlens, allreduce_grads

    seq_len = 24 * world
    cfg = TinyLMConfig(hidden_size=32, layers="GDSG", dsa={"index_topk": 8})
    torch.manual_seed(0)
    model = TinyLM(cfg).double()
    attach_cp1_packed_varlen_hooks(model)
    row = _row(seq_len, 1, layout)
    num_labels = int((row.labels != -100).sum())

    # Single-rank reference: whole row, dense block-diagonal mask; keep its gradients and logits.
    from longtrain.blockdiag_cp import disable_cp1_packed_varlen, enable_cp1_packed_varlen

    full = row.as_batch()
    cu_full = _packed_cu_seqlens(full["_packed_seq_ids"][0])
    pad_full = full["_packed_seq_ids"][0] == 0
    enable_cp1_packed_varlen(full["_packed_seq_ids"], "dense")
    meta = DSAAttention.prepare_metadata(cu_full, seq_len, padding_mask=pad_full)
    ref_logits = model(full["input_ids"], full["position_ids"], StepInputs(cu_full, pad_full, meta))
    ref_loss = (
        torch.nn.functional.cross_entropy(
            ref_logits.flatten(0, 1), full["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        / num_labels
    )
    ref_loss.backward()
    disable_cp1_packed_varlen()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    configure_cp_varlen(attn_backend="reference", kv_exchange=exchange)
    ctx, local, layout_ = make_cp_blockdiag_batch_and_ctx(_Mesh(dist.group.WORLD), None, row.as_batch())
    with ctx():
        cu = current_blockdiag_cp_state().packed_cu_seqlens.to(torch.int32)
        pad = local["_packed_seq_ids"][0] == 0
        meta = DSAAttention.prepare_metadata(cu, pad.numel(), padding_mask=pad, cp_group=dist.group.WORLD)
        logits = model(local["input_ids"], local["position_ids"], StepInputs(cu, pad, meta, dist.group.WORLD))
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), local["labels"].flatten(), ignore_index=-100, reduction="sum"
            )
            / num_labels
        )
        loss.backward()
    allreduce_grads(model, dist.group.WORLD)
    total = loss.detach().clone()
    dist.all_reduce(total)
    L = seq_len // world
    local_ref = ref_logits[0, rank * L : (rank + 1) * L].detach()
    real = ~pad
    logits_err = float((logits[0][real] - local_ref[real]).abs().max()) if real.any() else 0.0
    grads = dict(model.named_parameters())
    grad_err = max(
        float((grads[n].grad - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in ref_grads.items()
    )
    # Parameters without a single-rank gradient (the indexer's: top-k selection is not differentiable) get zeros.
    others_zero = all(bool((p.grad == 0).all()) for n, p in grads.items() if n not in ref_grads)
    return {
        "loss": float(total),
        "ref_loss": float(ref_loss),
        "logits_err": logits_err,
        "grad_err": grad_err,
        "same_keys": others_zero,
    }


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("layout", ["stream", "one-doc", "padding-rank", "short-docs"])
def test_model_cp_equals_single_rank(gloo, world, layout):
    exchange = "halo" if layout == "stream" else "allgather"
    results = gloo(_cp_vs_single, world, layout, exchange)
    for r in results:
        # float64 end to end: only summation order differs between the CP and single-rank runs.
        assert r["same_keys"]
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-12 * abs(r["ref_loss"])
        assert r["logits_err"] <= 1e-10
        assert r["grad_err"] <= 1e-10
