#!/usr/bin/env bash
# One device call for the end-to-end benchmark (repo root on the GPU machine, $OUT set):
#  1. wheels + prebuilt FlashInfer modules through scripts/device_attention.sh, which also runs the
#     GPU tests named in TEST_ARGS (its own attention benchmark is cut to 1 s);
#  2. Triton kernels from earlier runs' caches (carry .e2e_cache: *.tgz holding triton/);
#  3. python -m bench.e2e under a time guard (partial JSON survives a timeout), table printed last;
#     the Triton cache goes back as $OUT/triton_cache.tgz.
#   bash bench/e2e_device_run.sh [bench.e2e args]       LIMIT_S (default 520) bounds the whole script
set -u
OUT=${OUT:-/tmp/e2e_out}
LIMIT_S=${LIMIT_S:-520}
start=$(date +%s)
mkdir -p "$OUT" /tmp/e2e_jit/triton
for t in .e2e_cache/*.tgz; do [ -f "$t" ] && tar xzf "$t" -C /tmp/e2e_jit triton 2>/dev/null; done
export TRITON_CACHE_DIR=/tmp/e2e_jit/triton PYTHONUNBUFFERED=1
# Few files back: the device returns a limited number, so the setup folder stays outside $OUT.
OUT=/tmp/e2e_setup TEST_ARGS="${TEST_ARGS:--s tests/engine/test_e2e_gpu.py}" TEST_TIMEOUT=${TEST_TIMEOUT:-180} \
    BENCH_TIMEOUT=1 bash scripts/device_attention.sh > "$OUT/setup.log" 2>&1
cp /tmp/e2e_setup/tests.log "$OUT/tests.log"
grep -E "^prompt|passed|failed|Error|assert" "$OUT/tests.log" | tail -12
echo "setup + tests done after $(( $(date +%s) - start )) s"
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=/tmp/fiws
left=$(( LIMIT_S - ($(date +%s) - start) - 25 ))
timeout "$left" python3 -m bench.e2e --device cuda --out "$OUT/e2e_h200.json" --budget-s $(( left - 20 )) "$@" \
    > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
tar czf "$OUT/triton_cache.tgz" -C /tmp/e2e_jit triton 2>/dev/null
grep -E "^\[|Error|error" "$OUT/bench.log" | tail -12
python3 -c "import json, sys; from bench.e2e_costs import print_table; print_table(json.load(open(sys.argv[1])))" \
    "$OUT/e2e_h200.json" 2>&1 | tail -60
