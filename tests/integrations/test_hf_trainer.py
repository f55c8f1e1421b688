"""``transformers.Trainer`` with ``attn_implementation="longtrain_blockdiag"``: a tiny Llama (float64, CPU) trained
on documents packed by ``DataCollatorWithFlattening`` equals the same Trainer run with every document in a padded
row of its own (Hugging Face's ``sdpa``), step by step, with gradient accumulation; on 2 and 4 gloo ranks
``hf.CPTrainer`` (DDP, CP and both) equals one process; what CP cannot train is refused.

Why this comparison is exact: the two runs see the same documents in the same order (one seed, one sampler), and
the Trainer counts the same targets for both (``labels[..., 1:] != -100``: the collator's ``-100`` at each
document's first label stands where a padded row has none), so both losses are the sum over every target of the
accumulated batch divided by one count. The reference attention is ``sdpa`` with a padding mask: transformers'
``eager`` computes its softmax in float32 even for a float64 model. The model's loss is transformers' own
``fixed_cross_entropy`` without ``ForCausalLMLoss``'s upcast to float32 (``_float64_loss``), so the losses and the
updates are float64 results (RMSNorm still normalises in float32 in both runs alike).
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from longtrain.integrations import hf  # noqa: E402

# Document lengths: 1 (a document with no target), 2, and long ones; 12 documents, 3 per batch.
LENS = [7, 12, 1, 30, 5, 17, 9, 2, 25, 11, 3, 14]
BATCH, ACCUM, STEPS = 3, 2, 2  # 2 optimizer steps of 2 accumulated batches of 3 packed documents: one epoch


def _float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
    """transformers' ``ForCausalLMLoss`` (shift over the row, ``fixed_cross_entropy``: a sum divided by
    ``num_items_in_batch``) without its upcast of the logits to float32."""
    from transformers.loss.loss_utils import fixed_cross_entropy

    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return fixed_cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), num_items_in_batch,
                               ignore_index, **kw)  # fmt: skip


def _model(attn: str, dtype: torch.dtype = torch.float64):
    """The tiny Llama; in float64 with ``_float64_loss``, else with transformers' own loss (float32 logits)."""
    hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.set_attn_implementation(attn)
    if dtype == torch.float64:
        model.loss_function = _float64_loss
    return model


def _dsa_model():
    """The tiny GLM-MoE-DSA of test_hf_dsa.py (float64, 3 layers, IndexShare) with its middle layer a routed MoE
    (4 experts, 2 per token), and ``apply_dsa``'s torch backend."""
    from tests.integrations.test_hf_dsa import _config

    torch.manual_seed(0)
    config = _config("glm")
    config.mlp_layer_types = ["dense", "sparse", "dense"]
    config.update(dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16))
    model = transformers.GlmMoeDsaForCausalLM(config).to(torch.float64)
    model.set_experts_implementation("eager")  # the grouped-mm one takes no float64
    assert type(model.model.layers[1].mlp).__name__ == "GlmMoeDsaMoE"
    assert hf.apply_dsa(model, backend="torch") == 3
    model.loss_function = _float64_loss
    return model


# What a CP worker trains: the model and the TrainingArguments it adds (bf16: the Trainer's autocast on CPU).
MODELS = {
    "llama": (lambda: _model(hf.ATTN_IMPLEMENTATION), {}),
    # SGD: the MoE router scores in float32 inside Hugging Face's code, so CP and one process round a few routing
    # weights apart by a float32 ulp; AdamW would amplify that on the gradient elements near 0 (one gate_proj entry
    # off by 6e-5 relative), SGD keeps it at float32 rounding of the gradient, far below float64 assert_close. (Checked
    # by hand: with the router patched to score in float64, AdamW matches one process too.)
    "dsa": (_dsa_model, {"optim": "sgd"}),
    "llama-bf16": (lambda: _model(hf.ATTN_IMPLEMENTATION, torch.float32), {"bf16": True, "optim": "sgd"}),
    # The Trainer's torch.compile of the model (aot_eager: dynamo and AOT autograd without inductor's codegen time);
    # the one-process reference runs eagerly.
    "llama-compiled": (
        lambda: _model(hf.ATTN_IMPLEMENTATION),
        {"torch_compile": True, "torch_compile_backend": "aot_eager"},
    ),
}


def _documents():
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()} for n in LENS]


