#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit .dg_src) for the MXFP4 decode GEMM's fused
# epilogues (SwiGLU in gate_up, combine in down; kernels/moe/NOTES.md), 2026-12-02:
#  1. with PROBE=1, in the background, the FP8 sink prefill probe (its FlashInfer JIT build, then accuracy and timing at 8k;
#     waited for before anything is timed here);
#  2. the GPU tests of the MXFP4 GEMM, its epilogues and the layer;
#  3. python -m bench.decode_ab on 20b, the fused epilogues against the separate launches (VARIANTS,
#     DECODE_ARGS), same process; the step table printed last.
#   LIMIT_S=590 bash bench/mxfp4_epilogues_device_run.sh
set -u
export LIMIT_S=${LIMIT_S:-590} DEVICE_START=$(date +%s)
source scripts/device_env.sh
PROBE_PID=""
if [ "${PROBE:-0}" = 1 ]; then
    ( timeout 300 python3 -m bench.fp8_sink_prefill_probe --out "$OUT/fp8_sink_prefill_probe_h200.json" \
        > "$OUT/fp8_probe.log" 2>&1; echo "probe exit $?" >> "$OUT/fp8_probe.log" ) &
    PROBE_PID=$!
fi
step tests "${TESTS_S:-200}" python3 -m pytest -q -ra -s -p no:cacheprovider tests/kernels/test_mxfp4_epilogues.py \
    tests/kernels/test_mxfp4_cuda.py tests/kernels/test_mxfp4_decode_layer.py
tail -3 "$OUT/tests.log"
if [ -n "$PROBE_PID" ]; then wait $PROBE_PID; tail -25 "$OUT/fp8_probe.log"; fi
step decode_ab 400 python3 -m bench.decode_ab --models gpt-oss-20b \
    --variants "${VARIANTS:-fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-swiglu,fp8-dense+mxfp4-8-unfused}" \
    --out "$OUT/decode_ab_mxfp4_epilogues_h200.json" ${DECODE_ARGS:---batches 1,2,4,8 --max-batch 8 --rounds 3}
pack_logs
grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A8 "decode step (ms)" | head -30
