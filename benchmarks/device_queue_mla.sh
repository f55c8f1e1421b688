#!/usr/bin/env bash
# The sparse MLA runs on the H200 in one call of at most ~9 minutes, run from the repository root on the GPU
# machine, carrying .whl-tl (TileLang's site and example files, see device.sh stash-tl; without it TileLang's rows
# say why they are missing): GPU parity tests of the sparse MLA kernels, compute-sanitizer memcheck, and
# benchmarks/dsa.py at T = 16384 (H = 64 and 128, K = 2048, one document) with TileLang's kernels side by side.
# Logs and reports go under $OUT/queue, tarred into $OUT/queue.tgz at the end (one file comes back).
#
#   LONGTRAIN_COMMIT=$(git log -1 --format=%h) bash benchmarks/device_queue_mla.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
Q=$OUT/queue
mkdir -p "$Q"
start=$(date +%s)
since() { echo "$(( $(date +%s) - start )) s"; }
if [ -f .whl-tl/tilelang_site.tar.xz ]; then bash benchmarks/device.sh stash-tl > "$Q/stash_tl.log" 2>&1; fi
run() {  # run NAME SECONDS CMD...: one bounded step, its log under $Q
  local name=$1 limit=$2
  shift 2
  timeout "$limit" bash benchmarks/device.sh python "$@" > "$Q/$name.log" 2>&1
  echo "$name: exit $? after $(since)"
}
run gpu_mla_tests 200 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_triton_gpu.py -k "not indexer"
PYTHONPATH=$PWD/src timeout 120 compute-sanitizer --tool memcheck python3 benchmarks/dsa.py --memcheck \
  > "$Q/memcheck.log" 2>&1
echo "memcheck: exit $? after $(since)"
run dsa_mla 330 benchmarks/dsa.py --case 16384,64,2048,1doc --case 16384,128,2048,1doc --out-dir "$Q"
tar czf "$OUT/queue.tgz" -C "$OUT" queue && rm -rf "$Q"
echo "done after $(since)"
