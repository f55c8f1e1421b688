#!/usr/bin/env bash
# One lent-GPU session's steps, run from the repository root on the GPU machine (no internet there).
#
#   bash benchmarks/device.sh stash                 # keep .whl-a/ (part one of the CuTe DSL libs wheel) in /tmp
#   bash benchmarks/device.sh stash-c               # keep .whl-c/'s wheels (cuda-bindings, the CuTe DSL's core
#                                                   # Python package, protobuf) in /tmp/parts too
#   bash benchmarks/device.sh stash-hf              # keep .whl-hf/ (transformers and its deps) in /tmp/hfw
#   bash benchmarks/device.sh stash-tl              # unpack .whl-tl/ (TileLang's site, 52 MB, and the example
#                                                   # files of tile-ai/tilelang examples/deepseek_v32 in
#                                                   # .whl-tl/examples/) into /tmp/tlsite and /tmp/tl_examples
#                                                   # (TileLang pins apache-tvm-ffi < 0.1.13, the extras of
#                                                   # `install` carry 0.1.15: time TileLang in a call without them)
#   bash benchmarks/device.sh install               # install .whl-b/, /tmp/parts' wheels and the joined libs wheel
#                                                   # into /tmp/site with one pip --target (two pip calls into one
#                                                   # target drop a shared top-level folder such as cuda/), and
#                                                   # /tmp/hfw's wheels into /tmp/hfsite when stashed
#   bash benchmarks/device.sh pytest ARGS...        # pytest with the installed extras, log under $OUT
#   bash benchmarks/device.sh python ARGS...        # python with the installed extras
#
# .whl-a/, .whl-b/ and .whl-c/ are ignored folders filled here with `pip download --no-deps --python-version 3.12
# --only-binary=:all: --platform manylinux_2_28_x86_64 ...` of nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1
# nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
# apache-tvm-ffi==0.1.15 cuda-python==13.0.3 cuda-bindings==13.0.3 cuda-pathfinder protobuf: the libs-cu13 wheel is
# split in two (`split -b 60000000`, part one in .whl-a/, part two in .whl-b/ with the small wheels) and cuda-bindings,
# libs-core and protobuf go in .whl-c/, because one call carries 64 MiB with the working tree. libs-core holds
# `cutlass.cute`: without it the frontend's DSA kernels fail to import (and longtrain reports the route unavailable).
# Each step after `stash` must follow the previous one at once: a machine idle for 30 s is given back.
set -euo pipefail
SITE=/tmp/site
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
export PYTHONUNBUFFERED=1
env_setup() {
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD/src:$PWD"
  if [ -d /tmp/hfsite ]; then export PYTHONPATH="$PYTHONPATH:/tmp/hfsite"; fi
  if [ -d /tmp/tlsite/tlsite ]; then export PYTHONPATH="$PYTHONPATH:/tmp/tlsite/tlsite"; fi
  if [ -d /tmp/tl_examples ]; then export LONGTRAIN_TILELANG_EXAMPLES=/tmp/tl_examples; fi
  export LONGTRAIN_COMMIT="${LONGTRAIN_COMMIT:-unknown}"
}
case "${1:-}" in
  stash)
    mkdir -p /tmp/parts && cp .whl-a/cu13part_aa /tmp/parts/ && ls -la /tmp/parts ;;
  stash-c)
    mkdir -p /tmp/parts && cp .whl-c/*.whl /tmp/parts/ && ls /tmp/parts ;;
  stash-hf)
    mkdir -p /tmp/hfw && cp .whl-hf/*.whl /tmp/hfw/ && ls /tmp/hfw | wc -l ;;
  stash-tl)
    mkdir -p /tmp/tlsite && tar xJf .whl-tl/tilelang_site.tar.xz -C /tmp/tlsite
    if [ -d .whl-tl/examples ]; then rm -rf /tmp/tl_examples && cp -r .whl-tl/examples /tmp/tl_examples; fi
    ls /tmp/tlsite/tlsite | head -3; ls /tmp/tl_examples 2>/dev/null | wc -l ;;
  install)
    if [ ! -f /tmp/parts/cu13part_aa ]; then echo "part one of the CuTe DSL wheel is gone (machine restarted)"; exit 3; fi
    cat /tmp/parts/cu13part_aa .whl-b/cu13part_ab > "/tmp/$CU13"
    extra=()
    for w in /tmp/parts/*.whl; do if [ -f "$w" ]; then extra+=("$w"); fi; done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl-b/*.whl "${extra[@]}" "/tmp/$CU13"
    if [ -d /tmp/hfw ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hfsite /tmp/hfw/*.whl
    fi
    env_setup
    python3 -c "import cudnn, cudnn.flex_attention, cutlass.cute; cudnn.DSA.sparse_attention_backward_wrapper; \
print('cudnn', cudnn.backend_version(), 'ok')"
    python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash_attn.cute ok" || echo "flash_attn.cute not installed" ;;
  pytest)
    shift; env_setup
    python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee -a "${OUT:-/tmp}/pytest.log" ;;
  python)
    shift; env_setup
    python3 "$@" ;;
  *)
    echo "usage: $0 stash | stash-c | stash-hf | stash-tl | install | pytest ARGS | python ARGS"; exit 2 ;;
esac
