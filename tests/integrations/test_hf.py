"""Hugging Face integration: a tiny Llama (float64, CPU) with ``attn_implementation="longtrain_blockdiag"`` equals
Hugging Face's per-document result (every document run alone) in logits, loss and every parameter gradient, at
cp = 1 (packed position ids, flash-attention offsets, a padding mask, several rows) and on 2 and 3 gloo ranks
through ``hf_cp_batch`` (labels shifted over the full row before sharding); FSDP2 + CP gradients; clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from longtrain.integrations import hf  # noqa: E402

LENS = [7, 12, 5]  # three documents ...
TAIL = 4  # ... and a padding tail
RTOL = 1e-6


def _config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
    )  # fmt: skip


def _models(seed=0):
    """(ours, reference): the same weights; ours runs longtrain_blockdiag, the reference eager attention."""
    hf.register()
    torch.manual_seed(seed)
    ref = transformers.LlamaForCausalLM(_config()).to(torch.float64)
    ref.set_attn_implementation("eager")
    ours = transformers.LlamaForCausalLM(_config()).to(torch.float64)
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    return ours, ref


def _row(seed=1, tail=TAIL):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (1, sum(LENS) + tail), generator=gen)
    pos = torch.cat([torch.arange(n) for n in LENS] + [torch.arange(tail)])[None]
    real = torch.tensor([1] * sum(LENS) + [0] * tail)[None]
    labels = torch.where(real.bool(), ids, -100)
    for start in torch.tensor([0, *LENS]).cumsum(0)[:-1]:
        labels[0, start] = -100  # DataCollatorWithFlattening's separator: no prediction across documents
    return ids, pos, real, labels


def _per_document(ref, ids, labels):
    """Hugging Face run on every document alone: logits of the real rows, the loss of the packed row (mean over its
    labels, shifted over the full row like the model does) and every parameter gradient."""
    ref.zero_grad(set_to_none=True)
    logits, start = [], 0
    for n in LENS:
        logits.append(ref(input_ids=ids[:, start : start + n]).logits)
        start += n
    logits = torch.cat(logits, 1)
    shifted = hf.shift_labels(labels)[:, : logits.shape[1]]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


def _check_grads(model, ref_grads):
    for name, p in model.named_parameters():
        _close(p.grad, ref_grads[name], name)


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens", "attention_mask"])
def test_one_process_equals_per_document(source):
    ours, ref = _models()
    ids, pos, real, labels = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    kwargs = {"position_ids": pos}
    if source == "cu_seq_lens":  # DataCollatorWithFlattening(return_flash_attn_kwargs=True); the tail its own run
        cu = torch.tensor([0, *LENS, TAIL]).cumsum(0).to(torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENS), max_length_k=max(LENS))
    if source == "attention_mask":  # a padding mask; the documents still come from the position ids
        kwargs["attention_mask"] = real
    out = ours(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    _close(out.logits[:, : sum(LENS)], ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens", "attention_mask"])
def test_forward_only_then_training_equals_per_document(source, mode):
    """An evaluation forward under ``torch.inference_mode`` / ``torch.no_grad`` (the batch built inside it) gives
    the per-document logits, and a training step on the same batch afterwards the per-document gradients."""
    ours, ref = _models()
    ids, pos, real, labels = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    cu = torch.tensor([0, *LENS, TAIL]).cumsum(0).tolist()

    def batch():
        kwargs = {"position_ids": pos.clone()}
        if source == "cu_seq_lens":
            offsets = torch.tensor(cu, dtype=torch.int32)
            kwargs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(LENS), max_length_k=max(LENS))
        if source == "attention_mask":
            kwargs["attention_mask"] = real.clone()
        return kwargs

    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        kwargs = batch()
        evaluated = ours(input_ids=ids, **kwargs).logits
    _close(evaluated[:, : sum(LENS)], ref_logits, "evaluation logits")
    if mode == "inference_mode":  # inference tensors cannot enter autograd: the training step brings its own batch
        kwargs = batch()
    out = ours(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    _close(out.logits[:, : sum(LENS)], ref_logits, "logits")
    _close(out.loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("path", ["one_process", "hf_cp_batch_step"])
def test_autocast_bf16_meets_the_flash_attention_rule(path):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (Trainer's ``bf16=True``) Llama's q and k leave RoPE
    in float32 and v a Linear in bf16: the attention casts them like SDPA does (it raised "dtypes differ" before).
    Logits and gradients (backward outside autocast, as users run it) against the float64 model: at most 2x the
    error of Hugging Face's own sdpa under the same autocast plus one bf16 rounding step (2**-8)."""
    ours, ref = _models()
    ids, pos, _, labels = _row(tail=0)
    exact = copy.deepcopy(ours)
    exact.zero_grad(set_to_none=True)
    exact(input_ids=ids, position_ids=pos, labels=labels).loss.backward()
    want = exact(input_ids=ids, position_ids=pos).logits.detach()
    ref.set_attn_implementation("sdpa")
    errors = {}
    for name, model in (("ours", ours), ("sdpa", ref)):
        model.float().zero_grad(set_to_none=True)
        ctx, kwargs = (hf.hf_cp_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, None)[:2]
                       if name == "ours" and path == "hf_cp_batch_step" else (None, None))  # fmt: skip
        with ctx() if ctx is not None else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(**(kwargs or {"input_ids": ids, "position_ids": pos, "labels": labels}))
            assert out.logits.dtype == torch.bfloat16
            out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        errors[name] = [_rel_err(out.logits, want)]
        errors[name] += [_rel_err(grads[n], p.grad) for n, p in exact.named_parameters()]
    for got, bound in zip(errors["ours"], errors["sdpa"]):
        assert got <= 2 * bound + 2**-8, (got, bound)


