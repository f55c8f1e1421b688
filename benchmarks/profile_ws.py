"""One warp-specialized SM90 forward launch at the GLM-5.2 shape, for ``ncu`` (profiling helper, experiment)."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "benchmarks")
from longtrain.bench_suites.dsa import TOPK, causal_index_sets, mla_inputs, run_fwd  # noqa: E402
from longtrain.dsa.triton import KernelConfig  # noqa: E402

block_k, num_buf = (int(x) for x in sys.argv[1].split("x")) if len(sys.argv) > 1 else (32, 4)
dev = torch.device("cuda")
idx, length, _, _ = causal_index_sets([16384], TOPK, dev)
q, kv = mla_inputs(16384, 64, dev)
cfg = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=block_k, num_stages=num_buf)
for _ in range(3):
    run_fwd(q, kv, idx, length, cfg)
torch.cuda.synchronize()
