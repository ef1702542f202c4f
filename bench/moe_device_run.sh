#!/usr/bin/env bash
# One device call for the FP8 MoE work (run from the repo root on the GPU machine, $OUT set).
# Carry .moe_jit (ignored via .git/info/exclude), holding wheels/ (sgl-deep-gemm candidates and
# apache-tvm-ffi 0.1.11) and optionally jit_cache.tgz (a previous run's $OUT/jit_cache.tgz).
#  1. probe each sgl-deep-gemm candidate in parallel (bench/moe.py --probe) and keep the first that
#     computes correct GEMMs. On 2026-11-29 none did on torch 2.11 (0.1.7 / 0.2.0 / 0.2.1.post1 fail
#     every call, 0.2.3.post2 does not load): the run then measures the Triton backend only;
#  2. GPU tests beside warm-up shards of the benchmark (JIT compiles in parallel);
#  3. the benchmark; JIT caches back as $OUT/jit_cache.tgz.
#   bash bench/moe_device_run.sh [tests|bench|all]
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/moe_out}
W=.moe_jit/wheels
mkdir -p "$OUT" .moe_jit/deep_gemm .moe_jit/triton
export PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=$PWD/.moe_jit/deep_gemm TRITON_CACHE_DIR=$PWD/.moe_jit/triton
[ -f .moe_jit/jit_cache.tgz ] && tar xzf .moe_jit/jit_cache.tgz -C .moe_jit
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/setup.log" 2>&1
start=$(date +%s)
CANDIDATES="0.2.0 0.2.3.post2 0.2.1.post1 0.1.7"
for v in $CANDIDATES; do
    ( site=/tmp/site_$v
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
          $W/sgl_deep_gemm-$v-*.whl $W/apache_tvm_ffi-0.1.11-*.whl > /tmp/probe_$v.log 2>&1
      PYTHONPATH=$site:$PWD timeout 120 python3 -m bench.moe --probe >> /tmp/probe_$v.log 2>&1
      echo $? > /tmp/probe_$v.rc ) &
done
wait
SITE=/tmp/site_none
for v in $CANDIDATES; do
    if [ "$SITE" = /tmp/site_none ] && [ "$(cat /tmp/probe_$v.rc)" = 0 ]; then SITE=/tmp/site_$v; fi
done
for v in $CANDIDATES; do echo "--- sgl-deep-gemm $v: exit $(cat /tmp/probe_$v.rc)"; grep -E "probe|Error" /tmp/probe_$v.log | tail -3; done >> "$OUT/setup.log"
echo "using $SITE after $(( $(date +%s) - start )) s" | tee -a "$OUT/setup.log"
mkdir -p $SITE; export PYTHONPATH=$SITE:$PWD
if [ "$MODE" != bench ]; then
    ( timeout 240 python3 -m pytest -q -ra -n 4 -p no:cacheprovider tests/kernels/test_moe_gpu.py > "$OUT/gpu_tests.log" 2>&1
      echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log" ) &
fi
if [ "$MODE" != tests ]; then
    for i in $(seq 0 9); do
        timeout 200 python3 -m bench.moe --warmup-shard "$i/10" >> "$OUT/warmup.log" 2>&1 &
    done
fi
wait
echo "compile/tests phase done at $(( $(date +%s) - start )) s" | tee -a "$OUT/setup.log"
if [ "$MODE" != tests ]; then
    timeout 300 python3 -m bench.moe --out "$OUT/moe_h200.json" --load-bench /tmp/moe_load > "$OUT/bench.log" 2>&1
    echo "bench exit $? after $(( $(date +%s) - start )) s" >> "$OUT/bench.log"
fi
tar czf "$OUT/jit_cache.tgz" -C .moe_jit deep_gemm triton 2>/dev/null
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
grep -v "^ *$" "$OUT/bench.log" 2>/dev/null | grep -v "^dense" | tail -45