@pytest.mark.parametrize("path", ["one_process", "hf_cp_batch_step"])
def test_torch_compile_equals_eager_over_changing_layouts(path):
    """``torch.compile(model)`` (aot_eager: dynamo's tracing and AOT autograd, without inductor's codegen time): each
    call with a different packed layout of the same length gives the eager logits and gradients, never the first
    layout's documents again (the attention's host work runs eagerly at a graph break, on every call)."""
    torch._dynamo.reset()
    ours, _ = _models()
    compiled = torch.compile(copy.deepcopy(ours), backend="aot_eager")
    ids = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(3))
    for lens in ([10, 14], [3, 12, 9]):
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        runs = []
        for model in (ours, compiled):
            model.zero_grad(set_to_none=True)
            if path == "hf_cp_batch_step":
                ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "labels": ids, "position_ids": pos}, None)
            else:
                ctx, kwargs = torch.enable_grad, {"input_ids": ids, "labels": ids, "position_ids": pos}
            with ctx():
                out = model(**kwargs)
                out.loss.backward()
            runs.append([out.logits.detach(), *(p.grad for p in model.parameters())])
        for got, want in zip(runs[1], runs[0]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)  # float64: AOT autograd reorders sums only


def test_generation_with_a_kv_cache_is_refused():
    """transformers' KV cache hands the attention more keys than queries from the first decoded token on: a clear
    error naming the fix, never logits over the wrong keys. Without a cache every step is a full causal forward
    (queries == keys) and greedy decoding equals Hugging Face's, left-padded prompts included."""
    ours, ref = _models()
    ours.eval(), ref.eval()
    ids = torch.randint(1, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    prefill = ours(input_ids=ids[:1], use_cache=True)
    _close(prefill.logits, ref(input_ids=ids[:1]).logits, "prefill logits")
    with pytest.raises(ValueError, match="generate with model.set_attn_implementation"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=True)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
    for row in range(2):  # each prompt alone (Hugging Face's eager attention gives NaN logits to a left-padded row)
        prompt = ids[row : row + 1, mask[row].bool()]
        want = ref.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True)
        assert torch.equal(got[row, -4:], want[0, -4:]), f"row {row}"


def test_cu_seq_lens_k_disagreeing_with_q_is_refused():
    """Packed training attends each document to itself: key offsets other than the query offsets are a ValueError,
    never ignored (the documents came from ``cu_seq_lens_q`` alone)."""
    ours, _ = _models()
    ids, pos, _, labels = _row()
    cu = torch.tensor([0, *LENS, TAIL]).cumsum(0).to(torch.int32)
    other = cu.clone()
    other[1] += 1
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        ours(input_ids=ids, labels=labels, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=other,
             max_length_q=max(LENS), max_length_k=max(LENS))  # fmt: skip


