#!/usr/bin/env bash
# The H200 runs that benchmarks/README.md lists under "Not yet run on the H200", in one call of at most ~9 minutes,
# run from the repository root on the GPU machine (with QUEUE_EXTRAS=1 after `bash benchmarks/device.sh stash`, the
# extras are installed first). Each run has its own time limit; logs and reports go under
# $OUT/queue, tarred into $OUT/queue.tgz at the end (one file comes back).
#
#   LONGTRAIN_COMMIT=$(git log -1 --format=%h) bash benchmarks/device_queue.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
Q=$OUT/queue
mkdir -p "$Q"
start=$(date +%s)
since() { echo "$(( $(date +%s) - start )) s"; }
if [ "${QUEUE_EXTRAS:-0}" = 1 ] && [ ! -d /tmp/site/cudnn ]; then  # none of the runs below needs the extras
  bash benchmarks/device.sh install > "$Q/install.log" 2>&1 || echo "install failed (see install.log): runs without the extras"
fi
run() {  # run NAME SECONDS CMD...: one bounded step, its log under $Q
  local name=$1 limit=$2
  shift 2
  timeout "$limit" bash benchmarks/device.sh python "$@" > "$Q/$name.log" 2>&1
  echo "$name: exit $? after $(since)"
}
run gpu_dsa_tests 150 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k "indexer or torch_route"
PYTHONPATH=$PWD/src timeout 60 compute-sanitizer --tool memcheck python3 benchmarks/dsa.py --memcheck > "$Q/memcheck.log" 2>&1
echo "memcheck: exit $? after $(since)"
run indexer_sweep 200 benchmarks/dsa_indexer_variants.py --defaults-sweep --out-dir "$Q"
run dsa_indexer 150 benchmarks/dsa.py --indexer-case 16384,1doc --indexer-case 16384,docs --indexer-case 4096,1doc \
  --indexer-case 65536,1doc --out-dir "$Q"
tar czf "$OUT/queue.tgz" -C "$OUT" queue && rm -rf "$Q"
echo "done after $(since)"
