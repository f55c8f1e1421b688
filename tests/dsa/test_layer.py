"""The DSA attention layer: RoPE flavours, config, absorbed MLA == dense MLA, the indexer, IndexShare, padding."""

from __future__ import annotations

import math

import pytest
import torch

from longtrain.dsa import DSAAttention, DSAConfig, derive_indexer_types, mla_softmax_scale
from longtrain.dsa.layer import rope_angles, rope_half_split, rope_interleaved


def small_config(**changes) -> DSAConfig:
    base = dict(
        hidden_size=64,
        num_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=4,
        rope_theta=10_000.0,
        backend="torch",
    )
    base.update(changes)
    return DSAConfig(**base)


# Documents of 9, 5 and 1 tokens: with K = 4 the selection matters in the first two.
CU = torch.tensor([0, 9, 14, 15], dtype=torch.int32)
POS = torch.tensor(list(range(9)) + list(range(5)) + [0])


def _layer(indexer_type="full", seed=0, **changes) -> DSAAttention:
    torch.manual_seed(seed)
    layer = DSAAttention(small_config(**changes), 0, indexer_type).double()
    with torch.no_grad():  # non-trivial norms, so their parameters matter in the comparisons
        for module in layer.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.2, 0.2)
    return layer


def test_rope_examples():
    cos = torch.tensor([[0.0, 1.0]])  # angles [pi/2, 0]
    sin = torch.tensor([[1.0, 0.0]])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert rope_half_split(x, cos, sin).tolist() == [[-3.0, 2.0, 1.0, 4.0]]  # indexer: rotate-half
    assert rope_interleaved(x, cos, sin).tolist() == [[-2.0, 1.0, 3.0, 4.0]]  # MLA: pairs (2i, 2i+1)
    heads = x[:, None].expand(1, 3, 4)
    assert rope_interleaved(heads, cos, sin).tolist() == [[[-2.0, 1.0, 3.0, 4.0]] * 3]


def test_rope_angles_use_the_config_frequencies():
    config = small_config()
    cos, sin = rope_angles(config, torch.tensor([0, 3]), torch.float64)
    inv_freq = 10_000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(cos[1], torch.cos(3 * inv_freq), rtol=0, atol=1e-15)
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    assert rope_angles(config, torch.tensor([1]), torch.bfloat16)[0].dtype == torch.float32
    yarn = small_config(
        rope_scaling=dict(factor=4.0, beta_fast=32, beta_slow=1, original_max_position_embeddings=64),
        max_position_embeddings=256,
    )
    cos_y, _ = rope_angles(yarn, torch.tensor([100]), torch.float64)
    # The highest frequency is kept, the lowest is interpolated by the factor.
    assert cos_y[0, 0] == pytest.approx(math.cos(100.0))
    assert cos_y[0, -1] == pytest.approx(math.cos(100.0 * inv_freq[-1].item() / 4))


