# ruff: noqa: E501, B023
"""Investigation script: how cuDNN varlen SDPA behaves on this GPU (call-time cost, caching, alignment).

Prints, for packed documents (Hq=32, Hkv=8, D=128, bf16, 32K tokens):

1. torch's ``aten._cudnn_attention_forward`` with cumulative offsets: first call vs repeated identical calls vs
   a different document layout (is a cuDNN graph built per call?), and whether its causal mask is aligned
   top-left or bottom-right on a segment with more keys than queries.
2. The cuDNN frontend Python package (``import cudnn``, carried as a wheel): its ``torch.ops.cudnn.sdpa_fwd``
   THD op with bottom-right causal alignment: correctness, cold vs warm call time, graph-cache behaviour
   when the number of documents / max length change, and whether padding the document list with
   zero-length documents (to bucket shapes) keeps results exact.

3. (default) this package's ``cudnn`` backend: parity with the float64 reference by the flash-attention rule for
   each backward variant (ragged stats, padded stats, FA2 backward), dropout, and 32K timings.

Run: ``PYTHONPATH=src python benchmarks/blockdiag_cudnn_probe.py [--aten-and-frontend-op]`` (1 and 2 only with
the flag). Findings go to docs/blockdiag_kernels.md.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

from longtrain.blockdiag_cp import providers
from longtrain.blockdiag_cp.providers import flash
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blockdiag_attention import doc_lengths as layout  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _cudnn_cu(q, k, v, cu_q, cu_k, max_q=None, max_k=None, dropout_p=0.0):
    """The ``cudnn`` provider over raw offsets (the probe's layouts have documents with Lk >= Lq)."""
    from longtrain.blockdiag_cp.meta import VarlenMeta
    from longtrain.blockdiag_cp.providers import cudnn

    cq, ck = cu_q.tolist(), cu_k.tolist()
    seg_q = tuple(b - a for a, b in zip(cq[:-1], cq[1:]))
    seg_k = tuple(b - a for a, b in zip(ck[:-1], ck[1:]))
    meta = VarlenMeta(n_real=cq[-1], real_end=ck[-1], seg_q=seg_q, seg_k=seg_k, cu_q=cu_q, cu_k=cu_k)
    return cudnn.attention(q, k, v, meta, dropout_p=dropout_p)


def cu_of(lengths, dev):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)


