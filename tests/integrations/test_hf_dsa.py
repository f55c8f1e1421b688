"""``apply_dsa`` on transformers' tiny GLM-MoE-DSA and DeepSeek-V3.2 models (float64, CPU, torch backend): logits,
loss and every parameter gradient equal Hugging Face's eager model run on every document alone, at cp = 1 and on 2
and 3 gloo ranks (``hf_cp_batch``); IndexShare ("shared") layers reuse the previous top-k; no ``[B, S, T]`` tensor.

Tolerance: Hugging Face's eager path computes its softmax and the indexer scores in float32 even for a float64
model, so the reference itself carries float32 rounding (about 1e-7 relative); we compare at 1e-5 relative.
The indexer has 16 heads so that no two keys tie on a score (a relu score of exactly 0 on every head would tie, and
ties are broken differently by the two top-k implementations).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from longtrain.integrations import hf  # noqa: E402

LENS = [7, 12, 5]
RTOL = 1e-5  # the reference's own float32 softmax and indexer scores (module docstring)


def _config(family):
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
        index_topk=4, index_head_dim=16, index_n_heads=16, use_cache=False, max_position_embeddings=128,
    )  # fmt: skip
    if family == "glm":
        return transformers.GlmMoeDsaConfig(**common, mlp_layer_types=["dense"] * 3,
                                            indexer_types=["full", "shared", "full"])  # fmt: skip
    return transformers.DeepseekV32Config(**common, first_k_dense_replace=3)


def _models(family):
    torch.manual_seed(0)
    cls = transformers.GlmMoeDsaForCausalLM if family == "glm" else transformers.DeepseekV32ForCausalLM
    ref = cls(_config(family)).to(torch.float64)
    ref.set_attn_implementation("eager")
    ours = cls(copy.deepcopy(_config(family))).to(torch.float64)
    ours.load_state_dict(ref.state_dict())
    assert hf.apply_dsa(ours, backend="torch") == 3
    return ours, ref


def _row(seed=1, tail=0):
    """Three packed documents, then ``tail`` padding tokens (label -100, attention_mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (1, sum(LENS) + tail), generator=gen)
    pos = torch.cat([torch.arange(n) for n in LENS] + [torch.arange(tail)])[None]
    labels = ids.clone()
    labels[0, sum(LENS) :] = -100
    for start in torch.tensor([0, *LENS]).cumsum(0)[:-1]:
        labels[0, start] = -100
    return ids, pos, labels


def _per_document(ref, ids, labels):
    ref.zero_grad(set_to_none=True)
    logits, start = [], 0
    for n in LENS:
        logits.append(ref(input_ids=ids[:, start : start + n]).logits)
        start += n
    logits = torch.cat(logits, 1)
    shifted = hf.shift_labels(labels)[0, : logits.shape[1]]
    loss = torch.nn.functional.cross_entropy(logits[0], shifted, ignore_index=-100)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


def _check_grads(model, ref_grads):
    for name, p in model.named_parameters():
        if ref_grads[name] is None:  # the indexer: no gradient in Hugging Face (no_grad) nor here (integer top-k)
            assert p.grad is None or not p.grad.any(), name
        else:
            _close(p.grad, ref_grads[name], name)