def test_float_position_ids_give_the_same_documents_at_every_world_size():
    """Float position ids restart documents as integer ones do, with and without a step (``hf_cp_batch`` used to
    skip them and see one document)."""
    _, pos, _, _ = _row()
    _check_per_document_with_and_without_a_step(pos.to(torch.float32))


def test_a_position_jump_is_a_document_at_every_world_size():
    """A padded row whose second document's positions start at 5, not 0: Hugging Face's rule (and ours at cp = 1)
    makes it a document, and so does the step ``hf_cp_batch`` builds (it used to take only restarts at 0 there)."""
    _, pos, _, _ = _row()
    pos = pos.clone()
    pos[0, LENS[0] : LENS[0] + LENS[1]] += 5
    _check_per_document_with_and_without_a_step(pos)


def _check_per_document_with_and_without_a_step(pos):
    """The padded row with ``pos`` gives each document's own logits at cp = 1 and through ``hf_cp_batch``'s step."""
    ours, ref = _models()
    ids, _, real, labels = _row()
    ref_logits, _, _ = _per_document(ref, ids, labels)
    plain = ours(input_ids=ids, position_ids=pos, attention_mask=real).logits.detach()
    _close(plain[:, : sum(LENS)], ref_logits, "cp = 1")
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "attention_mask": real}, None)
    with ctx():
        stepped = ours(**kwargs).logits.detach()
    _close(stepped[:, : sum(LENS)], ref_logits, "hf_cp_batch step")


def test_seq_idx_passes_through_on_one_rank():
    """``seq_idx`` (sequence-state layers' document resets) reaches the model whole at cp = 1 (it used to be
    dropped: a Mamba-style layer would then run its state across documents)."""
    ids, pos, real, labels = _row()
    seq_idx = torch.repeat_interleave(torch.arange(4), torch.tensor([*LENS, TAIL]))[None].to(torch.int32)
    ctx, kwargs, layout = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "seq_idx": seq_idx}, None)
    grow = layout.padded_seq_len - ids.shape[1]
    assert (
        torch.equal(kwargs["seq_idx"][:, : ids.shape[1]], seq_idx) and kwargs["seq_idx"].shape[1] == ids.shape[1] + grow
    )


def test_a_callers_num_items_in_batch_is_kept():
    """A count the caller brings (e.g. over gradient-accumulation steps) normalises the loss, not the row's own."""
    ours, _ = _models()
    ids, pos, _, labels = _row()
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, None)
    own = int(kwargs["num_items_in_batch"])
    ctx2, kwargs2, _ = hf.hf_cp_batch(
        {"input_ids": ids, "position_ids": pos, "labels": labels, "num_items_in_batch": torch.tensor(4 * own)}, None
    )
    assert int(kwargs2["num_items_in_batch"]) == 4 * own
    with ctx():
        loss = ours(**kwargs).loss.detach()
    with ctx2():
        loss4 = ours(**kwargs2).loss.detach()
    _close(loss4 * 4, loss, "loss over a 4x count")


def _seq_idx_worker(rank, world):
    ids, pos, _, _ = _row()
    try:
        hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "seq_idx": torch.zeros_like(ids)}, dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_seq_idx_is_refused_on_several_ranks(gloo):
    for message in gloo(_seq_idx_worker, 2):
        assert "seq_idx" in message and "not exact under CP" in message


def _wrong_impl_worker(rank, world):
    ours, _ = _models()
    ids, pos, _, labels = _row()
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, dist.group.WORLD)
    messages = []
    for impl in ("sdpa", hf.ATTN_IMPLEMENTATION):
        ours.set_attn_implementation(impl)
        try:
            with ctx():
                ours(**kwargs).loss.backward()
            messages.append("no error")
        except RuntimeError as exc:
            messages.append(str(exc))
    return messages


def test_a_model_not_on_the_cp_attention_is_refused_on_several_ranks(gloo):
    """A model left on 'sdpa' under hf_cp_batch's step attends only inside each rank's shard: the context refuses
    it on exit, on every rank; the same step with the model on our attention runs."""
    for sdpa, ours in gloo(_wrong_impl_worker, 2):
        assert "no attention layer used it" in sdpa and "attn_implementation='longtrain_blockdiag'" in sdpa
        assert ours == "no error"


