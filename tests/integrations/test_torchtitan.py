"""``apply_blockdiag`` on a tiny torchtitan Llama 3 (float64, CPU): logits, loss and every parameter gradient equal
the same model run on every document alone with torchtitan's own causal ``ScaledDotProductAttention``, at cp = 1
(with torchtitan's ``get_attention_masks`` and with ``varlen_masks``) and on 2 and 3 gloo ranks (``titan_cp_batch``,
contiguous and balanced); the clear errors. Tolerance: float64 throughout, 1e-9 relative (summation order only)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan.models.llama3")
from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenAttention  # noqa: E402

from longtrain.integrations import torchtitan as tt  # noqa: E402

LENS = [9, 14, 1, 6]
VOCAB = 128
RTOL = 1e-9


def _llama():
    from torchtitan.models.llama3 import ComplexRoPE, Embedding, Linear, Llama3Model, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _build_llama3_layers as layers

    dim, heads = 32, 4
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=layers(n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=compute_ffn_hidden_dim(dim),
                      rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=256, theta=10000.0),
                      attn_backend="varlen"),
    )  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # built in float64: the RoPE table stays complex (complex128)
    try:
        model = cfg.build()
        model.init_states()
    finally:
        torch.set_default_dtype(default)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return model


def _models():
    ours = _llama()
    ref = copy.deepcopy(ours)
    for name, module in list(ref.named_modules()):
        if isinstance(module, VarlenAttention):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, ScaledDotProductAttention(ScaledDotProductAttention.Config()))
    assert tt.apply_blockdiag(ours) == 2
    return ours, ref


def _row():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, sum(LENS)), generator=gen)
    labels = torch.randint(0, VOCAB, (1, sum(LENS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENS])[None]
    return tokens, labels, positions


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _per_document(ref, tokens, labels):
    ref.zero_grad(set_to_none=True)
    logits, start = [], 0
    for n in LENS:
        logits.append(ref(tokens[:, start : start + n], positions=torch.arange(n)[None]))
        start += n
    logits = torch.cat(logits, 1)
    loss = _loss(logits, labels)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


def _check_grads(model, ref_grads):
    for name, p in model.named_parameters():
        _close(p.grad, ref_grads[name], f"grad {name}")


@pytest.mark.parametrize("masks", ["torchtitan", "varlen_masks"])
def test_one_process_equals_per_document(masks):
    ours, ref = _models()
    tokens, labels, positions = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, tokens, labels)
    attention_masks = ours.get_attention_masks(positions) if masks == "torchtitan" else tt.varlen_masks(positions)
    logits = ours(tokens, positions=positions, attention_masks=attention_masks)
    loss = _loss(logits, labels)
    loss.backward()
    _close(logits, ref_logits, "logits")
    _close(loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)
    crossed = ref(tokens, positions=positions)  # one causal row over all documents: really different
    assert (crossed - ref_logits).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_forward_only_then_training(mode):
    """An evaluation forward under ``torch.inference_mode`` / ``torch.no_grad`` (masks built inside it) equals the
    per-document logits, and a training step afterwards the per-document gradients."""
    ours, ref = _models()
    tokens, labels, positions = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, tokens, labels)
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        evaluated = ours(tokens, positions=positions, attention_masks=ours.get_attention_masks(positions))
    _close(evaluated, ref_logits, "evaluation logits")
    logits = ours(tokens, positions=positions, attention_masks=ours.get_attention_masks(positions))
    loss = _loss(logits, labels)
    loss.backward()
    _close(logits, ref_logits, "logits")
    _close(loss, ref_loss, "loss")
    _check_grads(ours, ref_grads)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_autocast_bf16_meets_the_flash_attention_rule():
    """A float32 model under ``torch.autocast("cpu", dtype=torch.bfloat16)``: logits and every gradient (backward
    outside autocast) against the float64 per-document model are at most 2x the error of torchtitan's own SDPA
    attention run per document under the same autocast, plus one bf16 rounding step (2**-8). And ``BlockdiagAttention``
    given q and k in float32 and v in bf16 under autocast (as a RoPE computed in float32 would leave them) casts them
    to bf16 as SDPA does: the same output bit for bit as bf16 inputs."""
    attention = tt.BlockdiagAttention()
    masks = tt.varlen_masks(_row()[2])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, sum(LENS), h, 8, generator=gen) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = attention(q, k, v.bfloat16(), attention_masks=masks)
    assert torch.equal(mixed, attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attention_masks=masks))
    ours, ref = _models()
    tokens, labels, positions = _row()
    want_logits, _, want_grads = _per_document(copy.deepcopy(ref), tokens, labels)
    ours.float(), ref.float()
    ours.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ours(tokens, positions=positions, attention_masks=ours.get_attention_masks(positions))
        assert logits.dtype == torch.bfloat16
    _loss(logits.float(), labels).backward()
    got = [_rel(logits, want_logits)] + [_rel(p.grad, want_grads[n]) for n, p in ours.named_parameters()]
    ref.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts, start = [], 0
        for n in LENS:
            parts.append(ref(tokens[:, start : start + n], positions=torch.arange(n)[None]))
            start += n
        ref_logits = torch.cat(parts, 1)
    _loss(ref_logits.float(), labels).backward()
    bound = [_rel(ref_logits, want_logits)] + [_rel(p.grad, want_grads[n]) for n, p in ref.named_parameters()]
    for g, b in zip(got, bound):
        assert g <= 2 * b + 2**-8, (g, b)


def _cp_worker(rank, world, sharding):
    ours, ref = _models()
    tokens, labels, positions = _row()
    ref_logits, ref_loss, ref_grads = _per_document(ref, tokens, labels)
    ctx, kwargs, local_labels, layout = tt.titan_cp_batch(tokens, labels, positions, dist.group.WORLD,
                                                          sharding=sharding, shard_chunk=2)  # fmt: skip
    assert layout.step.contiguous == (sharding == "contiguous")
    assert kwargs["tokens"].shape[1] == layout.padded_seq_len // world
    with ctx():
        logits = ours(**kwargs)
        loss = _loss(logits, local_labels)  # the padding tail's labels are -100 (cross_entropy's ignore_index)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    for p in ours.parameters():
        dist.all_reduce(p.grad)
    _close(total, ref_loss, "loss")
    _check_grads(ours, ref_grads)
    full = layout.unshard(logits.detach())
    _close(full[:, : sum(LENS)], ref_logits, "logits")
    return True


@pytest.mark.parametrize("world,sharding", [(2, "contiguous"), (3, "contiguous"), (2, "balanced"), (3, "balanced")])
def test_cp_ranks_equal_per_document(gloo, world, sharding):
    assert all(gloo(_cp_worker, world, sharding, timeout=180))


def test_clear_errors():
    ours, _ = _models()
    tokens, _, positions = _row()
    with pytest.raises(ValueError, match="needs the documents"):
        ours(tokens, positions=positions, attention_masks=None)
    attn = tt.BlockdiagAttention()
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="out_transform"):
        attn(q, q, q, attention_masks=tt.varlen_masks(torch.arange(4)[None]), out_transform=lambda o, lse: o)
    with pytest.raises(ValueError, match="is_causal=False"):
        attn(q, q, q, attention_masks=tt.varlen_masks(torch.arange(4)[None]), is_causal=False)
    # FlexAttention's score_mod would be dropped silently (the scores computed without it): refused
    with pytest.raises(ValueError, match="score_mod"):
        attn(q, q, q, attention_masks=tt.varlen_masks(torch.arange(4)[None]), score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="found no torchtitan inner attention"):
        tt.apply_blockdiag(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        tt.varlen_masks(torch.arange(4))
    with pytest.raises(TypeError, match="integer"):
        tt.varlen_masks(torch.ones(1, 4, dtype=torch.bool))
    # masks of fewer tokens than q holds would leave rows with zero output: refused (one row's masks, two rows)
    q2 = torch.randn(2, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"cover 4 query and 4 key tokens but q holds B \* L = 2 \* 4 = 8"):
        attn(q2, q2, q2, attention_masks=tt.varlen_masks(torch.arange(4)[None]))
    with pytest.raises(ValueError, match="cover 3 query"):
        attn(q, q, q, attention_masks=tt.varlen_masks(torch.arange(3)[None]))
    with pytest.raises(ValueError, match="q, k and v must share"):
        attn(q, q2[:1, :3], q2[:1, :3], attention_masks=tt.varlen_masks(torch.arange(4)[None]))


def test_varlen_masks_and_skip():
    m = tt.varlen_masks(torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]]))
    assert m.cu_seq_q.tolist() == [0, 3, 5, 7, 10] and m.max_q == 3
    model = _llama()
    assert tt.apply_blockdiag(model, skip=lambda name: name.startswith("layers.1.")) == 1
    assert isinstance(model.get_submodule("layers.1.attention.inner_attention"), VarlenAttention)


def _fsdp_worker(rank, world):
    """FSDP2 over a dp_shard x cp mesh flattened (torchtitan's dp_shard_cp), CP through titan_cp_batch: with the
    divide factor at 1.0 every gradient equals the single-process one; by default FSDP averages over the CP ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ours, ref = _models()
    tokens, labels, positions = _row()
    _, _, ref_grads = _per_document(ref, tokens, labels)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    for layer in ours.layers.values():
        fully_shard(layer, mesh=flat)
    fully_shard(ours, mesh=flat)
    ratios = {}
    for factor in (None, 1.0):
        if factor is not None:
            assert tt.set_fsdp_gradient_divide_factor(ours, factor) == len(ours.layers) + 1
        ours.zero_grad(set_to_none=True)
        ctx, kwargs, local_labels, _ = tt.titan_cp_batch(tokens, labels, positions, mesh["cp"])
        with ctx():
            _loss(ours(**kwargs), local_labels).backward()
        ratios[factor] = []
        for name, p in ours.named_parameters():
            full = p.grad.full_tensor()
            ratios[factor].append(float((full * ref_grads[name]).sum() / (ref_grads[name] ** 2).sum()))
            if factor is not None:
                _close(full, ref_grads[name], f"grad {name}")
    return ratios


def test_fsdp2_with_cp(gloo):
    for ratios in gloo(_fsdp_worker, 2, timeout=240):
        assert all(abs(r - 0.5) < 1e-6 for r in ratios[None])  # FSDP's default: averaged over the 2 CP ranks
        assert all(abs(r - 1.0) < 1e-6 for r in ratios[1.0])


def test_what_would_compute_something_else_is_refused():
    model = _llama()
    model.get_submodule("layers.0.attention.inner_attention").window_size = (127, 0)  # gpt-oss's sliding layers
    with pytest.raises(ValueError, match=r"sliding-window VarlenAttention \(window_size=\(127, 0\)\)"):
        tt.apply_blockdiag(model)
    assert isinstance(model.get_submodule("layers.1.attention.inner_attention"), VarlenAttention)  # nothing replaced
    assert tt.apply_blockdiag(model, skip=lambda name: name.startswith("layers.0.")) == 1

    from torchtitan.models.common.attention import FlexAttention

    class OwnMasks(torch.nn.Module):  # a model with its own flex masks (gpt-oss builds sliding windows this way)
        def __init__(self):
            super().__init__()
            self.inner_attention = FlexAttention(FlexAttention.Config())

        def get_attention_masks(self, positions):
            return None

    with pytest.raises(ValueError, match="builds its own masks"):
        tt.apply_blockdiag(OwnMasks())


def test_recompute_after_the_step_is_refused():
    """Activation-checkpoint recompute after titan_cp_batch's context exited would run without the step: refused."""
    from torch.utils.checkpoint import checkpoint

    ours, _ = _models()
    tokens, labels, positions = _row()
    ctx, kwargs, local_labels, _ = tt.titan_cp_batch(tokens, labels, positions, None)
    with ctx():
        logits = checkpoint(lambda t: ours(t, positions=kwargs["positions"]), kwargs["tokens"], use_reentrant=False)
    with pytest.raises(RuntimeError, match="BlockdiagAttention ran during backward"):
        _loss(logits, local_labels).backward()


@pytest.mark.parametrize("with_ac", [False, True], ids=["plain", "checkpointed"])
def test_apply_compile_fullgraph_equals_eager(with_ac, monkeypatch):
    """torchtitan's own ``apply_compile`` (each block ``compile(fullgraph=True)``; ``aot_eager``, inductor's codegen
    would only cost time here): logits, loss and every parameter gradient equal the eager model over two packed
    layouts of the same row length (different offsets and longest document), checkpointed blocks included; masks
    that do not cover the row are the eager ``ValueError``, raised inside the compiled block."""
    from torch.utils.checkpoint import checkpoint
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    from longtrain.blockdiag_cp import compiled as compiled_ops

    checked = []  # the host check runs inside the compiled op: proof that the op, not eager code, ran
    check = compiled_ops.HOST_CHECKS[tt._HOST_CHECK]
    monkeypatch.setitem(compiled_ops.HOST_CHECKS, tt._HOST_CHECK, lambda *a: (checked.append(a[2]), check(*a)))
    torch._dynamo.reset()
    eager, _ = _models()
    compiled = copy.deepcopy(eager)
    config = torch._dynamo.config  # apply_compile sets two global knobs: restored when the test ends
    knobs = ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint")
    with config.patch({name: getattr(config, name) for name in knobs}):
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="aot_eager"), parallel_dims=dims)
        tokens, labels, _ = _row()
        for lens in (LENS, [3, 20, 7]):
            positions = torch.cat([torch.arange(n) for n in lens])[None]
            runs = []
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                masks = model.get_attention_masks(positions)
                forward = functools.partial(model, positions=positions, attention_masks=masks)
                logits = checkpoint(forward, tokens, use_reentrant=False) if with_ac else forward(tokens)
                loss = _loss(logits, labels)
                loss.backward()
                runs.append((logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
            assert checked == [[1, 30]] * (4 if with_ac else 2)  # each block's forward (and its recompute)
            checked.clear()
            (logits, loss, grads), (want_logits, want_loss, want_grads) = runs[1], runs[0]
            _close(logits, want_logits, "logits")
            _close(loss, want_loss, "loss")
            for name, grad in grads.items():
                _close(grad, want_grads[name], f"grad {name}")
        short = compiled.get_attention_masks(torch.arange(29)[None])  # 29 tokens' masks for a 30-token row
        with pytest.raises(ValueError, match="cover 29 query and 29 key tokens but q holds B \\* L = 1 \\* 30"):
            compiled(tokens, positions=positions, attention_masks=short)
