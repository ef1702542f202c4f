#!/usr/bin/env bash
# One device call for the decode-step fusions (repo root on the GPU machine; carry .whl .jit .dg_src; DG_USE=1):
#  1. the GPU tests of the decode MoE chain (TESTS, default: PDL, the fused front, routed_forward;
#     TESTS= runs all of TEST_FILES, default tests/kernels/test_moe_gpu.py, within TESTS_S seconds);
#  2. python -m bench.decode_ab over MODELS (default both) with VARIANTS (default: fused+pdl, the engine's
#     decode today, against fp8-lm-head), step times at batch 1/4/16 and context 8k, table printed last.
#   DG_USE=1 bash bench/decode_device_run.sh              LIMIT_S (default 560) bounds the whole script;
#   DECODE_ARGS: more bench.decode_ab arguments (e.g. "--rounds 3 --batches 1,4,16,64 --max-batch 64")
set -u
LIMIT_S=${LIMIT_S:-560}
start=$(date +%s)
source scripts/device_env.sh
timeout "${TESTS_S:-150}" python3 -m pytest -q -ra -s -p no:cacheprovider ${TEST_FILES:-tests/kernels/test_moe_gpu.py} \
    -k "${TESTS-pdl or fused_front or routed_forward}" > "$OUT/tests.log" 2>&1
echo "tests exit $? after $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests.log")"
left=$(( LIMIT_S - ($(date +%s) - start) - 15 ))
timeout "$left" python3 -m bench.decode_ab --models "${MODELS:-gpt-oss-20b,gpt-oss-120b}" \
    --variants "${VARIANTS:-fused+pdl,fp8-lm-head}" --out "$OUT/decode_ab_h200.json" ${DECODE_ARGS:-} > "$OUT/decode_ab.log" 2>&1
echo "decode_ab exit $? after $(( $(date +%s) - start )) s"
pack_jit_cache; pack_logs
grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A8 "decode step (ms)" | head -40
