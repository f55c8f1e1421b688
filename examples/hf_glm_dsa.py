"""A tiny randomly initialised GLM-MoE-DSA (transformers' ``glm_moe_dsa``, no download) trained with our DSA kernels.

Run::

    python examples/hf_glm_dsa.py

``apply_dsa(model)`` replaces every DSA attention's forward with the fused indexer top-k and sparse MLA over packed
documents (no ``[B, S, T]`` score matrix or mask); layer 1 is an IndexShare ("shared") layer reusing layer 0's
top-k. Step 0 is checked against transformers' own eager model run on every document alone.
"""

import copy

import torch
from transformers import DataCollatorWithFlattening, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from longtrain.integrations import hf

config = GlmMoeDsaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, index_topk=16, index_head_dim=32, index_n_heads=16, indexer_types=["full", "shared", "full", "full"],
    use_cache=False, max_position_embeddings=1024,
)  # fmt: skip
torch.manual_seed(0)
reference = GlmMoeDsaForCausalLM(config)  # float32: the MoE experts' grouped matmul has no float64
reference.set_attn_implementation("eager")
model = copy.deepcopy(reference)
print(f"apply_dsa replaced {hf.apply_dsa(model)} attention modules")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
for step in range(3):
    docs = [torch.randint(1, 128, (n,), generator=gen) for n in (40, 70, 30)]
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    out = model(**batch)
    out.loss.backward()
    if step == 0:
        with torch.no_grad():
            alone = torch.cat([reference(input_ids=d[None]).logits for d in docs], 1)
        err = ((out.logits - alone).abs().max() / alone.abs().max()).item()
        assert err < 1e-4, err  # float32: summation order differs between the two attention paths
        print(f"step 0: logits equal transformers' eager model per document (relative error {err:.1e})")
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.4f}")