def _padded_rows(features):
    """Every document a row of its own, right-padded (labels -100, attention_mask 0)."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def _args(out_dir, accum=ACCUM, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, report_to=[], save_strategy="no", max_steps=STEPS, seed=0,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=accum, learning_rate=1e-2, logging_steps=1,
        disable_tqdm=True, **kw,
    )  # fmt: skip


def _train(trainer):
    """Train; returns (the loss of every micro-batch as ``training_step`` returned it, the batches, final weights)."""
    losses, batches, step = [], [], trainer.training_step

    def recording(model, inputs, num_items_in_batch=None):
        batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        losses.append(step(model, inputs, num_items_in_batch))
        return losses[-1]

    trainer.training_step = recording
    trainer.train()
    return torch.stack(losses), batches, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("collator", ["position_ids", "flash_attn_kwargs"])
def test_packed_trainer_equals_padded_rows(tmp_path, collator):
    """Trainer + DataCollatorWithFlattening + longtrain_blockdiag (documents from the position ids, or from
    ``cu_seq_lens_q`` with ``return_flash_attn_kwargs=True``) == Trainer + one padded row per document + sdpa:
    every micro-batch loss and the final weights (float64; AdamW, gradient accumulation 2, clipping on); and the
    first optimizer step's loss is the token mean over all documents of its two batches, each run alone."""
    flatten = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=collator == "flash_attn_kwargs")
    base = _model("sdpa")
    ours = copy.deepcopy(base)
    ours.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    packed = transformers.Trainer(model=ours, args=_args(tmp_path), train_dataset=_documents(), data_collator=flatten)
    got, batches, got_w = _train(packed)
    padded = transformers.Trainer(
        model=copy.deepcopy(base), args=_args(tmp_path), train_dataset=_documents(), data_collator=_padded_rows
    )
    want, ref_batches, want_w = _train(padded)
    assert [b["input_ids"].shape[0] for b in batches] == [1] * (ACCUM * STEPS)  # one packed row per batch
    assert [b["input_ids"].shape[0] for b in ref_batches] == [BATCH] * (ACCUM * STEPS)
    torch.testing.assert_close(got, want)  # float64 both: the same sums in another order
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(got_w["model.embed_tokens.weight"], base.model.embed_tokens.weight)

    total, count = 0.0, 0  # the first optimizer step, by hand: every document alone, initial weights
    with torch.no_grad():
        for batch in batches[:ACCUM]:
            ids, labels = batch["input_ids"][0], batch["labels"][0]
            starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.numel()]
            for a, b in zip(starts[:-1], starts[1:]):
                logits = base(input_ids=ids[None, a:b]).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits, labels[a + 1 : b], reduction="sum")
                count += b - a - 1
    torch.testing.assert_close(got[:ACCUM].sum(), total / count)  # float64 both