@pytest.mark.parametrize("tail", [0, 4], ids=["no_padding", "padding_tail"])
@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_one_process_equals_per_document(family, tail):
    ours, ref = _models(family)
    ids, pos, labels = _row(tail=tail)
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    mask = torch.tensor([[1] * sum(LENS) + [0] * tail])
    out = ours(input_ids=ids, position_ids=pos, labels=labels, attention_mask=mask)
    out.loss.backward()
    _close(out.logits[:, : sum(LENS)], ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_forward_only_then_training(mode):
    """An evaluation forward under ``torch.inference_mode`` / ``torch.no_grad`` (the batch built inside it) equals
    the per-document logits, and a training step afterwards the per-document loss and gradients."""
    ours, ref = _models("glm")
    ids, pos, labels = _row(tail=4)
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    mask = torch.tensor([[1] * sum(LENS) + [0] * 4])
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        evaluated = ours(input_ids=ids, position_ids=pos.clone(), attention_mask=mask.clone()).logits
    _close(evaluated[:, : sum(LENS)], ref_logits, "evaluation logits")
    out = ours(input_ids=ids, position_ids=pos, labels=labels, attention_mask=mask)
    out.loss.backward()
    _close(out.logits[:, : sum(LENS)], ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


@pytest.mark.parametrize("lead", [1, 3], ids=["one_leading_pad", "three_leading_pads"])
@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_leading_padding_equals_per_document(family, lead):
    """A row that starts with padding (attention_mask 0, as a left-padded batch has): the padding is a document of
    its own whose rows attend nothing, and the documents after it equal Hugging Face's run on each alone. It used to
    raise a ValueError about cu_seqlens (which the caller never passed): the padding became an empty document."""
    ours, ref = _models(family)
    ids, pos, labels = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    pad_ids = torch.randint(1, 64, (1, lead), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([pad_ids, ids], dim=1)
    pos = torch.cat([torch.arange(lead)[None], pos], dim=1)
    labels = torch.cat([torch.full((1, lead), -100), labels], dim=1)
    mask = torch.tensor([[0] * lead + [1] * sum(LENS)])
    out = ours(input_ids=ids, position_ids=pos, labels=labels, attention_mask=mask)
    out.loss.backward()
    _close(out.logits[:, lead:], ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


@pytest.mark.parametrize("family", ["glm", "deepseek"])
def test_flash_attention_offsets_without_position_ids_equal_per_document(family):
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)``: the documents are
    only in ``cu_seq_lens_q`` (the model's positions run 0..S-1; RoPE is relative, so each document's result is its
    own). ``longtrain_blockdiag`` and ``hf_cp_batch`` read them; ``apply_dsa`` without a CP step ignored them and
    attended across the documents (logits off by 0.68 relative, silently)."""
    ours, ref = _models(family)
    ids, _, labels = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    cu = torch.tensor([0, *LENS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = ours(input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    out.loss.backward()
    _close(out.logits, ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        ours(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 24], dtype=torch.int32))


def test_attention_dropout_in_training_is_refused():
    """The sparse MLA has no dropout: a model training with ``attention_dropout > 0`` (Hugging Face's eager model
    drops attention weights) is refused instead of silently training without it; evaluation runs."""
    torch.manual_seed(0)
    config = _config("glm")
    config.attention_dropout = 0.1
    model = transformers.GlmMoeDsaForCausalLM(config).to(torch.float64)
    hf.apply_dsa(model, backend="torch")
    ids, pos, _ = _row()
    model.train()
    with pytest.raises(ValueError, match="no attention dropout.*attention_dropout=0.1"):
        model(input_ids=ids, position_ids=pos)
    model.eval()
    model(input_ids=ids, position_ids=pos)


def test_shared_layers_reuse_the_previous_top_k(monkeypatch):
    from longtrain.integrations import hf_dsa

    ours, _ = _models("glm")
    ids, pos, _ = _row()
    calls = []
    real = hf_dsa.ops.indexer_topk
    monkeypatch.setattr(hf_dsa.ops, "indexer_topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours(input_ids=ids, position_ids=pos)
    assert len(calls) == 2  # layers 0 and 2 are "full", layer 1 is "shared"


def test_indexer_runs_in_the_model_dtype(monkeypatch):
    """A bf16 model hands the indexer bf16 q and k (fp32 head weights), as Hugging Face's indexer holds them: the
    fused kernel's fp32 path is far slower (an fp32 copy made a 32K-token row 60x slower on the H200)."""
    from longtrain.integrations import hf_dsa

    ours, _ = _models("glm")
    ours.to(torch.bfloat16)
    ids, pos, _ = _row()
    seen = []
    real = hf_dsa.ops.indexer_topk
    monkeypatch.setattr(
        hf_dsa.ops,
        "indexer_topk",
        lambda q, k, w, *a, **kw: seen.append((q.dtype, k.dtype, w.dtype)) or real(q, k, w, *a, **kw),
    )
    ours(input_ids=ids, position_ids=pos)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.float32)] * 2


def test_no_dense_score_matrix(monkeypatch):
    """Around our ops, no tensor of T x T elements (Hugging Face's dense [B, S, T] indexer scores or its mask) is
    created in the forward: a row of 300 tokens, where every other tensor of the tiny model is far smaller than
    300 x 300. (Inside the ops, the torch backend used here is the dense reference; the Triton and cuDNN kernels
    never build the scores: tests/dsa.)"""
    from longtrain.integrations import hf_dsa

    ours, _ = _models("glm")
    inside = []
    for name in ("indexer_topk", "sparse_mla_attention"):
        real = getattr(hf_dsa.ops, name)

        def wrapped(*a, _real=real, **k):
            inside.append(1)
            try:
                return _real(*a, **k)
            finally:
                inside.pop()

        monkeypatch.setattr(hf_dsa.ops, name, wrapped)
    lens = [100, 150, 50]
    ids = torch.randint(1, 64, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    t = ids.shape[1]
    sizes = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not inside:
                sizes.append(out.numel())
            return out

    with Watch():
        ours(input_ids=ids, position_ids=pos)
    assert sizes and max(sizes) < t * t, max(sizes)


def _cp_worker(rank, world, family, sharding="contiguous", tail=0):
    ours, ref = _models(family)
    ids, pos, labels = _row(tail=tail)
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels}
    if tail:
        batch["attention_mask"] = torch.tensor([[1] * sum(LENS) + [0] * tail])
    ctx, kwargs, layout = hf.hf_cp_batch(batch, dist.group.WORLD, sharding=sharding, shard_chunk=2)
    if sharding == "balanced":
        assert not layout.step.contiguous  # several ranges of the row per rank: one DSA kernel call per range
    with ctx():
        out = ours(**kwargs)
        out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    for p in ours.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    _close(loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)
    full = layout.unshard(out.logits.detach())
    _close(full[0, : sum(LENS)], ref_logits[0], "logits")
    return True


@pytest.mark.parametrize(
    "family,world,sharding",
    [("glm", 2, "contiguous"), ("glm", 3, "contiguous"), ("glm", 2, "balanced"), ("glm", 3, "balanced"),
     ("deepseek", 2, "contiguous"), ("deepseek", 2, "balanced")],
)  # fmt: skip
def test_cp_ranks_equal_per_document(gloo, family, world, sharding):
    assert all(gloo(_cp_worker, world, family, sharding, timeout=180))


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (3, "balanced")])
def test_cp_ranks_equal_per_document_with_a_padding_tail(gloo, world, sharding):
    assert all(gloo(_cp_worker, world, "glm", sharding, 5, timeout=180))


