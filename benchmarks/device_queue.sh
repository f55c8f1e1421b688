#!/usr/bin/env bash
# H200 runs in one call of at most ~9 minutes, run from the repository root on the GPU machine. Logs and reports go
# under $OUT/queue, tarred into $OUT/queue.tgz at the end (one file comes back).
#
#   LONGTRAIN_COMMIT=$(git log -1 --format=%h) bash benchmarks/device_queue.sh [indexer|mla|bars|det|overlap|partition|rsweep|fp16|ahead]
#
# indexer (default): GPU tests of the indexer, compute-sanitizer memcheck, the SM90 scoring kernel's sweep of
#   dsa_indexer_variants.py (INDEXER_SWEEP=defaults: the selection settings' sweep instead) and dsa.py's indexer
#   cases (with QUEUE_EXTRAS=1 after `bash benchmarks/device.sh stash`, the extras are installed first; none of these
#   runs needs them).
# mla: carrying .whl-tl (TileLang's site and example files, see device.sh stash-tl; without it TileLang's rows say
#   why they are missing): GPU parity tests of the sparse MLA kernels, memcheck, and dsa.py at T = 16384 (H = 64 and
#   128, K = 2048, one document) with TileLang's kernels side by side, then the MLA_EXTRA_CASES cases.
# bars: issue 17's bars at the defaults in one call of at most 9.5 minutes (each step cut short to keep within it): the deterministic GPU tests,
#   dsa_bwd_deterministic.py --fp16-pieces (the default backward and the deterministic mode at four shapes, with fp32,
#   bf16 and scaled fp16 pieces), dsa.py's four cases and
#   the backward's items per program (dsa_bwd_ws.py --runs, which set WS_BWD_RUN's default on an H100).
# det: the deterministic mode after a change (at most 9.5 minutes): its GPU tests, memcheck through
#   dsa_bwd_dq.py --memcheck (every store path, deterministic or not), dsa_bwd_deterministic.py and dsa_breakdown.py.
# overlap: the backward's experiments beside one stream (about 8 minutes): their GPU tests (the dq kernel on a second
#   stream, bf16 pieces), dsa_bwd_ws.py --dq-overlap at issue 17's four shapes (the deterministic mode at the first)
#   and memcheck through dsa_bwd_ws.py --memcheck.
# partition: the SM partition (sparse_mla_bwd.DQ_OVERLAP = "partition", about 6 minutes): the overlap GPU tests,
#   dsa_bwd_ws.py --partition at three of issue 17's shapes (the deterministic mode at the first), and memcheck
#   with PARTITION_MEMCHECK=1.
# rsweep: the deterministic reduction's slots at a time and warps per program with bf16 pieces and 2 GiB
#   (dsa_bwd_deterministic.py --reduce-sweep at issue 17's four shapes, about 2 minutes).
# fp16: the deterministic mode's scaled fp16 pieces (DET_PIECES = "fp16"): the deterministic GPU tests,
#   dsa_bwd_deterministic.py --fp16-pieces at issue 17's four shapes, dsa_breakdown.py --fp16-pieces at the first and
#   memcheck through dsa_bwd_deterministic.py --memcheck.
# ahead: the deterministic reduction's runs formed a chunk ahead (DET_RUNS_AHEAD) against in line, in one call of at
#   most 9.5 minutes: the deterministic GPU tests, dsa_bwd_deterministic.py --fp16-pieces --runs-in-line at two of issue
#   17's shapes, dsa_breakdown.py --fp16-pieces at the first and memcheck through dsa_bwd_deterministic.py --memcheck.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
Q=$OUT/queue
mkdir -p "$Q"
start=$(date +%s)
TOTAL=${QUEUE_TOTAL:-560}  # bars, ahead: the seconds the queue keeps within (a call's limit less the tar)
since() { echo "$(( $(date +%s) - start )) s"; }
left() {  # left TOTAL CAP: seconds a step may take, at most CAP, so that the queue ends within TOTAL seconds (at least 1)
  local rest=$(( $1 - ($(date +%s) - start) ))
  [ "$rest" -gt "$2" ] && rest=$2
  [ "$rest" -lt 1 ] && rest=1
  echo "$rest"
}
run() {  # run NAME SECONDS CMD...: one bounded step, its log under $Q
  local name=$1 limit=$2
  shift 2
  timeout "$limit" bash benchmarks/device.sh python "$@" > "$Q/$name.log" 2>&1
  echo "$name: exit $? after $(since)"
}
memcheck() {  # memcheck SECONDS [SCRIPT]: the script's --memcheck launches under compute-sanitizer
  PYTHONPATH=$PWD/src timeout "$1" compute-sanitizer --tool memcheck python3 "${2:-benchmarks/dsa.py}" --memcheck \
    > "$Q/memcheck.log" 2>&1
  echo "memcheck: exit $? after $(since)"
}
case "${1:-indexer}" in
  indexer)
    if [ "${QUEUE_EXTRAS:-0}" = 1 ] && [ ! -d /tmp/site/cudnn ]; then
      bash benchmarks/device.sh install > "$Q/install.log" 2>&1 || echo "install failed (see install.log)"
    fi
    run gpu_dsa_tests 150 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k "indexer or torch_route"
    memcheck 60
    run indexer_sweep 200 benchmarks/dsa_indexer_variants.py --${INDEXER_SWEEP:-sm90}-sweep --out-dir "$Q"
    run dsa_indexer 150 benchmarks/dsa.py --indexer-case 16384,1doc --indexer-case 16384,docs \
      --indexer-case 4096,1doc --indexer-case 65536,1doc --out-dir "$Q" ;;
  mla)
    if [ -f .whl-tl/tilelang_site.tar.xz ]; then bash benchmarks/device.sh stash-tl > "$Q/stash_tl.log" 2>&1; fi
    run gpu_mla_tests 200 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k "not indexer"
    memcheck 120
    # MLA_EXTRA_CASES: the --case arguments after the two at T = 16384; by default the deterministic rows' case and
    # the issue's small shape (T = 4096, H = 128, K = 512). About 5 minutes in all on the H200.
    # shellcheck disable=SC2086
    run dsa_mla 450 benchmarks/dsa.py --case 16384,64,2048,1doc --case 16384,128,2048,1doc \
      ${MLA_EXTRA_CASES---case 4096,64,2048,1doc --case 4096,128,512,1doc} --out-dir "$Q" ;;
  bars)
    # Each step's limit is what is left of $TOTAL s (a call's 600 s less the tar), so the reports always come back.
    run gpu_det_tests "$(left "$TOTAL" 90)" -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k deterministic
    run dsa_bwd_det "$(left "$TOTAL" 200)" benchmarks/dsa_bwd_deterministic.py --fp16-pieces --out-dir "$Q"
    run dsa_mla "$(left "$TOTAL" 300)" benchmarks/dsa.py --case 16384,64,2048,1doc --case 16384,128,2048,1doc \
      --case 4096,64,2048,1doc --case 4096,128,512,1doc --out-dir "$Q"
    run dsa_bwd_item_runs "$(left "$TOTAL" 150)" benchmarks/dsa_bwd_ws.py --runs 1,2,4,0 --rounds 2 --out-dir "$Q" ;;
  det)
    run gpu_det_tests 120 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k deterministic
    run dsa_bwd_det 150 benchmarks/dsa_bwd_deterministic.py --out-dir "$Q"
    memcheck 150 benchmarks/dsa_bwd_dq.py
    run dsa_breakdown 150 benchmarks/dsa_breakdown.py --out-dir "$Q" ;;
  overlap)
    run gpu_overlap_tests 110 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py \
      -k "dq_overlap or bf16_pieces"
    run dsa_bwd_dq_overlap 270 benchmarks/dsa_bwd_ws.py --dq-overlap --rounds 2 --det-shapes 1 \
      --shapes "16384,64,2048;4096,128,512;4096,64,2048;16384,128,2048" --out-dir "$Q"
    memcheck 80 benchmarks/dsa_bwd_ws.py ;;
  partition)
    run gpu_partition_tests 90 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k dq_overlap
    run dsa_bwd_partition 280 benchmarks/dsa_bwd_ws.py --partition --rounds 2 --det-shapes 1 \
      --shapes "16384,64,2048;4096,128,512;4096,64,2048" --out-dir "$Q"
    [ -n "${PARTITION_MEMCHECK:-}" ] && memcheck 80 benchmarks/dsa_bwd_ws.py ;;
  rsweep)
    run dsa_bwd_det_rsweep 300 benchmarks/dsa_bwd_deterministic.py --reduce-sweep --out-dir "$Q" ;;
  fp16)
    run gpu_pieces_tests 130 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k "deterministic"
    run dsa_bwd_det_fp16 300 benchmarks/dsa_bwd_deterministic.py --fp16-pieces --out-dir "$Q"
    run dsa_breakdown_fp16 100 benchmarks/dsa_breakdown.py --fp16-pieces --case 16384,64,2048 --out-dir "$Q"
    memcheck 100 benchmarks/dsa_bwd_deterministic.py ;;
  ahead)
    run gpu_det_tests "$(left "$TOTAL" 130)" -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k deterministic
    run dsa_bwd_det_ahead "$(left "$TOTAL" 230)" benchmarks/dsa_bwd_deterministic.py --fp16-pieces --runs-in-line \
      --case 16384,64,2048 --case 4096,128,512 --out-dir "$Q"
    run dsa_breakdown_fp16 "$(left "$TOTAL" 100)" benchmarks/dsa_breakdown.py --fp16-pieces --case 16384,64,2048 --out-dir "$Q"
    memcheck "$(left "$TOTAL" 90)" benchmarks/dsa_bwd_deterministic.py ;;
  *)
    echo "usage: $0 [indexer|mla|bars|det|overlap|partition|rsweep|fp16|ahead]"; exit 2 ;;
esac
tar czf "$OUT/queue.tgz" -C "$OUT" queue && rm -rf "$Q"
echo "done after $(since)"
