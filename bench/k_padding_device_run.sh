#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit .dg_src), branch k-padding: the FP8 decode kernels
# (MoE decode GEMM, slab and FP8 GEMVs) skip the weights' zero K padding (2880 of 2944 columns). (Its 2026-12-03 run
# also had the MoE decode GEMM on 32-row weight tiles, variants removed since: bench/results/decode_ab_k_padding_h200.)
#  1. GPU tests: the MoE decode chain and the FP8 dense decode projections;
#  2. bench.decode_ab, both models: padding skipped (the default) / read (before), b = 1, 2, 4, ROUNDS rounds
#     (default 3);
#  3. bench.moe: the MoE layer at T = 1, 2 (issue 7's rate).
#   DG_USE=1 bash bench/k_padding_device_run.sh          LIMIT_S (default 580)
set -u
DEVICE_START=$(date +%s)
LIMIT_S=${LIMIT_S:-580}
source scripts/device_env.sh
if [ "${NO_TESTS:-0}" != 1 ]; then
    step tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py tests/kernels/test_layers_gpu.py \
        -k "decode or pdl or front or routed or gemv or slab or fp8"
    tail -3 "$OUT/tests.log"
fi
step decode_ab 320 python3 -m bench.decode_ab --models "${MODELS:-gpt-oss-120b,gpt-oss-20b}" \
    --variants fp8-dense,fp8-dense-read-k-padding \
    --rounds "${ROUNDS:-3}" --batches 1,2,4 --max-batch 4 --out "$OUT/decode_ab_k_padding_h200.json"
step moe 100 python3 -m bench.moe --tokens 1,2 --skip gemm,dense,decode --out "$OUT/moe_t1_t2_k_padding_h200.json"
pack_logs
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A6 "decode step (ms)" | head -20
grep -E "^ *(20b|120b) T=" "$OUT/moe.log" | head -16