@contextlib.contextmanager
def _launched(rank, world, launched=True):
    """The environment torchrun sets for this rank (unless ``launched`` is false), then accelerate's process-wide
    state reset, so the next Trainer of this worker process starts afresh."""
    from accelerate.state import AcceleratorState, GradientState

    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    if launched:
        os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _cp_worker(rank, world, cp, accum, out_dir, checkpointed=False, kind="llama"):
    """One rank of a (world / cp) x cp Trainer run: returns its micro-batch losses and the final weights."""
    import torch.distributed as dist

    with _launched(rank, world):  # what torchrun sets: the Trainer (accelerate) sees every rank
        groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]
        # cp = 1: the plain Trainer (DDP, each rank rows of its own)
        cp_kwargs = {"cp_mesh": groups[rank // cp]} if cp > 1 else {}
        if kind.endswith("-balanced"):  # pieces of 2 tokens: these short rows are really dealt out in pieces
            cp_kwargs.update(cp_sharding="balanced", cp_shard_chunk=2)
        build, extra = MODELS[kind.removesuffix("-balanced")]
        trainer = (hf.CPTrainer if cp > 1 else transformers.Trainer)(
            model=build(),
            args=_args(
                out_dir, accum, gradient_checkpointing=checkpointed, include_num_input_tokens_seen=True, **extra
            ),
            train_dataset=_documents(),
            data_collator=transformers.DataCollatorWithFlattening(),
            **cp_kwargs,
        )
        from longtrain.integrations import hf_trainer

        shardings, cp_batch = [], hf_trainer.hf_cp_batch

        def recording(*args, **kwargs):
            ctx, local, layout = cp_batch(*args, **kwargs)
            shardings.append((layout.step.shard_plan.sharding, layout.step.pieces is None))
            return ctx, local, layout

        hf_trainer.hf_cp_batch = recording
        try:
            losses, batches, weights = _train(trainer)
        finally:
            hf_trainer.hf_cp_batch = cp_batch
        assert {s for s, _ in shardings} == ({cp_kwargs.get("cp_sharding", "contiguous")} if cp > 1 else set())
        assert all(one_range for _, one_range in shardings) != kind.endswith("-balanced")
        assert trainer.model.is_gradient_checkpointing == checkpointed
        if extra.get("torch_compile"):
            from torch._dynamo.utils import counters

            assert counters["stats"]["unique_graphs"] > 0  # the Trainer did compile the model
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [b["input_ids"] for b in batches], weights, logged, trainer.state.num_input_tokens_seen


@pytest.mark.dist
@pytest.mark.parametrize(
    "world, cp, checkpointed, kind",
    [(2, 2, False, "llama"), (2, 2, True, "llama"), (2, 1, False, "llama"), (4, 2, False, "llama"),
     (2, 2, False, "dsa"), (2, 2, False, "llama-compiled"), (2, 2, False, "llama-balanced")],
    ids=["cp2", "cp2-checkpointed", "ddp2-cp1", "dp2xcp2", "dsa-cp2", "cp2-compiled", "cp2-balanced"],
)  # fmt: skip
def test_cp_trainer_equals_one_process(gloo, tmp_path, world, cp, checkpointed, kind):
    """``hf.CPTrainer`` on ``world`` gloo ranks in CP groups of ``cp`` (the replicas: world / cp; at cp = 1 the plain
    Trainer under DDP) == the plain Trainer in one process accumulating the replicas' batches (``ACCUM x
    replicas``): the same documents per optimizer step, the same token mean, so the same weights; the ranks of a CP
    group trained the same rows. ``checkpointed``: the CP run with ``gradient_checkpointing=True`` (the attention
    recomputed in the backward, inside the step's context), the reference without. ``dsa``: the tiny GLM-MoE-DSA
    with a routed MoE layer and ``apply_dsa`` (sparse attention over the indexer's top-k, sharded by CP; the indexer
    gets no gradient: DDP finds it unused, as the Trainer asks by default). ``llama-compiled``: the CP ranks with
    ``TrainingArguments(torch_compile=True)``, the reference eager. ``llama-balanced``: ``cp_sharding="balanced"``."""
    dp = world // cp
    ranks = gloo(_cp_worker, world, cp, ACCUM, str(tmp_path), checkpointed, kind, timeout=300)
    build, extra = MODELS[kind.removesuffix("-compiled").removesuffix("-balanced")]
    reference = transformers.Trainer(
        model=build(), args=_args(tmp_path, ACCUM * dp, include_num_input_tokens_seen=True, **extra),
        train_dataset=_documents(), data_collator=transformers.DataCollatorWithFlattening())  # fmt: skip
    want, ref_batches, want_w = _train(reference)
    assert not torch.equal(want_w["model.embed_tokens.weight"], build().model.embed_tokens.weight)
    for r, (_, rows, weights, logged, tokens_seen) in enumerate(ranks):
        assert tokens_seen == reference.state.num_input_tokens_seen  # each row counted once, not once per CP rank
        assert all(torch.equal(a, b) for a, b in zip(rows, ranks[r - r % cp][1]))  # one CP group, one row
        for name, w in want_w.items():
            torch.testing.assert_close(weights[name], w, msg=lambda m, name=name, r=r: f"rank {r}, {name}: {m}")
        # the logged loss (the global token mean): the Trainer accumulates it in a float32 tensor
        want_logged = [h["loss"] for h in reference.state.log_history if "loss" in h]
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(want_logged))
    # A rank's loss is its share of the global token mean, times the world (the Trainer's scaling for DDP's
    # average): per optimizer step, the ranks' losses sum to world x the single process's.
    per_step = torch.stack([losses.view(STEPS, ACCUM).sum(1) for losses, *_ in ranks]).sum(0) / world
    torch.testing.assert_close(per_step, want.view(STEPS, ACCUM * dp).sum(1))  # float64 both
    seen = sorted(tuple(x.tolist()) for losses_rows in ranks[::cp] for x in losses_rows[1])
    assert seen == sorted(tuple(b["input_ids"].tolist()) for b in ref_batches)  # every batch once per replica set


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_documents())


