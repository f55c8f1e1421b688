"""``attn_implementation="longtrain_blockdiag"`` beyond Llama: tiny Qwen2, Qwen3, Mistral and GLM-4 models (float64,
CPU) equal Hugging Face's eager model run on every document alone (logits and every parameter gradient); what
the implementation cannot compute is refused, never dropped: sliding windows shorter than a document (Mistral,
Qwen2 with ``use_sliding_window``), Llama 4's chunked attention, Gemma 2's logit soft-capping, attention sinks
(gpt-oss), DSA indices."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longtrain.integrations import hf  # noqa: E402

LENS = [7, 12, 5]
RTOL = 1e-6
COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
)  # fmt: skip

FAMILIES = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=None)),
    "mistral_window_covers_documents": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=12)
    ),
    "glm4": lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**COMMON, pad_token_id=0)),
}


def _pair(build):
    hf.register()
    torch.manual_seed(0)
    ref = build().to(torch.float64)
    ref.set_attn_implementation("eager")
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    return ours, ref


def _row(lens=LENS):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


def _close(a, b, what):
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.3e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_equals_per_document(family):
    ours, ref = _pair(FAMILIES[family])
    ids, pos = _row()
    weight = torch.randn(1, sum(LENS), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_logits = torch.cat([ref(input_ids=ids[:, a : a + n]).logits for a, n in zip([0, 7, 19], LENS)], 1)
    (ref_logits * weight).sum().backward()
    logits = ours(input_ids=ids, position_ids=pos).logits
    (logits * weight).sum().backward()
    _close(logits, ref_logits, "logits")
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, f"grad {name}")


def test_sliding_window_shorter_than_a_document_is_refused():
    ours, ref = _pair(lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=8)))
    ids, pos = _row()
    with pytest.raises(ValueError, match=r"sliding_window=8\) and a document here has 12 tokens"):
        ours(input_ids=ids, position_ids=pos)
    short, short_pos = _row([7, 8, 5])  # every document within the window: the windowed result is the full one
    alone = torch.cat([ref(input_ids=short[:, a : a + n]).logits for a, n in zip([0, 7, 15], [7, 8, 5])], 1)
    _close(ours(input_ids=short, position_ids=short_pos).logits, alone, "logits")


def test_qwen2_sliding_window_layers_are_checked():
    config = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ours, _ = _pair(lambda: transformers.Qwen2ForCausalLM(config))
    ids, pos = _row()
    with pytest.raises(ValueError, match="sliding_window=4"):
        ours(input_ids=ids, position_ids=pos)


_MASK_ONLY_WINDOWS = {
    "qwen2_moe": lambda window: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **COMMON,
            use_sliding_window=True,
            sliding_window=window,
            max_window_layers=2,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )  # fmt: skip
    ),
    "phimoe": lambda window: transformers.PhimoeForCausalLM(
        transformers.PhimoeConfig(**COMMON, sliding_window=window, num_local_experts=2, num_experts_per_tok=2)
    ),
}


def _moe_pair(build):
    pair = _pair(build)
    for model in pair:  # float64 experts: the eager loop (grouped matmuls take no float64)
        model.set_experts_implementation("eager")
    return pair


@pytest.mark.parametrize("family", sorted(_MASK_ONLY_WINDOWS))
def test_sliding_window_built_only_into_the_mask_is_refused(family):
    """Qwen2-MoE and PhiMoE put their window into the mask and pass no ``sliding_window=`` to the attention
    function: the window is read from the module or its config, refused when a document is longer, and a window
    covering every document gives the per-document result."""
    ours, _ = _moe_pair(lambda: _MASK_ONLY_WINDOWS[family](4))
    ids, pos = _row()
    with pytest.raises(ValueError, match=r"sliding_window=4\) and a document here has 12 tokens"):
        ours(input_ids=ids, position_ids=pos)
    ours, ref = _moe_pair(lambda: _MASK_ONLY_WINDOWS[family](64))
    alone = torch.cat([ref(input_ids=ids[:, a : a + n]).logits for a, n in zip([0, 7, 19], LENS)], 1)
    _close(ours(input_ids=ids, position_ids=pos).logits, alone, "logits")


def test_gemma2_softcap_is_refused():
    config = transformers.Gemma2Config(**COMMON, attn_logit_softcapping=50.0, sliding_window=64)
    ours, _ = _pair(lambda: transformers.Gemma2ForCausalLM(config))
    ids, pos = _row()
    with pytest.raises(ValueError, match=r"Gemma2Attention passes softcap= \(attention-logit soft-capping\)"):
        ours(input_ids=ids, position_ids=pos)


@pytest.mark.parametrize("key", sorted(hf.UNSUPPORTED_KWARGS))
def test_every_unsupported_keyword_is_refused(key):
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=f"passes {key}="):
        hf.blockdiag_attention_forward(module, q, k, k, None, position_ids=torch.arange(6)[None], **{key: object()})
    out, _ = hf.blockdiag_attention_forward(module, q, k, k, None, position_ids=torch.arange(6)[None], **{key: None})
    assert out.shape == (1, 6, 4, 8)


def test_sliding_window_inside_a_cp_step():
    """Inside a CP step (here one rank) the step's documents decide: the longest real document, padding excluded."""
    for window, refused in ((8, True), (12, False)):
        config = transformers.MistralConfig(**COMMON, sliding_window=window)
        ours, ref = _pair(lambda config=config: transformers.MistralForCausalLM(config))
        ids, pos = _row()
        labels = ids.clone()
        ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, None)
        with ctx():
            if refused:
                with pytest.raises(ValueError, match="a document here has 12 tokens"):
                    ours(**kwargs)
                continue
            logits = ours(**kwargs).logits
        alone = torch.cat([ref(input_ids=ids[:, a : a + n]).logits for a, n in zip([0, 7, 19], LENS)], 1)
        _close(logits, alone, "logits")


