"""The dense block-diagonal mask and the dense SDPA fallback."""

from __future__ import annotations

import pytest
import torch

from longtrain.blockdiag_cp import kernels
from tests.blockdiag._kernels_util import brute_mask, ids_from_lengths


def test_worked_example_two_documents_and_padding():
    ids = torch.tensor([1, 1, 1, 2, 2, 2, 0, 0])
    mask = kernels._cp_blockdiag_mask(ids, 0, 8, 8, 1)
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.bool
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[3:6, 3:6] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[6, 6] = expected[7, 7] = True
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize(
    "row_offset,local_len,full_len,match",
    [(11, 6, 12, "query rows"), (-2, 6, 12, "query rows"), (0, 6, 14, "full_len"), (0, -1, 12, "query rows")],
    ids=["chunk-past-end", "negative-offset", "too-many-keys", "negative-length"],
)
def test_mask_refuses_rows_or_keys_outside_the_ids(row_offset, local_len, full_len, match):
    ids = torch.tensor([1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3])
    with pytest.raises(ValueError, match=match):
        kernels._cp_blockdiag_mask(ids, row_offset, local_len, full_len, 1)
    with pytest.raises(ValueError, match="doc_ids must be"):
        kernels._cp_blockdiag_mask(ids[None, None], 0, 6, 12, 1)


@pytest.mark.parametrize(
    "lengths,pad",
    [([5, 1, 1, 9], 8), ([24], 0), ([1] * 12, 12), ([3, 17], 4), ([7, 8, 9], 0)],
    ids=["mixed", "one_doc", "one_token_docs", "straddle", "no_pad"],
)
def test_mask_matches_brute_force(lengths, pad):
    ids = ids_from_lengths(lengths, pad)
    s = ids.numel()
    assert torch.equal(kernels._cp_blockdiag_mask(ids, 0, s, s, 1)[0, 0], brute_mask(ids, 0, s))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_per_rank_masks_concatenate_to_full_mask(world):
    ids = ids_from_lengths([5, 1, 13, 2, 9, 1, 7], 10)  # 48 tokens
    s = ids.numel()
    assert s % world == 0
    local = s // world
    full = kernels._cp_blockdiag_mask(ids, 0, s, s, 2)
    parts = [kernels._cp_blockdiag_mask(ids, r * local, local, s, 2) for r in range(world)]
    assert torch.equal(torch.cat(parts, dim=2), full)
    assert full.shape == (2, 1, s, s)


def test_batched_doc_ids_and_device():
    ids = torch.stack([ids_from_lengths([3, 5], 0), ids_from_lengths([8], 0)])
    mask = kernels._cp_blockdiag_mask(ids, 4, 4, 8, 2)
    assert mask.shape == (2, 1, 4, 8) and mask.device == ids.device
    assert torch.equal(mask[0, 0], brute_mask(ids[0], 4, 4))
    assert torch.equal(mask[1, 0], brute_mask(ids[1], 4, 4))


def _qkv(hq, hkv, s, local, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, hq, local, d, generator=gen, dtype=dtype)
    k = torch.randn(1, hkv, s, d, generator=gen, dtype=dtype)
    v = torch.randn(1, hkv, s, d, generator=gen, dtype=dtype)
    return q, k, v


def test_dense_fallback_infers_gqa_without_enable_gqa():
    ids = ids_from_lengths([6, 3, 5], 2)
    q, k, v = _qkv(8, 2, 16, 8)
    out = kernels.dense_blockdiag_sdpa(q, k, v, ids, 8, enable_gqa=False)
    rep_k, rep_v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    mask = kernels._cp_blockdiag_mask(ids, 8, 8, 16, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, rep_k, rep_v, attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)  # same math, float64: bit-level agreement


def test_dense_fallback_rejects_indivisible_heads():
    ids = ids_from_lengths([8], 0)
    q, k, v = _qkv(6, 4, 8, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        kernels.dense_blockdiag_sdpa(q, k, v, ids, 0)


def test_dense_fallback_padding_row_attends_only_to_itself():
    ids = ids_from_lengths([3], 5)
    q, k, v = _qkv(2, 2, 8, 8)
    out = kernels.dense_blockdiag_sdpa(q, k, v, ids, 0)
    torch.testing.assert_close(out[:, :, 3:], v[:, :, 3:], rtol=0, atol=1e-12)  # softmax over one key is 1
