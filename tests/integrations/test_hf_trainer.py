"""``transformers.Trainer`` with ``attn_implementation="longtrain_blockdiag"``: a tiny Llama (float64, CPU) trained
on documents packed by ``DataCollatorWithFlattening`` equals the same Trainer run with every document in a padded
row of its own (Hugging Face's ``sdpa``), step by step, with gradient accumulation.

Why this comparison is exact: the two runs see the same documents in the same order (one seed, one sampler), and
the Trainer counts the same targets for both (``labels[..., 1:] != -100``: the collator's ``-100`` at each
document's first label stands where a padded row has none), so both losses are the sum over every target of the
accumulated batch divided by one count. The reference attention is ``sdpa`` with a padding mask: transformers'
``eager`` computes its softmax in float32 even for a float64 model. The model's loss is transformers' own
``fixed_cross_entropy`` without ``ForCausalLMLoss``'s upcast to float32 (``_float64_loss``), so the losses and the
updates are float64 results (RMSNorm still normalises in float32 in both runs alike).
"""

from __future__ import annotations

import copy

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


def _model(attn: str):
    hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    model.set_attn_implementation(attn)
    model.loss_function = _float64_loss
    return model


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
