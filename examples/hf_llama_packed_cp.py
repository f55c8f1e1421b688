"""A tiny randomly initialised Llama (no download) trained on packed rows with context parallelism.

Run on CPUs (gloo) or GPUs (nccl)::

    torchrun --standalone --nproc-per-node 2 examples/hf_llama_packed_cp.py

Every step packs three documents with ``DataCollatorWithFlattening`` (position ids restart per document, the first
label of each document is -100), shards the row over the ranks with ``hf_cp_batch`` (labels shifted over the full
row first) and runs ``model(**kwargs)`` with ``attn_implementation="longtrain_blockdiag"``. Step 0 is checked
against the same model run on every document alone in one process.
"""

import gc

import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from longtrain.integrations import hf

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
hf.register()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, use_cache=False)  # fmt: skip
model = LlamaForCausalLM(config).to(device)
model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
collate = DataCollatorWithFlattening()
gen = torch.Generator().manual_seed(1)
for step in range(3):
    docs = [{"input_ids": torch.randint(1, 128, (n,), generator=gen).tolist()} for n in (70, 120, 50)]
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(docs).items()}
    ctx, kwargs, layout = hf.hf_cp_batch(batch, dist.group.WORLD)
    with ctx():
        loss = model(**kwargs).loss  # this rank's share of the row's mean loss
        loss.backward()
    for p in model.parameters():  # the CP ranks hold replicas: sum their gradients
        dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if step == 0:  # the same model on every document alone, one process
        with torch.no_grad():
            logits = torch.cat(
                [model(input_ids=batch["input_ids"][:, a:b]).logits for a, b in ((0, 70), (70, 190), (190, 240))], 1
            )
            ref = torch.nn.functional.cross_entropy(logits[0], hf.shift_labels(batch["labels"])[0])
        assert torch.allclose(total, ref, rtol=1e-4), (total.item(), ref.item())
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {total.item():.4f} ({layout.padded_seq_len} tokens over {world} ranks)")
gc.collect()  # before destroying the group: torch 2.13's gloo can abort at exit otherwise (README)
dist.destroy_process_group()