def timed(fn, n=1):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def probe_backend() -> None:
    """The ``cudnn`` backend of this package: parity (flash-attention rule vs float64), stats layout, timing."""
    from triton.testing import do_bench

    from longtrain.blockdiag_cp.providers import cudnn_graph as cv

    dev = torch.device("cuda")
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    print("cudnn backend reason:", providers.unavailable_reason("cudnn", torch.bfloat16, dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    modes = {"ragged-stats": ("cudnn", None), "padded-stats": ("cudnn", False), "fa2-bwd": ("fa2", None)}
    cases = {"straddle+tiny": ([300, 5, 1, 700], [1000, 5, 1, 700]), "40 one-token + 900": ([1] * 40 + [900],) * 2}
    for cname, (segq, segk) in cases.items():
        cq, ck = cu_of(segq, dev), cu_of(segk, dev)
        q = torch.randn(sum(segq), HQ, D, device=dev, generator=gen)
        k = torch.randn(sum(segk), HKV, D, device=dev, generator=gen)
        v = torch.randn(sum(segk), HKV, D, device=dev, generator=gen)
        dout = torch.randn_like(q)

        def grads(fn, dtype):
            qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
            o = fn(qq, kk, vv)
            return [o.detach().double(), *(g.double() for g in torch.autograd.grad(o, (qq, kk, vv), dout.to(dtype)))]

        ref64 = grads(lambda a, b, c: reference_varlen_attention(a, b, c, cq, ck), torch.float64)
        ref16 = grads(lambda a, b, c: reference_varlen_attention(a, b, c, cq, ck), torch.bfloat16)
        for mname, (bwd, ragged) in modes.items():
            cv.BACKWARD, cv.RAGGED_STATS_BWD = bwd, ragged
            try:
                got = grads(
                    lambda a, b, c: _cudnn_cu(a, b, c, cq, ck, max(segq), max(segk)),
                    torch.bfloat16,
                )
                verdict = []
                for name, a, b, r in zip(("o", "dq", "dk", "dv"), got, ref16, ref64):
                    err, base = (a - r).abs().max().item(), (b - r).abs().max().item()
                    step = (r.to(torch.bfloat16).double() - r).abs().max().item()
                    verdict.append(f"{name} {err:.4f}/{2 * base + step:.4f}{'' if err <= 2 * base + step else ' FAIL'}")
                print(f"{cname:20s} {mname:13s} ragged={cv.RAGGED_STATS_BWD} " + "  ".join(verdict))
            except Exception as exc:
                print(f"{cname:20s} {mname:13s} failed: {type(exc).__name__}: {str(exc)[:300]}")
    cv.BACKWARD, cv.RAGGED_STATS_BWD = "cudnn", None
    # dropout: runs, changes the output, finite gradients
    try:
        cq = cu_of([500, 300], dev)
        qq = torch.randn(800, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        kk = torch.randn(800, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        vv = torch.randn(800, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        a = _cudnn_cu(qq, kk, vv, cq, cq, 500, 500)
        b = _cudnn_cu(qq, kk, vv, cq, cq, 500, 500, dropout_p=0.2)
        gs = torch.autograd.grad(b.float().sum(), (qq, kk, vv))
        print(
            f"dropout 0.2: changed {not torch.allclose(a, b)}, grads finite {all(torch.isfinite(g).all().item() for g in gs)}"
        )
    except Exception as exc:
        print(f"dropout failed: {type(exc).__name__}: {str(exc)[:300]}")
    # timing at 32K
    for lname, (lo, hi, seed) in {"long": (512, 8192, 1), "short": (64, 2048, 2)}.items():
        lens = layout(32768, lo, hi, seed)
        cu, m = cu_of(lens, dev), max(lens)
        q = torch.randn(32768, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(32768, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(32768, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)
        fl = 4 * sum(n * (n + 1) // 2 for n in lens) * HQ * D
        variants = {"FA2": lambda: flash.torch_flash_varlen(q, k, v, cu, cu, m, m)}
        for mname, (bwd, ragged) in modes.items():

            def run(bwd=bwd, ragged=ragged):
                cv.BACKWARD, cv.RAGGED_STATS_BWD = bwd, ragged
                return _cudnn_cu(q, k, v, cu, cu, m, m)

            variants[f"cudnn {mname}"] = run
        for vname, fn in variants.items():
            try:
                fn()
                torch.autograd.grad(fn(), (q, k, v), dout)
                with torch.no_grad():
                    tf = do_bench(fn, rep=100)
                tb = do_bench(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout), rep=200) - tf
                print(
                    f"32K {lname:5s} {vname:22s} fwd {fl / tf / 1e9:6.1f}  bwd {2.5 * fl / tb / 1e9:6.1f} TFLOP/s ({tf:.2f} / {tb:.2f} ms)"
                )
            except Exception as exc:
                print(f"32K {lname:5s} {vname:22s} failed: {type(exc).__name__}: {str(exc)[:200]}")
    cv.BACKWARD, cv.RAGGED_STATS_BWD = "cudnn", None
    print("graph cache:", cv.cudnn_graph_cache_stats())


def main() -> None:
    if "--aten-and-frontend-op" not in sys.argv:
        probe_backend()
        return
    dev = torch.device("cuda")
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    total = 32768
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    la = layout(total, 512, 8192, 1)
    lb = layout(total, 512, 8192, 7)
    cua, cub = cu_of(la, dev), cu_of(lb, dev)
    ma, mb = max(la), max(lb)
    scale = D**-0.5

    print("\n== 1. aten._cudnn_attention_forward (THD, cum_seq) ==")
    kr = k.repeat_interleave(HQ // HKV, 1)
    vr = v.repeat_interleave(HQ // HKV, 1)
    for label, kk, vv in (("GQA kv heads", k, v), ("repeated kv heads", kr, vr)):
        try:

            def call(cu=cua, m=ma, kk=kk, vv=vv):
                return torch.ops.aten._cudnn_attention_forward(
                    q, kk, vv, None, cu, cu, m, m, True, 0.0, True, False, scale=scale
                )[0]

            t_first = timed(call)
            t_rep = timed(call, 5)
            t_other = timed(lambda: call(cub, mb))
            t_other_rep = timed(lambda: call(cub, mb), 3)
            fa = flash.torch_flash_varlen(q, k, v, cua, cua, ma, ma, scale=scale)
            diff = (call().float() - fa.float()).abs().max().item()
            print(
                f"{label}: first {t_first:.1f} ms, repeat {t_rep:.1f} ms, other layout {t_other:.1f} ms "
                f"(repeat {t_other_rep:.1f}); max|diff| vs FA2 {diff:.4f}; FA2 {timed(lambda: flash.torch_flash_varlen(q, k, v, cua, cua, ma, ma), 5):.2f} ms"
            )
        except Exception as exc:
            print(f"{label}: failed: {type(exc).__name__}: {str(exc)[:300]}")
    # alignment: one segment with 3 queries and 7 keys
    try:
        qs, ks, vs = q[:3].contiguous(), kr[:7].contiguous(), vr[:7].contiguous()
        cq = torch.tensor([0, 3], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, 7], dtype=torch.int32, device=dev)
        o = torch.ops.aten._cudnn_attention_forward(
            qs, ks, vs, None, cq, ck, 3, 7, True, 0.0, True, False, scale=scale
        )[0]
        br = reference_varlen_attention(qs.double(), ks.double(), vs.double(), cq, ck, scale=scale)
        print(
            f"aten cudnn asymmetric segment: max|diff| vs bottom-right reference {(o.double() - br).abs().max().item():.4f}"
        )
    except Exception as exc:
        print(f"aten cudnn asymmetric segment failed: {type(exc).__name__}: {str(exc)[:200]}")

    print("\n== 2. cuDNN frontend python package ==")
    try:
        import cudnn

        print("cudnn frontend", getattr(cudnn, "__version__", "?"), "backend", cudnn.backend_version())
        import cudnn.sdpa.fwd.torch_op as op
    except Exception:
        traceback.print_exc()
        return
    try:

        def fe(qq, kk, vv, cq, ck, mq, mk, lse=True):
            return torch.ops.cudnn.sdpa_fwd(
                qq, kk, vv, scale, is_causal=True, causal_bottom_right=True,
                cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=mq, max_seqlen_kv=mk, return_lse=lse,
            )  # fmt: skip

        # correctness on an asymmetric first segment + ordinary ones, GQA
        segq, segk = [300, 5, 1, 700], [1000, 5, 1, 700]
        cq, ck = cu_of(segq, dev), cu_of(segk, dev)
        qq = q[: sum(segq)].contiguous()
        kk = k[: sum(segk)].contiguous()
        vv = v[: sum(segk)].contiguous()
        o, _ = fe(qq, kk, vv, cq, ck, max(segq), max(segk))
        ref = reference_varlen_attention(qq.double(), kk.double(), vv.double(), cq, ck, scale=scale)
        ref16 = reference_varlen_attention(qq, kk, vv, cq, ck, scale=scale).double()
        print(
            f"frontend THD bottom-right GQA: err {(o.double() - ref).abs().max().item():.4f} (bf16 ref err {(ref16 - ref).abs().max().item():.4f})"
        )
        # bucketed: pad with zero-length docs and a larger max
        pad_cq = torch.cat([cq, cq[-1:].repeat(12)])
        pad_ck = torch.cat([ck, ck[-1:].repeat(12)])
        o2, _ = fe(qq, kk, vv, pad_cq, pad_ck, 2048, 2048)
        print(
            f"bucketed (16 docs, max 2048): max|diff| vs unbucketed {(o2.float() - o.float()).abs().max().item():.5f}"
        )
        # backward through autograd
        qg, kg, vg = (t.detach().requires_grad_() for t in (qq, kk, vv))
        og, _ = fe(qg, kg, vg, cq, ck, max(segq), max(segk))
        dout = torch.randn_like(og)
        gq, gk, gv = torch.autograd.grad(og, (qg, kg, vg), dout)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qq, kk, vv))
        r = reference_varlen_attention(q64, k64, v64, cq, ck, scale=scale)
        rq, rk, rv = torch.autograd.grad(r, (q64, k64, v64), dout.double())
        print(
            "frontend bwd err dq/dk/dv",
            [round((a.double() - b).abs().max().item(), 4) for a, b in ((gq, rq), (gk, rk), (gv, rv))],
        )
    except Exception:
        traceback.print_exc()
    try:
        for name, cu, m in (("layout A", cua, ma), ("layout B", cub, mb)):
            t0 = timed(lambda cu=cu, m=m: fe(q, k, v, cu, cu, m, m))
            t1 = timed(lambda cu=cu, m=m: fe(q, k, v, cu, cu, m, m), 5)
            print(
                f"frontend fwd 32K {name} ({cu.numel() - 1} docs, max {m}): cold {t0:.1f} ms, warm {t1:.2f} ms; cache {len(op._graph_cache)}"
            )
        # bucketed shapes: same (B, max) for both layouts
        nb = 64
        for name, cu in (("A", cua), ("B", cub)):
            pcu = torch.cat([cu, cu[-1:].repeat(nb + 1 - cu.numel())])
            t0 = timed(lambda pcu=pcu: fe(q, k, v, pcu, pcu, 8192, 8192))
            t1 = timed(lambda pcu=pcu: fe(q, k, v, pcu, pcu, 8192, 8192), 5)
            print(
                f"bucketed B={nb} max=8192 layout {name}: first {t0:.1f} ms, warm {t1:.2f} ms; cache {len(op._graph_cache)}"
            )
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)

        def fb():
            o, _ = fe(qg, kg, vg, cua, cua, ma, ma)
            torch.autograd.grad(o, (qg, kg, vg), dout)

        t0 = timed(fb)
        t1 = timed(fb, 5)
        area = sum(n * (n + 1) // 2 for n in la)
        tf = timed(lambda: fe(q, k, v, cua, cua, ma, ma), 10)
        fl = 4 * area * HQ * D
        print(
            f"frontend fwd+bwd 32K: cold {t0:.1f} ms, warm {t1:.2f} ms; fwd {tf:.2f} ms = {fl / tf / 1e9:.0f} TFLOP/s, bwd ~{2.5 * fl / (t1 - tf) / 1e9:.0f} TFLOP/s"
        )
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