def test_rows_with_padding_equal_hugging_face():
    """Two rows, left and right padding, no packing: Hugging Face's own masked result per row."""
    ours, ref = _models()
    ids = torch.randint(1, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 7:] = 0
    a = ours(input_ids=ids, attention_mask=mask).logits
    for row in range(2):
        keep = mask[row].bool()
        alone = ref(input_ids=ids[row : row + 1, keep]).logits[0]
        _close(a[row, keep], alone, f"row {row}")


def test_hugging_face_sdpa_packed_needs_use_cache_false():
    """Why the reference runs every document alone: with the cache on (Llama's default config), Hugging Face's own
    sdpa path does not see packed position ids and attends across documents; ours does not depend on it."""
    hf.register()
    torch.manual_seed(0)
    config = _config()
    config.use_cache = True
    ref = transformers.LlamaForCausalLM(config).to(torch.float64)
    ref.set_attn_implementation("sdpa")
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).to(torch.float64)
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    ids, pos, _, _ = _row(tail=0)
    crossed = ref(input_ids=ids, position_ids=pos).logits
    packed = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    mine = ours(input_ids=ids, position_ids=pos).logits
    assert (crossed - packed).abs().max() > 1e-3
    _close(mine, packed, "logits")


def _cp_worker(rank, world):
    ours, ref = _models()
    ids, pos, real, labels = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, ids, labels)
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels, "attention_mask": real}
    ctx, kwargs, layout = hf.hf_cp_batch(batch, dist.group.WORLD)
    assert batch["labels"] is labels and "attention_mask" in batch  # the caller's batch is untouched
    local = layout.padded_seq_len // world
    start = rank * local
    grow = layout.padded_seq_len - ids.shape[1]
    shifted_full = torch.nn.functional.pad(hf.shift_labels(labels), (0, grow), value=-100)
    assert torch.equal(kwargs["shift_labels"][0], shifted_full[0, start : start + local])  # shifted before sharding
    with ctx():
        out = ours(**kwargs)
        out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    for p in ours.parameters():
        dist.all_reduce(p.grad)
    _close(loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)
    n_real = max(0, min(sum(LENS), start + local) - start)
    if n_real:
        _close(out.logits[0, :n_real], ref_logits[0, start : start + n_real], "logits")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_cp_ranks_equal_per_document(gloo, world):
    assert all(gloo(_cp_worker, world, timeout=180))


def _fsdp_worker(rank, world, dp=1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ours, ref = _models()
    ids, pos, _, labels = _row(tail=0)  # every data-parallel replica trains the same row: its mean is the reference
    _, _, ref_grads = _per_document(ref, ids, labels)
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp_shard", "cp"))
    for layer in ours.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard", "cp"]._flatten("dp_shard_cp"))
    fully_shard(ours, mesh=mesh["dp_shard", "cp"]._flatten("dp_shard_cp"))
    results = {}
    for factor in (None, float(dp)) if dp == 1 else (None, float(dp), 1.0):
        if factor is not None:
            assert hf.set_fsdp_gradient_divide_factor(ours, factor) == len(ours.model.layers) + 1
        ours.zero_grad(set_to_none=True)
        ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, mesh["cp"])
        with ctx():
            ours(**kwargs).loss.backward()
        ratios = []
        for name, p in ours.named_parameters():
            full = p.grad.full_tensor()
            ratios.append(float((full * ref_grads[name]).sum() / (ref_grads[name] * ref_grads[name]).sum()))
            if factor == dp:
                _close(full, ref_grads[name], name)
        results[factor] = ratios
    return results


