# ruff: noqa: E501, B023
"""Investigation: which cuDNN-frontend route gives packed-document attention the fastest backward on this GPU.

Our ``cudnn`` backend measured cuDNN's ragged graph-API backward at ~247 TFLOP/s on 32K tokens of documents
U[512, 8192] (GQA 32:8, head dim 128, bf16), against ~527 for cuDNN SDPA on one causal document. This script
looks for the cause and for a faster route, all on the same inputs:

1. the graph-API backward's ranked execution plans (with the CuTe DSL engines of ``nvidia-cudnn-frontend``
   installed, python engines may claim the graph): each plan timed on its own;
2. the graph-API backward with a top-left diagonal (equal to bottom-right when every document has as many
   queries as keys) and with K/V repeated to the query heads (MHA instead of GQA);
3. the frontend's CuTe DSL interval-mask attention (``cudnn.flex_attention``, THD varlen): correctness against
   the float64 reference, its own forward/backward, and its backward fed with the graph-API forward's output
   and log-sum-exp (the combination our backend would use), on the four benchmark layouts;
4. the frontend's DSA sparse-attention backward (``cudnn.deepseek_sparse_attention``) at the GLM-5.2 shape,
   next to our Triton backward in the same run.

Run: ``PYTHONPATH=src python benchmarks/blockdiag_cudnn_bwd_probe.py [--json PATH]``.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blockdiag_attention import doc_lengths, mask_area  # noqa: E402
from longtrain.blockdiag_cp.providers import cudnn_graph as cv  # noqa: E402
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128
ROWS: list[dict] = []


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60)


def cu_of(lengths, dev):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)


def record(**row) -> None:
    ROWS.append(row)
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def inputs(total, dev, seed=0, grad=False):
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def graph_state(q, k, cu, max_len):
    lay = cv._layout(cu, cu, max_len, max_len, HQ, HKV, D, None)
    p = cv._params(q, k, lay, D**-0.5, False, q.shape[0], k.shape[0])
    return lay, p


# ------------------------------------------------------------------------------------------ 1 + 2: graph API


def graph_plans(dev) -> None:
    import cudnn

    total = 32768
    lengths = doc_lengths(total, 512, 8192, 1)
    cu = cu_of(lengths, dev)
    q, k, v, dout = inputs(total, dev)
    lay, p = graph_state(q, k, cu, max(lengths))
    flops = 2.5 * 4 * mask_area(lengths) * HQ * D
    out, stats = cv.cudnn_varlen_fwd(q, k, v, lay, p)
    dq0, dk0, dv0 = cv.cudnn_varlen_bwd(dout, q, k, v, out, stats, lay, p)
    ms = bench(lambda: cv.cudnn_varlen_bwd(dout, q, k, v, out, stats, lay, p))
    record(section="graph", variant="library bwd (selected plan)", ms=ms, tflops=flops / ms / 1e9)
    ms = bench(lambda: cv.fa2_bwd_from_cudnn(dout, q, k, v, out, stats, lay, p))
    record(section="graph", variant="FA2 bwd from cuDNN fwd", ms=ms, tflops=flops / ms / 1e9)

    # every ranked plan of the same backward graph
    handle = cv._handle(dev)
    finish = cv._finish
    built = {}

    def plan_only(g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        built["g"] = g

    cv._finish = plan_only
    try:
        cv._build_bwd(p, handle, cv.RAGGED_STATS_BWD is not False)
    except RuntimeError:  # the workspace query needs a built plan; the graph itself is what we want
        pass
    finally:
        cv._finish = finish
    g = built["g"]
    try:
        g.check_support()
    except Exception as exc:
        print("check_support:", type(exc).__name__, str(exc)[:200])
    count = g.get_execution_plan_count()
    print("backward plans:", count, flush=True)
    pack = {cv._Q: q, cv._K: k, cv._V: v, cv._O: out, cv._DO: dout, cv._STATS: stats,
            cv._SEQ_Q: lay["seq_q"], cv._SEQ_K: lay["seq_k"], cv._RAG_Q: lay["rag_q"], cv._RAG_K: lay["rag_k"]}  # fmt: skip
    if cv.RAGGED_STATS_BWD is not False:
        pack[cv._RAG_STATS] = lay["rag_stats"]
    for i in range(min(count, 12)):
        name = "?"
        try:
            name = g.get_plan_name_at_index(i)
            g.build_plan_at_index(i)
            ws = torch.empty(max(g.get_workspace_size_plan_at_index(i), 1), dtype=torch.uint8, device=dev)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            pack.update({cv._DQ: dq, cv._DK: dk, cv._DV: dv})
            g.execute_plan_at_index(pack, ws, i, handle)
            torch.cuda.synchronize()
            diff = max((a.float() - b.float()).abs().max().item() for a, b in ((dq, dq0), (dk, dk0), (dv, dv0)))
            ms = bench(lambda: g.execute_plan_at_index(pack, ws, i, handle))
            record(
                section="graph", variant=f"plan {i}: {name}", ms=ms, tflops=flops / ms / 1e9, max_diff_vs_selected=diff
            )
        except Exception as exc:
            record(section="graph", variant=f"plan {i}: {name}", note=f"failed: {type(exc).__name__}: {str(exc)[:160]}")

    # top-left diagonal (every document here has as many queries as keys) and MHA (K/V repeated)
    inputs_fn = cv._graph_inputs

    def top_left(g, io, params):
        out_ = inputs_fn(g, io, params)
        out_[-1]["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
        return out_

    cv._graph_inputs = top_left
    cv.reset_cudnn_graph_cache()
    try:
        o_tl, s_tl = cv.cudnn_varlen_fwd(q, k, v, lay, p)
        g_tl = cv.cudnn_varlen_bwd(dout, q, k, v, o_tl, s_tl, lay, p)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g_tl, (dq0, dk0, dv0)))
        ms_f = bench(lambda: cv.cudnn_varlen_fwd(q, k, v, lay, p))
        ms = bench(lambda: cv.cudnn_varlen_bwd(dout, q, k, v, o_tl, s_tl, lay, p))
        record(
            section="graph",
            variant="top-left diagonal",
            ms=ms,
            tflops=flops / ms / 1e9,
            fwd_tflops=flops / 2.5 / ms_f / 1e9,
            max_diff_vs_selected=diff,
        )
    except Exception as exc:
        record(section="graph", variant="top-left diagonal", note=f"failed: {type(exc).__name__}: {str(exc)[:160]}")
    finally:
        cv._graph_inputs = inputs_fn
        cv.reset_cudnn_graph_cache()
    try:
        kr, vr = (t.repeat_interleave(HQ // HKV, 1).contiguous() for t in (k, v))
        lay_r = cv._layout(cu, cu, max(lengths), max(lengths), HQ, HQ, D, None)
        p_r = cv._params(q, kr, lay_r, D**-0.5, False, total, total)
        o_r, s_r = cv.cudnn_varlen_fwd(q, kr, vr, lay_r, p_r)
        ms = bench(lambda: cv.cudnn_varlen_bwd(dout, q, kr, vr, o_r, s_r, lay_r, p_r))
        record(section="graph", variant="MHA (K/V repeated to 32 heads)", ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:
        record(section="graph", variant="MHA", note=f"failed: {type(exc).__name__}: {str(exc)[:160]}")


# ------------------------------------------------------------------------------------------ 3: CuTe DSL flex


def visible_keys(cu_q, cu_k, total_q):
    """``[1, 1, T_q] int32``: keys ``[0, F0)`` of its document visible to each query (bottom-right causal)."""
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    doc = torch.repeat_interleave(torch.arange(lq.numel(), device=cu_q.device), lq, output_size=total_q)
    pos = torch.arange(total_q, device=cu_q.device) - cu_q[:-1].long()[doc]
    return (pos + 1 + (lk - lq).long()[doc]).to(torch.int32).view(1, 1, total_q).contiguous()


def flex_route(dev) -> None:
    from cudnn.flex_attention import create_mask_plan, flex_attn_func
    from cudnn.flex_attention.execution import _flex_attention_backward

    scale = D**-0.5

    # correctness on a straddling first segment, tiny documents and ordinary ones
    segq, segk = [300, 5, 1, 700, 64], [1000, 5, 1, 700, 64]
    cq, ck = cu_of(segq, dev), cu_of(segk, dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(sum(segq), HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sum(segk), HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(sum(segk), HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    dout = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    plan = create_mask_plan(visible_keys(cq, ck, q.shape[0]), qg, kg, vg, cu_seqlens_q=cq, cu_seqlens_k=ck,
                            max_seqlen_q=max(segq), max_seqlen_k=max(segk), build_backward=True)  # fmt: skip
    o, lse = flex_attn_func(qg, kg, vg, mask_plan=plan, softmax_scale=scale, return_lse=True)
    grads = torch.autograd.grad(o, (qg, kg, vg), dout)
    torch.cuda.synchronize()
    print(f"flex first call (JIT compile): {time.perf_counter() - t0:.1f} s", flush=True)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    r = reference_varlen_attention(q64, k64, v64, cq, ck, scale=scale)
    r_grads = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    rb = reference_varlen_attention(qb, kb, vb, cq, ck, scale=scale)
    rb_grads = torch.autograd.grad(rb, (qb, kb, vb), dout)
    for name, a, want, same in zip(("o", "dq", "dk", "dv"), (o, *grads), (r, *r_grads), (rb, *rb_grads)):
        err = (a.double() - want).abs().max().item()
        bound = 2 * (same.double() - want).abs().max().item() + want.abs().max().item() * 2**-8
        record(section="flex-correctness", tensor=name, err=err, allowed=bound, ok=bool(err <= bound))
    # the graph-API forward's statistics are the same natural-log LSE
    lay = cv._layout(cq, ck, max(segq), max(segk), HQ, HKV, D, None)
    p = cv._params(q, k, lay, scale, False, q.shape[0], k.shape[0])
    out_g, stats = cv.cudnn_varlen_fwd(q, k, v, lay, p)
    lse_g = stats[:, :, 0].t().contiguous()
    record(section="flex-correctness", tensor="lse graph vs flex", err=(lse_g - lse).abs().max().item())
    hyb = _flex_attention_backward(q, k, v, out_g, dout, lse_g, mask_plan=plan, softmax_scale=scale)
    for name, a, want, same in zip(
        ("dq", "dk", "dv"), (hyb["dq_tensor"], hyb["dk_tensor"], hyb["dv_tensor"]), r_grads, rb_grads
    ):
        err = (a.double() - want).abs().max().item()
        bound = 2 * (same.double() - want).abs().max().item() + want.abs().max().item() * 2**-8
        record(section="flex-correctness", tensor=f"hybrid {name}", err=err, allowed=bound, ok=bool(err <= bound))

    for total, lo, hi, seed in (
        (32768, 512, 8192, 1),
        (32768, 64, 2048, 2),
        (65536, 512, 8192, 1),
        (65536, 64, 2048, 2),
    ):
        lengths = doc_lengths(total, lo, hi, seed)
        cu = cu_of(lengths, dev)
        tag = f"{total} U[{lo},{hi}] ({len(lengths)} docs)"
        fl = 4 * mask_area(lengths) * HQ * D
        try:
            q, k, v, dout = inputs(total, dev, grad=True)
            mask = visible_keys(cu, cu, total)
            mk = lambda: create_mask_plan(mask, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),  # noqa: E731
                                          max_seqlen_k=max(lengths), build_backward=True)  # fmt: skip
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            plan = mk()
            torch.cuda.synchronize()
            cold = (time.perf_counter() - t0) * 1e3
            ms_plan = bench(mk)
            with torch.no_grad():
                ms_f = bench(lambda: flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale))
            ms_fb = bench(
                lambda: torch.autograd.grad(
                    flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=scale), (q, k, v), dout
                )
            )
            qd, kd, vd = (t.detach() for t in (q, k, v))
            lay, p = graph_state(qd, kd, cu, max(lengths))
            out_g, stats = cv.cudnn_varlen_fwd(qd, kd, vd, lay, p)
            lse_g = stats[:, :, 0].t().contiguous()
            ms_gf = bench(lambda: cv.cudnn_varlen_fwd(qd, kd, vd, lay, p))
            ms_hb = bench(
                lambda: _flex_attention_backward(qd, kd, vd, out_g, dout, lse_g, mask_plan=plan, softmax_scale=scale)
            )
            ms_fa2 = bench(lambda: cv.fa2_bwd_from_cudnn(dout, qd, kd, vd, out_g, stats, lay, p))
            record(section="flex", layout=tag, plan_cold_ms=cold, plan_ms=ms_plan, flex_fwd_tflops=fl / ms_f / 1e9,
                   flex_bwd_tflops=2.5 * fl / (ms_fb - ms_f) / 1e9, graph_fwd_tflops=fl / ms_gf / 1e9,
                   hybrid_bwd_ms=ms_hb, hybrid_bwd_tflops=2.5 * fl / ms_hb / 1e9, fa2_bwd_tflops=2.5 * fl / ms_fa2 / 1e9)  # fmt: skip
        except Exception as exc:
            traceback.print_exc()
            record(section="flex", layout=tag, note=f"failed: {type(exc).__name__}: {str(exc)[:200]}")


# ------------------------------------------------------------------------------------------ 4: DSA backward


def dsa_backward(dev) -> None:
    from dsa import D_QK, D_V, TOPK, causal_index_sets, mla_inputs, run_bwd, run_fwd
    from longtrain.dsa import cudnn_dsa as cd

    for total, heads in ((16384, 64), (4096, 64), (16384, 128)):
        idx, length, _, _ = causal_index_sets([total], TOPK, dev)
        q, kv = mla_inputs(total, heads, dev)
        out, lse = run_fwd(q, kv, idx, length, None)
        dout = torch.randn_like(out)
        valid = int(length.to(torch.int64).sum())
        fl = 2 * valid * heads * (3 * D_QK + 2 * D_V)
        shape = f"T={total} H={heads} K={TOPK} 1doc"
        ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length))
        record(section="dsa-bwd", shape=shape, impl="triton (ours)", ms=ms, tflops=fl / ms / 1e9)
        try:
            sink = torch.full((heads,), -math.inf, device=dev)
            fn = cd._cudnn_dsa().sparse_attention_backward_wrapper
            call = lambda: fn(q, kv[:, 0], out, dout, lse, sink, idx, softmax_scale=D_QK**-0.5, topk_length=length)  # noqa: E731
            res = call()
            ours = run_bwd(q, kv, out, dout, lse, idx, length)
            diff = (res["dq"][:, :heads].float() - ours[0].float()).abs().max().item()
            ms = bench(call)
            record(
                section="dsa-bwd",
                shape=shape,
                impl="cuDNN frontend SparseAttentionBackward",
                ms=ms,
                tflops=fl / ms / 1e9,
                dq_max_diff_vs_ours=diff,
            )
        except Exception as exc:
            record(
                section="dsa-bwd",
                shape=shape,
                impl="cuDNN frontend",
                note=f"failed: {type(exc).__name__}: {str(exc)[:200]}",
            )


def main() -> int:
    dev = torch.device("cuda")
    import cudnn

    print(
        "torch",
        torch.__version__,
        "cudnn backend",
        cudnn.backend_version(),
        "frontend",
        getattr(cudnn, "__version__", "?"),
        torch.cuda.get_device_name(),
    )
    for section in (graph_plans, flex_route, dsa_backward):
        try:
            section(dev)
        except Exception:
            traceback.print_exc()
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(ROWS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
