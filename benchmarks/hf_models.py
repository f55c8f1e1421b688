"""Whole Hugging Face models on one GPU: our integrations next to transformers' own implementations.

``--model llama`` (the default): ``attn_implementation="longtrain_blockdiag"`` against HF's ``flex_attention``,
``sdpa`` and ``eager``. A Llama of 4 layers (hidden 2048, GQA 16:8, head dim 128, intermediate 5632, vocab
32000), bf16, randomly initialised from its config, trains on one packed row of ``--tokens`` tokens (documents
U[512, 8192], seed 1, the layout of ``blockdiag_attention.py``) with restarting ``position_ids`` and
``use_cache=False`` (Hugging Face's own paths see packed position ids only without a cache).

For each implementation: forward + backward of the whole model (loss included), tokens/s from the median of
``--steps`` timed steps after two warm-up steps, peak allocated memory, and the loss (equal across implementations
up to bf16 rounding: each one is per-document). An implementation that runs out of memory is reported as OOM.

``--model glm-dsa``: transformers' ``GlmMoeDsaForCausalLM`` with GLM-5's attention shape (hidden 6144, 64 heads,
q LoRA 2048, latent 512 + rope 64, v head 256, indexer 32 x 128, top-k 2048), 2 layers with dense MLPs (intermediate
12288), vocab 32000: 1.195B parameters, bf16. One document per row (HF's DSA path has no packed-document mask), at
``--tokens`` lengths: HF's ``sdpa`` and ``eager`` (which build a dense ``[B, S, T]`` indexer score matrix and an
additive mask) against :func:`longtrain.integrations.hf.apply_dsa` with each of ``--dsa-backends``; ours also on
one packed 32K row of documents U[512, 8192] with restarting ``position_ids`` (per-document attention and top-k).

Run on a GPU from the repository root (transformers installed)::

    PYTHONPATH=src python benchmarks/hf_models.py [--model llama|glm-dsa|all] [--tokens 32768] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402
from longtrain.packing import BENCH_LAYOUTS as LAYOUTS  # noqa: E402
from longtrain.packing import doc_lengths, positions_from_lengths  # noqa: E402

IMPLEMENTATIONS = ["longtrain_blockdiag", "flex_attention", "sdpa", "eager"]
GLM_IMPLEMENTATIONS = ["sdpa", "eager"]
GLM_TOKENS = [2048, 8192, 16384, 32768, 65536]
PACKED_TOKENS = 32768


def llama(transformers, device):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=65536, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def glm_dsa(transformers, device):
    config = transformers.GlmMoeDsaConfig(
        vocab_size=32000, num_hidden_layers=2, mlp_layer_types=["dense", "dense"], max_position_embeddings=131072,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GlmMoeDsaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def packed_batch(tokens, lengths, device, vocab=32000):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, tokens), generator=gen)
    pos = positions_from_lengths(lengths)[None]
    labels = ids.clone()
    for start in torch.tensor([0, *lengths]).cumsum(0)[:-1]:
        labels[0, start] = -100
    return {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device)}


def measure(row, model, impl, batch, steps):
    try:
        ms, peak, loss = run(model, impl, batch, steps)
        if PROFILE["dir"] is not None:
            profile_step(model, batch, f"{row['model'][:5]}_{row['tokens']}_{row['docs']}_{row['impl']}")
        row.update(ms=ms, tokens_per_s=row["tokens"] / ms * 1e3, peak_gib=peak, loss=loss, status="ok")
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as exc:
        traceback.print_exc()
        row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


def llama_rows(transformers, device, token_counts, impls, steps):
    model = llama(transformers, device)
    rows = []
    for tokens in token_counts:
        lo, hi, seed = LAYOUTS["long"]
        lengths = doc_lengths(tokens, lo, hi, seed)
        batch = packed_batch(tokens, lengths, device)
        for impl in impls:
            row = {"model": "Llama 4x2048, GQA 16:8, hd 128", "tokens": tokens, "docs": len(lengths), "impl": impl}
            rows.append(measure(row, model, impl, batch, steps))
    del model
    torch.cuda.empty_cache()
    return rows


def glm_rows(transformers, device, token_counts, dsa_backends, steps):
    from longtrain.integrations import hf

    model = glm_dsa(transformers, device)
    name = "GLM-MoE-DSA 2 layers, GLM-5 attention, dense MLP"
    rows = []
    for impl in GLM_IMPLEMENTATIONS:  # HF's own first: apply_dsa replaces the attention forwards in place
        for tokens in token_counts:
            row = {"model": name, "tokens": tokens, "docs": 1, "impl": impl}
            rows.append(measure(row, model, impl, packed_batch(tokens, [tokens], device), steps))
    lo, hi, seed = LAYOUTS["long"]
    for backend in dsa_backends:
        hf.apply_dsa(model, backend=backend)
        impl = f"apply_dsa(backend={backend!r})"
        layouts = [(tokens, [tokens]) for tokens in token_counts]
        layouts.append((PACKED_TOKENS, doc_lengths(PACKED_TOKENS, lo, hi, seed)))
        for tokens, lengths in layouts:
            row = {"model": name, "tokens": tokens, "docs": len(lengths), "impl": impl}
            rows.append(measure(row, model, None, packed_batch(tokens, lengths, device), steps))
    del model
    torch.cuda.empty_cache()
    return rows


PROFILE: dict[str, Path | None] = {"dir": None}


def profile_step(model, batch, label):
    """One more step under torch.profiler: the top CUDA ops by total time, written to ``<--profile>/<label>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(**batch).loss.backward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
    (PROFILE["dir"] / f"{safe}.txt").write_text(table)


