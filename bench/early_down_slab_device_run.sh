#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit .dg_src), branch early-routing with the winners of
# decode_ab_early_routing_h200 as pdl's defaults (the down GEMM's plan and the slab GEMV's scales / bias before the
# wait; the epilogues' and split attention's plans after it):
#  1. bench.decode_ab, both models, b = 1 and 4: all late (main's kernels) / down + slab early / all early, ROUNDS rounds;
#  2. the engine at batch 1 on both models (bench/engine_overhead_device_run.sh's e2e step, DeepGEMM prefill).
#   bash bench/early_down_slab_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step decode_ab 200 python3 -m bench.decode_ab --models "${MODELS:-gpt-oss-120b,gpt-oss-20b}" \
    --variants fp8-dense-all-late,fp8-dense-down-slab,fp8-dense \
    --rounds "${ROUNDS:-3}" --batches 1,4 --max-batch 4 --out "$OUT/decode_ab_early_down_slab_h200.json"
grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A5 "decode step (ms)" | head -14
pack_logs
DG_USE=1 MODELS="gpt-oss-120b gpt-oss-20b" PREFILL_LENS=1024,8192 NO_TESTS=1 PROFILE=0 DEVICE_START=$DEVICE_START \
    bash bench/engine_overhead_device_run.sh
