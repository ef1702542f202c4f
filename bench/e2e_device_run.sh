#!/usr/bin/env bash
# One device call for the end-to-end benchmark (repo root on the GPU machine; carry .whl .jit .dg_src):
#  1. scripts/device_env.sh (wheels, prebuilt FlashInfer modules, deep_gemm, JIT caches);
#  2. the GPU tests named in TEST_ARGS (default: the engine's e2e GPU tests);
#  3. python -m bench.e2e under a time guard (partial JSON survives a timeout), table printed last;
#     the JIT caches go back as $OUT/jit_cache_{triton,deep_gemm}.txz (scripts/device_env.sh).
#   bash bench/e2e_device_run.sh [bench.e2e args]       LIMIT_S (default 520) bounds the whole script
set -u
LIMIT_S=${LIMIT_S:-520}
start=$(date +%s)
source scripts/device_env.sh
if [ "${TEST_ARGS-x}" != "" ]; then
    timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -ra -p no:cacheprovider ${TEST_ARGS:-tests/engine/test_e2e_gpu.py} \
        > "$LOGS/tests.log" 2>&1
    echo "tests exit $? after $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/tests.log")"
fi
left=$(( LIMIT_S - ($(date +%s) - start) - 25 ))
timeout "$left" python3 -m bench.e2e --device cuda --out "$OUT/e2e_h200.json" --budget-s $(( left - 20 )) "$@" \
    > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
pack_jit_cache; pack_logs
grep -E "^\[|Error|error" "$OUT/bench.log" | tail -12
python3 -c "import json, sys; from bench.e2e_costs import print_table; print_table(json.load(open(sys.argv[1])))" \
    "$OUT/e2e_h200.json" 2>&1 | tail -60
