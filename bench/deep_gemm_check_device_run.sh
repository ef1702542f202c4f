#!/usr/bin/env bash
# One device call on a bare H200 that brings DeepGEMM back and checks it (repo root on the GPU machine; carry
# .whl .jit .dg_src): DeepGEMM built from .dg_src/deepgemm_src.tgz unless .dg_src/dg_site.tgz is carried, its
# smoke test, one eager 120b 8k prefill profiled with FP8 QKV / O (every kernel), then the MoE and engine GPU tests
# while time is left. $OUT gets dg_site.tgz (for the next call's .dg_src/), the profile, the logs, the JIT caches.
#   DG_USE=1 DG_BUILD=1 LIMIT_S=560 [PROFILE="gpt-oss-20b 4096"] bash bench/deep_gemm_check_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
if [ -n "$DG_PID" ]; then wait "$DG_PID"; tail -1 "$LOGS/dg_build_stdout.log"; fi
step dg_smoke 150 python3 -X faulthandler -m scripts.deep_gemm_smoke
tail -3 "$OUT/dg_smoke.log"
# PROFILE="gpt-oss-20b 4096" on an H100 (120b's FP8 experts need the H200's memory)
read -r PMODEL PTOKENS <<< "${PROFILE:-gpt-oss-120b 8192}"
step profile 240 python3 -m bench.prefill_host_profile --model "$PMODEL" --tokens "$PTOKENS" \
    --dense-dtype fp8_e4m3 --out "$OUT/prefill_profile_${PMODEL#gpt-oss-}_${PTOKENS}_fp8_dense.json"
grep -A32 "tokens: wall" "$OUT/profile.log" | head -34
step gpu_tests 400 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/kernels/test_moe_gpu.py \
    tests/kernels/test_deep_gemm_ops.py tests/engine/test_e2e_gpu.py tests/engine/test_engine_gpu.py
tail -12 "$OUT/gpu_tests.log"
pack_jit_cache
pack_logs
