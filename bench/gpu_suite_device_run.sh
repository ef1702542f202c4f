#!/usr/bin/env bash
# One device call: the GPU tests of the model, kernels and engine (`pytest -m gpu`) on the tree as it is, with DeepGEMM
# (repo root on the GPU machine; carry .whl .jit .dg_src). The device lacks Ray, pydantic, openai and Harmony, so the
# modules importing them (tests/serve_app, and in tests/engine the Ray and Serve-config ones, none with GPU tests) fail
# to collect: listed as collection errors, the rest runs. $OUT gets gpu_suite.log (pytest -ra), the set-up logs and
# the JIT caches.
#   DG_USE=1 LIMIT_S=560 bash bench/gpu_suite_device_run.sh [extra pytest args]
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
if [ -n "$DG_PID" ]; then wait "$DG_PID"; tail -1 "$LOGS/dg_build_stdout.log"; fi
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
step gpu_suite 540 python3 -m pytest -q -ra -p no:cacheprovider --continue-on-collection-errors -m gpu \
    tests/kernels tests/engine tests/model "$@"
grep -E "passed|failed|error" "$OUT/gpu_suite.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu_suite.log" | head -30
pack_jit_cache
pack_logs