def _refusals_worker(rank, world, out_dir):
    """Every refusal of CPTrainer over a CP group of 2 ranks, as the message it raises."""
    import torch.distributed as dist

    flatten = transformers.DataCollatorWithFlattening()
    cases = {
        "compute_loss_func": dict(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss),
        "label_smoothing_factor": dict(args=_args(out_dir, label_smoothing_factor=0.1)),
        "iterable_dataset": dict(train_dataset=_Stream()),
        "not_launched": {},
    }
    errors = {}
    for case, kwargs in cases.items():
        # not_launched: the Trainer sees one process (no WORLD_SIZE), CP sees two
        with _launched(rank, world, launched=case != "not_launched"):
            try:
                kwargs = {"args": _args(out_dir), "train_dataset": _documents(), **kwargs}
                trainer = hf.CPTrainer(model=_model(hf.ATTN_IMPLEMENTATION), data_collator=flatten,
                                       cp_mesh=dist.group.WORLD, **kwargs)  # fmt: skip
                trainer.get_train_dataloader()
            except (ValueError, RuntimeError) as exc:
                errors[case] = f"{type(exc).__name__}: {exc}"
    return errors


@pytest.mark.dist
def test_cp_trainer_refuses_what_it_cannot_train(gloo, tmp_path):
    """A custom loss or label smoothing would shift the sharded (already shifted) labels again; an IterableDataset
    cannot be re-sharded over the replicas; a Trainer that does not see every rank would not wrap DDP."""
    for errors in gloo(_refusals_worker, 2, str(tmp_path), timeout=300):
        assert errors["compute_loss_func"].startswith("ValueError: CPTrainer: compute_loss_func is not supported")
        assert "label_smoothing_factor" in errors["label_smoothing_factor"]
        assert "map-style" in errors["iterable_dataset"] and "IterableDataset" in errors["iterable_dataset"]
        assert errors["not_launched"].startswith("RuntimeError") and "torchrun" in errors["not_launched"]


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.dist
def test_cp_trainer_bf16_meets_the_flash_attention_rule(gloo, tmp_path):
    """``bf16=True`` (the Trainer's autocast on CPU; float32 weights, transformers' float32 loss) at cp = 2 against
    the float64 run in one process: every optimizer step's loss and every weight's update (final minus initial)
    within 2x the error of the same bf16 Trainer in one process plus one bf16 rounding step (2**-8, relative to the
    reference's largest magnitude). SGD: AdamW's near-sign update turns bf16 gradient noise into updates of +-lr
    (both bf16 runs' weights 20-30% off the float64 ones, which would hide any error of CP); SGD's update is the
    gradient's."""
    ranks = gloo(_cp_worker, 2, 2, ACCUM, str(tmp_path), False, "llama-bf16", timeout=300)
    init = {n: p.detach().double() for n, p in _model(hf.ATTN_IMPLEMENTATION).named_parameters()}
    runs = {}
    for kind in ("llama", "llama-bf16"):
        build, extra = MODELS[kind]
        args = _args(tmp_path, **{**extra, "optim": "sgd"})
        trainer = transformers.Trainer(model=build(), args=args, train_dataset=_documents(),
                                       data_collator=transformers.DataCollatorWithFlattening())  # fmt: skip
        losses, _, weights = _train(trainer)
        runs[kind] = losses.view(STEPS, ACCUM).sum(1), weights
    (want, want_w), (one, one_w) = runs["llama"], runs["llama-bf16"]
    per_step = torch.stack([losses.view(STEPS, ACCUM).sum(1) for losses, *_ in ranks]).sum(0) / 2
    errors = {"losses": (_rel_err(per_step, want), _rel_err(one, want))}
    for r, (_, _, weights, _, _) in enumerate(ranks):
        assert all(w.dtype == torch.float32 for w in weights.values())
        for name, w in want_w.items():
            update = w - init[name]
            errors[f"rank {r}, {name}"] = (_rel_err(weights[name] - init[name], update),
                                           _rel_err(one_w[name] - init[name], update))  # fmt: skip
    for what, (got, bound) in errors.items():
        assert got <= 2 * bound + 2**-8, (what, got, bound)