@pytest.mark.parametrize("world, dp", [(2, 1), (4, 2)], ids=["cp2", "dp2xcp2"])
def test_fsdp2_with_cp_needs_the_divide_factor(gloo, world, dp):
    """FSDP2 over a dp_shard x cp mesh: by default every gradient comes out divided by the CP size (0.5x at cp = 2);
    set_fsdp_gradient_divide_factor(model, D), D the data-parallel degree, makes it the single-process gradient
    (the replicas' average); 1.0 with D > 1 sums the replicas (D x)."""
    results = gloo(_fsdp_worker, world, dp, timeout=300)
    cp = world // dp
    for per_rank in results:
        assert all(abs(r - 1 / cp) < RTOL for r in per_rank[None])
        assert all(abs(r - 1.0) < RTOL for r in per_rank[float(dp)])
        if dp > 1:
            assert all(abs(r - dp) < RTOL for r in per_rank[1.0])


def test_clear_errors():
    ours, _ = _models()
    ids, pos, _, _ = _row()
    layer = ours.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="generate with"):
        hf.blockdiag_attention_forward(layer, q, q[:, :2, :3], q[:, :2, :3], None)
    layer.is_causal = False
    with pytest.raises(ValueError, match="not causal"):
        hf.blockdiag_attention_forward(layer, q, q[:, :2], q[:, :2], None)
    with pytest.raises(ValueError, match="cu_seq_lens must rise"):
        hf.packed_doc_ids(1, 5, cu_seq_lens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="2-D padding mask"):
        hf.packed_doc_ids(1, 5, attention_mask=torch.ones(1, 1, 5, 5))
    with pytest.raises(ValueError, match="needs 'input_ids' or 'inputs_embeds'"):
        hf.hf_cp_batch({"labels": ids}, None)
    with pytest.raises(ValueError, match=r"one packed row: input_ids \[1, S\]"):  # was an IndexError
        hf.hf_cp_batch({"input_ids": ids[0]}, None)
    with pytest.raises(ValueError, match="no FSDP2 module"):
        hf.set_fsdp_gradient_divide_factor(ours)
    for factor in (0, -2.0, float("nan"), float("inf"), True, "2"):  # would scale every gradient wrongly
        with pytest.raises(ValueError, match="factor must be a finite number > 0"):
            hf.set_fsdp_gradient_divide_factor(ours, factor)


def test_from_config_and_doc_ids():
    hf.register()
    model = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation=hf.ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6]])
    assert hf.packed_doc_ids(1, 7, position_ids=pos).tolist() == [[1, 1, 1, 2, 2, 3, 3]]  # a jump starts a document
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    assert hf.packed_doc_ids(1, 7, position_ids=pos, attention_mask=mask).tolist() == [[1, 1, 1, 2, 2, 0, 0]]
    assert hf.packed_doc_ids(2, 3).tolist() == [[1, 1, 1], [2, 2, 2]]


def test_offsets_and_restarting_positions_must_agree():
    """cu_seq_lens_q and position_ids that restart elsewhere are refused at cp = 1 as the CP batch builder refuses
    them (the offsets used to win silently); position ids that never restart (the model's own arange) and a
    difference only inside the padding are no disagreement."""
    cu = torch.tensor([0, 3, 7, 10])
    agree = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])
    expected = [[1, 1, 1, 2, 2, 2, 2, 3, 3, 3]]
    assert hf.packed_doc_ids(1, 10, cu_seq_lens=cu, position_ids=agree).tolist() == expected
    assert hf.packed_doc_ids(1, 10, cu_seq_lens=cu, position_ids=torch.arange(10)[None]).tolist() == expected
    tail = torch.tensor([[1] * 7 + [0] * 3])
    in_tail = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 0, 0]])
    assert hf.packed_doc_ids(1, 10, cu_seq_lens=cu, position_ids=in_tail, attention_mask=tail).tolist() == [
        [1, 1, 1, 2, 2, 2, 2, 0, 0, 0]
    ]
    other = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match="at position 3 .* cu_seq_lens_q starts a new document, position_ids do not"):
        hf.packed_doc_ids(1, 10, cu_seq_lens=cu, position_ids=other)
    ours, _ = _models()
    ids, pos, _, _ = _row(tail=0)
    cu = torch.tensor([0, *LENS]).cumsum(0).to(torch.int32)
    bad = torch.arange(ids.shape[1])[None] % 4  # restarts every 4 tokens, not where the documents start
    with pytest.raises(ValueError, match="document boundaries disagree"):
        ours(input_ids=ids, position_ids=bad, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENS),
             max_length_k=max(LENS))  # fmt: skip
