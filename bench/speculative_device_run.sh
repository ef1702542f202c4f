#!/usr/bin/env bash
# One device call for bench/speculative.py (repo root on the GPU machine; carry .whl .jit .dg_src):
#   LIMIT_S=540 bash bench/speculative_device_run.sh [--models gpt-oss-20b,gpt-oss-120b]
set -u
LIMIT_S=${LIMIT_S:-540}
MODELS=gpt-oss-20b
[ "${1:-}" = "--models" ] && MODELS=$2
export DG_USE=${DG_USE:-1}
source scripts/device_env.sh
step gpu_tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_speculative.py \
    "tests/engine/test_e2e_gpu.py::test_speculative_decoding_computes_what_a_recompute_does"
tail -3 "$OUT/gpu_tests.log"
for m in ${MODELS//,/ }; do
    kv=auto
    [ "$m" = gpt-oss-120b ] && kv=fp8_e4m3  # (120b's experts leave little room for bf16 K/V)
    step "bench_${m#gpt-oss-}" $(( LIMIT_S - 60 )) python3 -m bench.speculative --device cuda --model "$m" \
        --kv-cache-dtype "$kv" --out "$OUT/speculative_h200_${m#gpt-oss-}.json"
    tail -17 "$OUT/bench_${m#gpt-oss-}.log"
done
pack_logs
