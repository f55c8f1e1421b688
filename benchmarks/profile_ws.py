"""Three warp-specialized SM90 launches at the GLM-5.2 shape (T = 16384, H = 64, K = 2048), for ``ncu``: the forward
(argument ``block_k x num_stages``, default 64x2; ``pp``: the ping-pong forward) or, with the argument ``bwd``, the
backward (its default on SM90, the warp-specialized probabilities + dkv kernel, then the dq kernel).

``ncu --set full -k regex:ws_kernel -s 2 -c 1 -o prof python benchmarks/profile_ws.py 32x4`` profiles the third;
``logs/ncu_dsa_fwd_ws_32x4_b0a921f_details.txt`` came from it. A second argument ``T,H,K`` sets another shape (one
document), e.g. ``ncu --set full -k regex:kernel_dq -s 2 -c 1 -o prof python benchmarks/profile_ws.py bwd
4096,128,512`` for the dq kernel at K = 512.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from longtrain.bench_suites.dsa import TOPK, causal_index_sets, mla_inputs, run_bwd, run_fwd  # noqa: E402
from longtrain.dsa.triton import KernelConfig  # noqa: E402

what = sys.argv[1] if len(sys.argv) > 1 else "64x2"
total, heads, topk = (int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else (16384, 64, TOPK)
dev = torch.device("cuda")
idx, length, _, _ = causal_index_sets([total], topk, dev)
q, kv = mla_inputs(total, heads, dev)
if what == "bwd":
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    for _ in range(3):
        run_bwd(q, kv, out, dout, lse, idx, length)
else:
    block_k, num_buf = (64, 2) if what == "pp" else (int(x) for x in what.split("x"))
    layout = "ping_pong" if what == "pp" else "warp_specialized"
    cfg = KernelConfig(impl="sm90", layout=layout, num_warps=4, block_k=block_k, num_stages=num_buf)
    for _ in range(3):
        run_fwd(q, kv, idx, length, cfg)
torch.cuda.synchronize()
