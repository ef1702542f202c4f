#!/usr/bin/env bash
# One device call for the FP8 MoE work (run from the repo root on the GPU machine, $OUT set):
# install DeepGEMM from the carried wheels, compile every kernel in parallel (GPU tests beside
# warm-up shards of the benchmark), then time. JIT caches go back as $OUT/jit_cache.tgz; put that
# file at .jit/moe/jit_cache.tgz and carry .jit/moe to skip the compiles next time.
#   bash bench/moe_device_run.sh [tests|bench|all]
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
# sgl-deep-gemm 0.2.0's _C.so is built against apache-tvm-ffi 0.1.11 (its pin): with 0.1.15 it
# imports, but every call fails in DeepGEMM's first shape check (seen 2026-11-29), so 0.1.11 it is.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .jit/moe/wheels/apache_tvm_ffi-0.1.11-*.whl .whl/sgl_deep_gemm-*.whl > "$OUT/setup.log" 2>&1
python3 -c "import deep_gemm, tvm_ffi; print('deep_gemm', deep_gemm.__version__, 'tvm_ffi', tvm_ffi.__version__)" >> "$OUT/setup.log" 2>&1
export DG_JIT_CACHE_DIR=$PWD/.jit/moe/deep_gemm TRITON_CACHE_DIR=$PWD/.jit/moe/triton
mkdir -p "$DG_JIT_CACHE_DIR" "$TRITON_CACHE_DIR"
[ -f .jit/moe/jit_cache.tgz ] && tar xzf .jit/moe/jit_cache.tgz -C .jit/moe
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; nproc; free -g | head -2;
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } >> "$OUT/setup.log" 2>&1
start=$(date +%s)
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
echo "compile/tests phase: $(( $(date +%s) - start )) s" | tee -a "$OUT/setup.log"
if [ "$MODE" != tests ]; then
    timeout 240 python3 -m bench.moe --out "$OUT/moe_h200.json" --load-bench /tmp/moe_load > "$OUT/bench.log" 2>&1
    echo "bench exit $? after $(( $(date +%s) - start )) s" >> "$OUT/bench.log"
fi
tar czf "$OUT/jit_cache.tgz" -C .jit/moe deep_gemm triton 2>/dev/null
ls -la "$OUT" >> "$OUT/setup.log"
tail -5 "$OUT/gpu_tests.log" 2>/dev/null
grep -v "^ *$" "$OUT/bench.log" 2>/dev/null | tail -60