def test_llama4_chunked_attention_is_refused():
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, attention_chunk_size=8,
        use_cache=False, max_position_embeddings=128,
    )  # fmt: skip
    ours, _ = _pair(lambda: transformers.Llama4ForCausalLM(config))
    ids, pos = _row()
    with pytest.raises(ValueError, match=r"cannot compute chunked attention \(attention_chunk_size=8, 24 keys\)"):
        ours(input_ids=ids, position_ids=pos)


def _checkpointed_llama():
    ours, ref = _pair(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)))
    getattr(ours, "activation_checkpointing_enable", ours.gradient_checkpointing_enable)()
    ours.train()
    return ours, ref


def test_gradient_checkpointing_inside_a_cp_step_is_exact_and_outside_is_refused():
    """HF's activation checkpointing recomputes the attention during backward: inside the step's context it is
    exact; a backward after the context exited would recompute without the step (silently wrong at W > 1), so
    it raises (also for apply_dsa and torchtitan's BlockdiagAttention, which share the check)."""
    ours, ref = _checkpointed_llama()
    ids, pos = _row()
    labels = ids.clone()
    ref_logits = torch.cat([ref(input_ids=ids[:, a : a + n]).logits for a, n in zip([0, 7, 19], LENS)], 1)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0], hf.shift_labels(labels)[0])
    ref_loss.backward()
    ctx, kwargs, _ = hf.hf_cp_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, None)
    with ctx():
        out = ours(**kwargs)
        out.loss.backward()
    _close(out.loss.detach(), ref_loss.detach(), "loss")
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, f"grad {name}")
    with ctx():
        out = ours(**kwargs)
    with pytest.raises(RuntimeError, match="inside `with ctx_factory"):
        out.loss.backward()
    out = ours(input_ids=ids, position_ids=pos, labels=labels)  # used without CP again: the guard clears itself
    out.loss.backward()
