#!/usr/bin/env bash
# One device call for the weight-streaming segments GEMM (repo root on the GPU machine; carry .whl .jit .dg_src):
# its GPU tests, the layer against DeepGEMM per launch config (bench/moe_segments.py), then the eager prefill
# forward with it off / on (bench/prefill_ab.py --variants segments; 120b on an H200, 20b on an H100).
#   DG_USE=1 LIMIT_S=570 bash bench/segments_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
step tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_segments_gpu.py
tail -4 "$OUT/tests.log"
step bench 240 python3 -m bench.moe_segments --out "$OUT/moe_segments.json"
sed -n '/^model   T/,$p' "$OUT/bench.log"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then M=gpt-oss-120b; else M=gpt-oss-20b; fi
step prefill 200 python3 -m bench.prefill_ab --model "$M" --lens 512,1024,2048 --variants segments --rounds 3 \
    --dense-dtype fp8_e4m3 --out "$OUT/prefill_ab_segments_${M#gpt-oss-}.json"
grep -E "^tokens=" "$OUT/prefill.log"
pack_jit_cache
pack_logs
