"""The demo presets' models, built on the meta device (no memory): the h200-32k preset has GLM-5.2's attention shape
at 0.74B parameters, and the tiny preset is today's model."""

from __future__ import annotations

import torch

from longtrain.demo.config import build_model_config, make_config
from longtrain.demo.presets import PRESETS
from longtrain.models import TinyLM, TinyLMConfig


def _meta_model(preset: str) -> TinyLM:
    cfg = build_model_config(make_config({"preset": preset, "device": "cpu"}), torch.device("cpu"))
    with torch.device("meta"):
        return TinyLM(cfg)


def test_h200_32k_model_shape_and_size():
    model = _meta_model("h200-32k")
    params = sum(p.numel() for p in model.parameters())
    assert params == 739_241_728 and "0.74B" in PRESETS["h200-32k"].summary
    assert model.config.layers == "GDSGGDSGGDSG"
    assert [b.kind for b in model.blocks] == list("GDSGGDSGGDSG")
    assert model.embed.num_embeddings >= 257 and model.embed.num_embeddings % 64 == 0
    for block in model.blocks:
        if block.kind == "G":
            assert block.self_attn.blockdiag_attention_shape() == dict(
                num_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.float32
            )
            continue
        # GLM-5.2's kernel shape: 64 heads of D_qk = 512 latent + 64 rope, D_v = 512, top-2048, indexer 32 x 128
        assert block.dsa.dsa_autotune_shape() == dict(
            num_heads=64, d_qk=576, d_v=512, topk=2048, index_heads=32, index_dim=128, dtype=torch.float32
        )
        assert block.dsa.indexer_type == ("full" if block.kind == "D" else "shared")
        assert hasattr(block.dsa, "wq_b") == (block.kind == "D")  # IndexShare layers have no indexer
    assert model.config.dsa_config().backend == "auto"
    assert model.config.init_std == 0.02


def test_tiny_preset_is_todays_model():
    model = _meta_model("tiny")
    assert model.config == TinyLMConfig(layers="GDSG", dsa={"backend": "auto"})
    assert sum(p.numel() for p in model.parameters()) == 195_584
