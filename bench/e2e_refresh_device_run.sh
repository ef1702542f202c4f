#!/usr/bin/env bash
# One device call that refreshes issue 9's tables for one model on the tree as it is (repo root on the GPU machine;
# carry .whl .jit .dg_src). On a bare machine it first builds what the carried folders lack, in parallel
# (FI_BUILD=1: FlashInfer's sink-prefill modules; DG_BUILD=1: DeepGEMM from .dg_src/deepgemm_src.tgz), and waits
# for both before timing, so no build or JIT compile lands inside a timed run. Then bench.e2e with the model's
# defaults (the exact-numerics configuration) and whatever else is passed.
#   DG_USE=1 DG_BUILD=1 FI_BUILD=1 MODEL=gpt-oss-20b LIMIT_S=570 bash bench/e2e_refresh_device_run.sh \
#       --prefill-lens 1024,2048,4096,8192,16384,32768 --contexts 8192,32768 --max-batch 512 --engine-runs b1,1k/1k
# $OUT gets e2e_h200_<tag>_refresh.{json,log} and its two plots, the built FlashInfer modules / DeepGEMM package (for
# the next call's .jit/ and .dg_src/) and the JIT caches: 8 files at most come back from a call.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
MODEL=${MODEL:-gpt-oss-20b}
TAG=${MODEL#gpt-oss-}
wait_builds
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
echo "set-up done after $(( $(date +%s) - DEVICE_START )) s"
LOG=$OUT/e2e_h200_${TAG}_refresh.log
l=$(left)
timeout "$l" python3 -m bench.e2e --device cuda --models "$MODEL" --model-share 1.0 --headroom-gb 4 \
    --budget-s $(( l - 30 )) --out "$OUT/e2e_h200_${TAG}_refresh.json" "$@" > "$LOG" 2>&1
echo "bench exit $? after $(( $(date +%s) - DEVICE_START )) s"
pack_jit_cache
grep -E "^\[|Error|error" "$LOG" | tail -40