def run(model, impl, batch, steps):
    if impl is not None:
        model.set_attn_implementation(impl)
    times = []
    for i in range(steps + 2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(**batch).loss
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "glm-dsa", "all"], default="llama")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"row lengths (default: 32768 for llama, {GLM_TOKENS} for glm-dsa)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=IMPLEMENTATIONS, help="the Llama's attn_implementations")
    parser.add_argument("--dsa-backends", nargs="+", default=["auto"], help="apply_dsa backends for glm-dsa")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--profile", default=None, help="folder for one profiled step per row (top CUDA ops)")
    args = parser.parse_args(argv)
    if args.profile:
        PROFILE["dir"] = Path(args.profile)
        PROFILE["dir"].mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    import transformers

    from longtrain.integrations import hf

    hf.register()
    device = torch.device("cuda")
    header = {**machine_header(), "transformers": transformers.__version__}
    rows = []
    if args.model in ("llama", "all"):
        rows += llama_rows(transformers, device, args.tokens or [32768], args.impls, args.steps)
    if args.model in ("glm-dsa", "all"):
        rows += glm_rows(transformers, device, args.tokens or GLM_TOKENS, args.dsa_backends, args.steps)
    columns = [("model", "model"), ("tokens", "tokens"), ("docs", "docs"), ("impl", "implementation"),
               ("tokens_per_s", "tokens/s (fwd+bwd)"), ("ms", "ms per step"), ("peak_gib", "peak GiB"),
               ("loss", "loss"), ("status", "status")]  # fmt: skip
    notes = (
        "bf16, use_cache=False; forward + backward of the whole model including the loss, median of the timed "
        "steps after 2 warm-up steps; peak = torch.cuda.max_memory_allocated over the timed steps. Llama: one packed "
        "row of documents U[512, 8192] (seed 1) with restarting position_ids. GLM-MoE-DSA: one document per row for "
        "HF's implementations and ours, plus ours on a packed 32K row of documents U[512, 8192] (seed 1)."
    )
    name = "hf_models" if args.model == "llama" else f"hf_models_{args.model.replace('-', '_')}"
    md, js = write_report(name, rows, columns, notes, header=header, out_dir=args.out_dir,
                          title="Hugging Face models: attention implementations")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
