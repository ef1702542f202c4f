#!/usr/bin/env bash
# One device call for the prefill kernels (repo root on the GPU machine; carry .whl .jit .dg_src; DG_USE=1):
#  1. GPU tests: attention (sliding-window prefill kernel, backends), the MoE epilogues, then TESTS
#     (default: the engine's prefix-caching GPU tests; TESTS= skips);
#  2. bench.attention --prefill-only (FlashInfer vs the Triton sliding kernel at several launch shapes),
#     bench.swiglu_ab, bench.prefill_ab --variants sliding on 20b (LENS_20B, default 1k,4k) and 120b
#     (LENS_120B, default 8k), ROUNDS rounds, then bench.prefix_cache on 20b (PREFIX=0 skips); each under
#     its own time guard, logs in $OUT.
#   DG_USE=1 bash bench/prefill_device_run.sh          LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh  # step NAME SECONDS CMD..., bounded by LIMIT_S (default 560)
step tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_attention_gpu.py \
    "tests/kernels/test_moe_gpu.py::test_dispatch_swiglu_combine_match_twins" \
    "tests/kernels/test_moe_gpu.py::test_swiglu_by_row_tiles_changes_nothing"
tail -3 "$OUT/tests.log"
step attention 90 python3 -m bench.attention --prefill-only --out "$OUT/attention_prefill_h200.json"
step swiglu 40 python3 -m bench.swiglu_ab --out "$OUT/swiglu_ab_h200.json"
step prefill_20b 120 python3 -m bench.prefill_ab --model gpt-oss-20b --lens "${LENS_20B:-1024,4096}" --variants sliding \
    --rounds "${ROUNDS:-5}" --out "$OUT/prefill_ab_sliding_20b_h200.json"
step prefill_120b 180 python3 -m bench.prefill_ab --model gpt-oss-120b --lens "${LENS_120B:-8192}" --variants sliding \
    --rounds "${ROUNDS:-5}" --out "$OUT/prefill_ab_sliding_120b_h200.json"
TESTS=${TESTS-tests/engine/test_e2e_gpu.py -k prefix}
[ -n "$TESTS" ] && step tests_more 150 python3 -m pytest -q -ra -p no:cacheprovider $TESTS && tail -3 "$OUT/tests_more.log"
[ "${PREFIX:-1}" = 1 ] && step prefix 60 python3 -m bench.prefix_cache --model gpt-oss-20b --out "$OUT/prefix_cache_h200.json"
pack_jit_cache; pack_logs
echo "---- summary"
grep -E "^prefill (triton|fa3|fa2)" "$OUT/attention.log" | grep -E "window=128|window=None" | tail -24
cat "$OUT/swiglu.log" | tail -4
tail -n 3 "$OUT/prefill_20b.log" "$OUT/prefill_120b.log"
tail -6 "$OUT/prefix.log" 2>/dev/null
