#!/usr/bin/env bash
# The H200 runs that benchmarks/README.md lists under "Not yet run on the H200", in one call of at most ~9 minutes,
# run from the repository root on the GPU machine after `bash benchmarks/device.sh stash` and `stash-hf` (the
# install is done here when /tmp/site lacks it). Each run has its own time limit; logs and reports go under
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
if [ ! -d /tmp/site/cudnn ]; then
  bash benchmarks/device.sh install > "$Q/install.log" 2>&1 || echo "install failed (see install.log): runs without the extras"
fi
run() {  # run NAME SECONDS CMD...: one bounded step, its log under $Q
  local name=$1 limit=$2
  shift 2
  timeout "$limit" bash benchmarks/device.sh python "$@" > "$Q/$name.log" 2>&1
  echo "$name: exit $? after $(since)"
}
run cp_imbalance 120 benchmarks/cp_imbalance.py --worlds 4 8 --tokens 32768 131072 --time-tokens 32768 \
  --chunks 128 256 512 --out-dir "$Q"
run dsa_overhead 45 benchmarks/dsa_overhead.py --out-dir "$Q"
run demo_profile 100 benchmarks/demo_profile.py --out "$Q/demo_plain_profile.txt" -- --preset h200-32k \
  --seq-len 4096 --steps 2 --attn-backend dense --dsa-backend torch --no-prewarm --no-parity --out /tmp/demo_prof
run demo_sweep 280 benchmarks/demo_runs.py --preset h200-32k --sweep 1024 2048 4096 8192 16384 32768 \
  --sweep-steps 3 --timeout 150 --budget 260 --name demo_sweep_h200_32k --out-dir "$Q" --run-dir /tmp/demo_runs
for d in /tmp/demo_runs/*/; do cp "$d/log.txt" "$Q/$(basename "$d")_log.txt" 2>/dev/null; done
tar czf "$OUT/queue.tgz" -C "$OUT" queue && rm -rf "$Q"
echo "done after $(since)"
