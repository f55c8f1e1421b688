"""The FLOP counter of the demo model (benchmarks/README.md, "Whole-model FLOPs"), counted by hand on a tiny model."""

from __future__ import annotations

import pytest
import torch

from longtrain.models import TinyLM, TinyLMConfig
from longtrain.models.flops import PEAK_BF16_TFLOPS, FlopCounter, doc_lengths_of, mfu, peak_tflops

# Every width distinct where it can be, so a swapped dimension changes the count.
TINY = TinyLMConfig(
    vocab_size=10, hidden_size=8, layers="GDSG", num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
    dsa_heads=2, dsa_q_lora_rank=4, dsa_kv_lora_rank=6, dsa_rope_head_dim=2, dsa_nope_head_dim=2, dsa_v_head_dim=3,
    index_heads=2, index_head_dim=4, index_topk=3,
)  # fmt: skip


def _hand_counts() -> tuple[int, int]:
    gqa = 8 * (2 * 4) + 8 * 4 + 8 * 4 + (2 * 4) * 8  # q, k, v, o
    mlp = 3 * 8 * 16  # gate, up, down
    mla = 8 * 4 + 4 * (2 * (2 + 2)) + 8 * (6 + 2) + 6 * (2 * (2 + 3)) + (2 * 3) * 8  # q_a, q_b, kv_a, kv_b, o
    indexer = 4 * (2 * 4) + 8 * 4 + 8 * 2  # wq_b, wk, weights_proj
    head = 8 * 10
    return 2 * gqa + 4 * mlp + 2 * mla + head, indexer


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_counter_reads_the_model(device):
    with torch.device(device):
        model = TinyLM(TINY)
    counter = FlopCounter.for_model(model)
    trained, indexer = _hand_counts()
    assert (counter.trained_matmul_params, counter.forward_only_matmul_params) == (trained, indexer)
    assert (counter.gqa_layers, counter.gqa_heads, counter.gqa_head_dim) == (2, 2, 4)
    assert (counter.mla_layers, counter.mla_heads, counter.mla_d_qk, counter.mla_d_v, counter.topk) == (2, 2, 8, 6, 3)
    assert (counter.indexer_layers, counter.indexer_heads, counter.indexer_dim) == (1, 2, 4)


def test_step_flops_by_hand():
    with torch.device("meta"):
        counter = FlopCounter.for_model(TinyLM(TINY))
    flops = counter.step([3, 5])  # 8 tokens; MaskArea 6 + 15 = 21
    trained, indexer = _hand_counts()
    assert flops.weights == 6 * trained * 8 + 2 * indexer * 8
    assert flops.attention == 2 * (4 * 21 * 2 * 4) * 7 // 2  # 2 G layers, forward + 2.5x backward
    slots = (1 + 2 + 3) + (1 + 2 + 3 + 3 + 3)  # min(p + 1, K = 3) per token
    assert flops.sparse_mla == 2 * (2 * 2 * slots * ((8 + 6) + (3 * 8 + 2 * 6)))  # D + S layers, fwd + bwd
    assert flops.indexer == 1 * 2 * 2 * 4 * 21  # the D layer only, forward only
    assert flops.total == flops.weights + flops.attention + flops.sparse_mla + flops.indexer == 132176


@pytest.mark.parametrize(
    "lengths, area, slots",
    [([], 0, 0), ([1], 1, 1), ([1, 1, 1], 3, 3), ([3], 6, 6), ([4], 10, 9), ([7, 2], 28 + 3, (6 + 4 * 3) + 3)],
    ids=["empty", "one-token", "three-singletons", "len-K", "len-K+1", "mixed"],
)
def test_mask_area_and_valid_slots(lengths, area, slots):
    counter = FlopCounter(trained_matmul_params=0, forward_only_matmul_params=0, gqa_layers=1, gqa_heads=1,
                          gqa_head_dim=1, mla_layers=1, mla_heads=1, mla_d_qk=1, mla_d_v=0, topk=3, indexer_layers=1,
                          indexer_heads=1, indexer_dim=1)  # fmt: skip
    flops = counter.step(lengths)
    assert flops.indexer == 2 * area and flops.attention == 4 * area * 7 // 2
    assert flops.sparse_mla == 2 * slots * (1 + 3)


def test_padding_is_not_counted():
    assert doc_lengths_of(torch.tensor([1, 1, 1, 2, 2, 3, 0, 0])) == [3, 2, 1]
    assert doc_lengths_of(torch.tensor([0, 0])) == []


def test_counter_refuses_other_models():
    with pytest.raises(TypeError, match="TinyLM"):
        FlopCounter.for_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=">= 0"):
        FlopCounter(trained_matmul_params=1, forward_only_matmul_params=0).step([-1])


def test_peak_and_mfu(monkeypatch):
    assert PEAK_BF16_TFLOPS["NVIDIA H200"] == 989.4
    peak, source = peak_tflops("cpu")
    assert peak is None and "cpu" in source
    assert peak_tflops("cpu", 100.0) == (100.0, "given (--peak-tflops)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(torch.device("cuda", 0)) == (989.4, "NVIDIA H200 bf16 dense")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 NVL")
    peak, source = peak_tflops(torch.device("cuda", 0))
    assert peak is None and "--peak-tflops" in source
    assert mfu(494.7, 989.4) == pytest.approx(0.5)
    assert mfu(494.7, None) is None