def test_softmax_scale():
    assert mla_softmax_scale(small_config()) == pytest.approx(32**-0.5)
    assert mla_softmax_scale(small_config(softmax_scale=0.125)) == 0.125
    yarn = small_config(rope_scaling=dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0))
    m = 0.1 * math.log(40.0) + 1
    assert mla_softmax_scale(yarn) == pytest.approx(32**-0.5 * m * m)
    assert DSAAttention(yarn).softmax_scale == pytest.approx(32**-0.5 * m * m)
    assert mla_softmax_scale(small_config(rope_scaling=dict(factor=40.0))) == pytest.approx(32**-0.5)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_heads=0), "num_heads must be a positive int"),
        (dict(hidden_size=64.0), "hidden_size must be a positive int"),
        (dict(qk_rope_head_dim=15), "must be even"),
        (dict(index_head_dim=8), "index_head_dim=8 must be >= qk_rope_head_dim"),
        (dict(index_topk=4096), r"index_topk must be in \[1, 2048\]"),
        (dict(backend="tilelang"), "backend must be one of"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(softmax_scale=math.nan), "softmax_scale"),
        (dict(rope_scaling=[1]), "rope_scaling must be a dict"),
        (dict(rope_scaling=dict(factor=0)), "factor"),
        (dict(rope_scaling=dict(factor=math.nan, original_max_position_embeddings=64)), r"'factor'\] must be a finite"),
        (dict(rope_scaling=dict(factor=math.inf, mscale=1.0)), r"'factor'\] must be a finite"),
        (dict(rope_scaling=dict(factor=None)), r"'factor'\] must be a finite"),
        (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=0)), "original_max_position_embeddings"),
        (dict(rope_scaling=dict(factor=4.0, original_max_position_embeddings=64, beta_fast=0)), "beta_fast"),
        (dict(rope_scaling=dict(factor=4.0, beta_slow=-1)), "beta_slow"),
        (dict(rope_scaling=dict(factor=4.0, mscale="x")), r"'mscale'\] must be a finite number >= 0"),
        (dict(rope_scaling=dict(factor=4.0, mscale_all_dim=True)), "mscale_all_dim"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        small_config(**changes)


def test_config_is_keyword_only_and_layer_rejects_unknown_indexer_type():
    with pytest.raises(TypeError):
        DSAConfig(64)  # type: ignore[misc]
    with pytest.raises(ValueError, match="indexer_type must be one of"):
        DSAAttention(small_config(), 0, "dense")


def _dense_mla(layer: DSAAttention, x, pos, topk):
    """Ordinary (non-absorbed) MLA: per-head keys/values from kv_b_proj, softmax over the selected keys."""
    c = layer.config
    tokens = x.shape[0]
    cos, sin = rope_angles(c, pos, x.dtype)
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(tokens, c.num_heads, -1)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    q_full = torch.cat([q_nope, rope_interleaved(q_pe, cos, sin)], dim=-1)
    latent, k_pe = layer.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    kv = layer.kv_b_proj(layer.kv_a_layernorm(latent)).view(tokens, c.num_heads, -1)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_full = torch.cat([k_nope, rope_interleaved(k_pe, cos, sin)[:, None].expand(-1, c.num_heads, -1)], dim=-1)
    rows = []
    for t in range(tokens):
        keys = topk[t][topk[t] >= 0].long()
        if keys.numel() == 0:
            rows.append(torch.zeros(c.num_heads, c.v_head_dim, dtype=x.dtype))
            continue
        logits = layer.softmax_scale * torch.einsum("hd,jhd->hj", q_full[t], k_full[keys])
        rows.append(torch.einsum("hj,jhd->hd", logits.softmax(-1), v[keys]))
    return layer.o_proj(torch.stack(rows).reshape(tokens, -1))


@torch.no_grad()
def _dense_indexer_topk(layer: DSAAttention, x, pos, cu, k):
    c = layer.config
    rope = c.qk_rope_head_dim
    cos, sin = rope_angles(c, pos, x.dtype)
    q = layer.wq_b(layer.q_a_layernorm(layer.q_a_proj(x))).view(x.shape[0], c.index_n_heads, -1)
    q = torch.cat([rope_half_split(q[..., :rope], cos, sin), q[..., rope:]], dim=-1)
    keys = layer.k_norm(layer.wk(x))
    keys = torch.cat([rope_half_split(keys[..., :rope], cos, sin), keys[..., rope:]], dim=-1)
    w = layer.weights_proj(x) * c.index_n_heads**-0.5
    out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
    for d in range(cu.numel() - 1):
        for t in range(int(cu[d]), int(cu[d + 1])):
            candidates = range(int(cu[d]), t + 1)
            # relu(D_I**-0.5 * q.k) summed with the H_I**-0.5 weights: the unfolded definition.
            score = {
                s: sum(w[t, h] * torch.relu(q[t, h] @ keys[s] * c.index_head_dim**-0.5) for h in range(2))
                for s in candidates
            }
            best = sorted(candidates, key=lambda s: (-float(score[s]), s))[:k]
            out[t, : len(best)] = torch.tensor(sorted(best), dtype=torch.int32)
    return out


def test_absorbed_layer_equals_dense_mla_and_indexer_equals_definition():
    layer = _layer()
    x = torch.randn(15, 64, dtype=torch.float64, requires_grad=True)
    out, topk = layer(x, POS, CU, return_topk=True)
    assert out.shape == (15, 64) and out.dtype == torch.float64 and topk.dtype == torch.int32
    assert torch.equal(topk, _dense_indexer_topk(layer, x.detach(), POS, CU, 4))
    want = _dense_mla(layer, x, POS, topk)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)  # float64 both ways; summation order only
    grad = torch.randn_like(out)
    params = [p for n, p in layer.named_parameters() if not n.startswith(("wq_b", "wk", "k_norm", "weights_proj"))]
    got = torch.autograd.grad(out, [x, *params], grad)
    expected = torch.autograd.grad(want, [x, *params], grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_indexer_parameters_receive_no_gradient():
    layer = _layer()
    x = torch.randn(15, 64, dtype=torch.float64)
    layer(x, POS, CU).sum().backward()
    for name, param in layer.named_parameters():
        if name.startswith(("wq_b", "wk", "k_norm", "weights_proj")):
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_shared_layer_reuses_the_previous_topk():
    full, shared = _layer(seed=0), _layer("shared", seed=1)
    assert not hasattr(shared, "wq_b")
    x = torch.randn(15, 64, dtype=torch.float64)
    _, topk = full(x, POS, CU, return_topk=True)
    out, reused = shared(x, POS, CU, prev_topk=topk, return_topk=True)
    assert reused is topk
    torch.testing.assert_close(out, _dense_mla(shared, x, POS, topk), rtol=1e-12, atol=1e-12)
    other = topk.clone()
    other[8] = torch.tensor([0, 8, -1, -1], dtype=torch.int32)
    assert not torch.allclose(shared(x, POS, CU, prev_topk=other)[8], out[8])
    torch.testing.assert_close(shared(x, POS, CU, prev_topk=topk[:, None]), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="requires prev_topk"):
        shared(x, POS, CU)
    with pytest.raises(ValueError, match=r"prev_topk must be \[15, 4\]"):
        shared(x, POS, CU, prev_topk=topk[:, :3])


def test_shared_layer_attends_only_eligible_keys_of_a_given_topk():
    """A ``prev_topk`` not from a full layer (a future key, another document's key, out of range) is read as -1
    for those slots: the shared layer's output never depends on what a row may not see."""
    shared = _layer("shared", seed=1)
    x = torch.randn(15, 64, dtype=torch.float64)
    starts = [0] * 9 + [9] * 5 + [14]  # CU = [0, 9, 14, 15]
    assert CU.tolist() == [0, 9, 14, 15]
    bad = torch.full((15, 4), -1, dtype=torch.int32)
    bad[:, 0] = torch.tensor(starts, dtype=torch.int32)  # the document's first key: eligible
    bad[0, 1], bad[10, 1], bad[11, 1], bad[2, 2] = 4, 2, 13, 99  # future, other document, future, out of range
    clean = bad.clone()
    clean[0, 1], clean[10, 1], clean[11, 1], clean[2, 2] = -1, -1, -1, -1
    out = shared(x, POS, CU, prev_topk=bad)
    torch.testing.assert_close(out, shared(x, POS, CU, prev_topk=clean), rtol=0, atol=0)
    moved = x.clone()
    moved[4] += 5.0  # only row 4's own output may change (row 0 named it, as a future key)
    diff = (shared(moved, POS, CU, prev_topk=bad) - out).abs().amax(dim=1)
    assert diff[:4].max() == 0 and diff[5:].max() == 0


def test_padding_rows_give_zero_output_and_zero_gradient():
    layer = _layer()
    padded = torch.tensor([0, 12, 18, 20], dtype=torch.int32)  # documents 9, 5, 1 padded to 12, 6, 2
    pos = torch.cat([torch.arange(12), torch.arange(6), torch.arange(2)])
    x = torch.randn(20, 64, dtype=torch.float64, requires_grad=True)
    out, topk = layer(x, pos, CU, cu_seqlens_padded=padded, return_topk=True)
    pad_rows = [9, 10, 11, 17, 19]
    assert (out[pad_rows] == 0).all() and (topk[pad_rows] == -1).all()
    out.sum().backward()
    assert (x.grad[pad_rows] == 0).all() and torch.isfinite(x.grad).all()
    # Padding storage never changes the real rows.
    real = [i for i in range(20) if i not in pad_rows]
    compact = layer(x.detach()[real], POS, CU)
    torch.testing.assert_close(out.detach()[real], compact, rtol=1e-12, atol=1e-12)


def test_prepared_metadata_is_reused_and_checked():
    layer = _layer()
    x = torch.randn(15, 64, dtype=torch.float64)
    meta = DSAAttention.prepare_metadata(CU, 15)
    torch.testing.assert_close(layer(x, POS, CU, metadata=meta), layer(x, POS, CU), rtol=0, atol=0)
    with pytest.raises(ValueError, match="packed starts"):
        layer(x[:14], POS[:14], CU, metadata=meta)
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        layer(x[:, :10], POS, CU)
    with pytest.raises(ValueError, match=r"position_ids must be \[15\]"):
        layer(x, POS[:3], CU)


def test_float32_layer_matches_float64():
    layer = _layer()
    x = torch.randn(15, 64, dtype=torch.float64)
    want, topk = layer(x, POS, CU, return_topk=True)
    layer32 = layer.float()
    got = layer32(x.float(), POS, CU, prev_topk=None)
    # fp32 forward of a float64-built layer: a handful of fp32 roundings of O(1) values.
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_derive_indexer_types():
    assert derive_indexer_types(6, freq=2) == ["full", "full", "shared", "full", "shared", "full"]
    assert derive_indexer_types(3) == ["full"] * 3
    assert derive_indexer_types(4, pattern="FSSF") == ["full", "shared", "shared", "full"]
    assert derive_indexer_types(2, pattern=["full", "shared"]) == ["full", "shared"]
    with pytest.raises(ValueError, match="first DSA layer must be 'full'"):
        derive_indexer_types(2, pattern="SF")
    with pytest.raises(ValueError, match="only 'F' and 'S'"):
        derive_indexer_types(2, pattern="FX")
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        derive_indexer_types(3, pattern="FS")


def test_autotune_shape():
    layer = DSAAttention(small_config(), 3, "shared").to(torch.bfloat16)
    assert layer.dsa_autotune_shape() == dict(
        num_heads=4, d_qk=48, d_v=32, topk=4, index_heads=2, index_dim=32, dtype=torch.bfloat16
    )
    glm = DSAConfig()
    assert (glm.kv_lora_rank + glm.qk_rope_head_dim, glm.index_topk, glm.index_n_heads) == (576, 2048, 32)


@pytest.mark.parametrize("use_step", [False, True], ids=["cu_seqlens", "cp_step"])
def test_torch_compile_equals_eager_over_changing_layouts(use_step):
    """``torch.compile(DSAAttention)`` (aot_eager) forward and every gradient equal eager, for two packed layouts of
    the same length in turn: the metadata (host work, one sync) is rebuilt per call, never baked into the graph."""
    from longtrain.blockdiag_cp import build_cp_step

    torch._dynamo.reset()
    layer = _layer()
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(16, 64, dtype=torch.float64, requires_grad=True)
    for lens in ([9, 7], [2, 13, 1]):
        pos = torch.cat([torch.arange(n) for n in lens])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        runs = []
        for module in (layer, compiled):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            if use_step:
                ids = torch.repeat_interleave(torch.arange(1, len(lens) + 1), torch.tensor(lens))
                out = module(x, pos, cp_step=build_cp_step(ids, None))
            else:
                out = module(x, pos, cu)
            out.square().sum().backward()
            runs.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
        for got, want in zip(runs[1], runs[0]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)  # float64: AOT autograd reorders sums only
