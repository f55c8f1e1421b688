"""A tiny torchtitan Llama 3 trained on packed rows with context parallelism (torchtitan's varlen has none).

Run on CPUs (gloo) or GPUs (nccl), with torchtitan installed::

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_llama_cp.py

The model is torchtitan's own ``Llama3Model`` built with ``attn_backend="varlen"``; ``apply_blockdiag`` swaps its
inner attention for the block-diagonal one. Every step packs three documents (``positions`` restart at 0 per
document, labels are the next token inside the document, -100 at each document's end), shards the row with
``titan_cp_batch`` (here balanced: equal causal work per rank) and runs the model on this rank's shard. Step 0 is
checked against the same model on the whole row in one process, with torchtitan's varlen masks.
"""

import gc

import torch
import torch.distributed as dist
from torchtitan.models.llama3 import ComplexRoPE, Embedding, Linear, Llama3Model, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import _build_llama3_layers as build_layers

from longtrain.integrations import torchtitan as tt

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
dim, heads, vocab = 64, 4, 128
config = Llama3Model.Config(
    dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
    norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab),
    layers=build_layers(n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=compute_ffn_hidden_dim(dim),
                        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=1024, theta=10000.0),
                        attn_backend="varlen"),
)  # fmt: skip
torch.manual_seed(0)
model = config.build()
model.init_states()
model.to(device)
tt.apply_blockdiag(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
for step in range(3):
    lengths = (70, 120, 50)
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=gen).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    labels = tokens.roll(-1, 1)
    labels[0, torch.tensor(lengths).cumsum(0) - 1] = -100  # no target across a document boundary
    n_labels = int((labels != -100).sum())
    ctx, kwargs, local_labels, layout = tt.titan_cp_batch(tokens, labels, positions, dist.group.WORLD,
                                                          sharding="balanced", shard_chunk=16)  # fmt: skip
    with ctx():
        logits = model(**kwargs)  # this rank's shard
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten(),
                                                 reduction="sum") / n_labels  # fmt: skip
        loss.backward()
    for p in model.parameters():  # the CP ranks hold replicas: sum their gradients
        dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if step == 0:  # the same model on the whole row in one process, torchtitan's own varlen masks
        with torch.no_grad():
            ref_logits = model(tokens, positions=positions, attention_masks=tt.varlen_masks(positions))
            ref = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1).float(), labels.flatten(),
                                                    reduction="sum") / n_labels  # fmt: skip
        assert torch.allclose(total, ref, rtol=1e-4), (total.item(), ref.item())
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {total.item():.4f} ({layout.padded_seq_len} tokens over {world} ranks, balanced)")
gc.collect()  # before destroying the group: torch 2.13's gloo can abort at exit otherwise (README)
dist.destroy_process_group()
