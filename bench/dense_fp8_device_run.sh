#!/usr/bin/env bash
# One device call for the FP8 dense layers (EngineConfig.dense_dtype="fp8_e4m3"; repo root on the GPU machine;
# carry .whl .jit .dg_src; DG_USE=1):
#  1. GPU tests: tests/kernels/test_layers_gpu.py (the norm's FP8 rows, the rotary's bias, Fp8Linear with FP8
#     activations on DeepGEMM and on the Triton GEMM) and the engine's graphs-vs-eager test with FP8 QKV / O;
#  2. python -m bench.prefill_ab --variants VARIANTS (default fp8-dense; plan-order and defer-plan also compare
#     bf16 with FP8 QKV / O) on 20b (LENS_20B, default 1k,4k,8k) and 120b (LENS_120B,
#     default 8k), ROUNDS rounds (default 3), prefill graphs per variant; each step under its own time guard.
#   DG_USE=1 bash bench/dense_fp8_device_run.sh        LIMIT_S (default 560) bounds the whole script;
#   TESTS_K selects the tests (pytest -k), TEST_FILES the files
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
step tests "${TESTS_S:-200}" python3 -m pytest -q -ra -p no:cacheprovider \
    ${TEST_FILES:-tests/kernels/test_layers_gpu.py tests/engine/test_e2e_gpu.py} -k "${TESTS_K:-not test_engine_with_cuda_graphs or dense}"
tail -3 "$OUT/tests.log"
step ab_20b "${AB20_S:-170}" python3 -m bench.prefill_ab --model gpt-oss-20b --lens "${LENS_20B:-1024,4096,8192}" \
    --variants "${VARIANTS:-fp8-dense}" --rounds "${ROUNDS:-3}" --out "$OUT/prefill_ab_${VARIANTS:-fp8-dense}_20b_h200.json"
[ "${RUN_120B:-1}" = 1 ] && step ab_120b "${AB120_S:-170}" python3 -m bench.prefill_ab --model gpt-oss-120b \
    --lens "${LENS_120B:-8192}" --variants "${VARIANTS:-fp8-dense}" --rounds "${ROUNDS:-3}" \
    --out "$OUT/prefill_ab_${VARIANTS:-fp8-dense}_120b_h200.json"
pack_jit_cache; pack_logs
echo "---- summary"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
for f in ab_20b ab_120b; do [ -f "$OUT/$f.log" ] && grep -E "^tokens=|captured|Error" "$OUT/$f.log" | tail -6; done