def test_errors():
    with pytest.raises(ValueError, match="no DSA attention module"):
        hf.apply_dsa(torch.nn.Linear(2, 2))
    ours, _ = _models("glm")
    ours.eval()
    ids, pos, _ = _row()
    with pytest.raises(ValueError, match="not KV-cache generation"):
        ours(input_ids=ids, position_ids=pos, use_cache=True)


def _disagree_worker(rank, world):
    ours, _ = _models("glm")
    ids, pos, labels = _row()
    if rank == 1:  # other document boundaries on this rank only
        pos = torch.cat([torch.arange(n) for n in (8, 11, 5)])[None]
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, dist.group.WORLD)
    try:
        with ctx():
            ours(**kwargs)
    except Exception as exc:  # the same CPMismatchError on every rank, before the latent KV is gathered
        return type(exc).__name__, str(exc)
    return "no error", ""


def _disagree_knob_worker(rank, world):
    ours, _ = _models("glm")
    if rank == 1:  # the same model and row, its indexer on FP8 codes on this rank only
        hf.apply_dsa(ours, backend="torch", indexer_fp8=True)
    ids, pos, labels = _row()
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, dist.group.WORLD)
    try:
        with ctx():
            ours(**kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_ranks_with_other_dsa_knobs_raise_the_same_error(gloo):
    results = gloo(_disagree_knob_worker, 2, timeout=180)
    assert all(kind == "CPMismatchError" for kind, _ in results), results
    assert len({msg for _, msg in results}) == 1 and "DSA indexer fp8" in results[0][1]


def test_disagreeing_ranks_raise_the_same_error(gloo):
    results = gloo(_disagree_worker, 2, timeout=180)
    assert all(kind == "CPMismatchError" for kind, _ in results), results
    assert len({msg for _, msg in results}) == 1 and "document layout" in results[0][1]


def test_apply_dsa_indexer_fp8_reaches_every_indexer_call(monkeypatch):
    """``apply_dsa(indexer_fp8=True)``: every "full" layer's indexer scores FP8 codes; the sparse attention does not
    change its inputs (its output stays finite and the loss differentiable)."""
    from longtrain.integrations import hf_dsa

    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(_config("glm")).to(torch.float64)
    assert hf.apply_dsa(model, backend="torch", indexer_fp8=True) == 3
    ids, pos, labels = _row()
    seen = []
    real = hf_dsa.ops.indexer_topk
    monkeypatch.setattr(
        hf_dsa.ops, "indexer_topk", lambda *a, fp8=False, **k: seen.append(fp8) or real(*a, fp8=fp8, **k)
    )
    out = model(input_ids=ids, position_ids=pos, labels=labels)
    out.loss.backward()
    assert seen == [True, True] and torch.isfinite(out.loss)
    with pytest.raises(TypeError, match="indexer_fp8 must be a bool"):
        hf.apply_dsa(model, indexer_fp8="no")
    with pytest.raises(ValueError, match="no cudnn route"):  # when applied, not at the first forward
        hf.apply_dsa(model, backend="cudnn", indexer_fp8=True)
