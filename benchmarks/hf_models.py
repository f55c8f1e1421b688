"""Whole Hugging Face models on one GPU: ``attn_implementation="longtrain_blockdiag"`` next to transformers' own.

A Llama of 4 layers (hidden 2048, GQA 16:8, head dim 128, intermediate 5632, vocab 32000), bf16, randomly
initialised from its config, trains on one packed row of ``--tokens`` tokens (documents U[512, 8192], seed 1, the
layout of ``blockdiag_attention.py``) with restarting ``position_ids`` and ``use_cache=False`` (Hugging Face's own
paths see packed position ids only without a cache). For each implementation: forward + backward of the whole model
(loss included), tokens/s from the median of ``--steps`` timed steps after two warm-up steps, peak allocated memory,
and the loss (equal across implementations up to bf16 rounding: each one is per-document). An implementation that
runs out of memory is reported as OOM.

Run on a GPU from the repository root (transformers installed)::

    PYTHONPATH=src python benchmarks/hf_models.py [--tokens 32768] [--out-dir DIR]
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


def llama(transformers, device):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=65536, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def run(model, impl, batch, steps):
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
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, float(loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=IMPLEMENTATIONS)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    import transformers

    from longtrain.integrations import hf

    hf.register()
    device = torch.device("cuda")
    model = llama(transformers, device)
    header = {**machine_header(), "transformers": transformers.__version__}
    rows = []
    for tokens in args.tokens:
        lo, hi, seed = LAYOUTS["long"]
        lengths = doc_lengths(tokens, lo, hi, seed)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 32000, (1, tokens), generator=gen)
        pos = positions_from_lengths(lengths)[None]
        labels = ids.clone()
        for start in torch.tensor([0, *lengths]).cumsum(0)[:-1]:
            labels[0, start] = -100
        batch = {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device)}
        for impl in args.impls:
            row = {"model": "Llama 4x2048, GQA 16:8, hd 128", "tokens": tokens, "docs": len(lengths), "impl": impl}
            try:
                ms, peak, loss = run(model, impl, batch, args.steps)
                row.update(ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=peak, loss=loss, status="ok")
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as exc:
                traceback.print_exc()
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    columns = [("model", "model"), ("tokens", "tokens"), ("docs", "docs"), ("impl", "attn_implementation"),
               ("tokens_per_s", "tokens/s (fwd+bwd)"), ("ms", "ms per step"), ("peak_gib", "peak GiB"),
               ("loss", "loss"), ("status", "status")]  # fmt: skip
    notes = (
        "bf16, one packed row of documents U[512, 8192] (seed 1) with restarting position_ids, use_cache=False; "
        "forward + backward of the whole model including the loss, median of the timed steps after 2 warm-up steps."
    )
    md, js = write_report("hf_models", rows, columns, notes, header=header, out_dir=args.out_dir,
                          title="Hugging Face models: attention implementations")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
