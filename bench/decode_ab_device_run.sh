#!/usr/bin/env bash
# One device call for decode A/Bs (repo root on the GPU machine; carry .whl .jit .dg_src):
#   scripts/device_env.sh, then the GPU tests in TEST_ARGS (if set), the L2 prefetch probe (PROBE=1),
#   then python -m bench.decode_ab with the given args; LIMIT_S (default 560) bounds the whole script.
#   bash bench/decode_ab_device_run.sh --models gpt-oss-20b
set -u
LIMIT_S=${LIMIT_S:-560}
start=$(date +%s)
source scripts/device_env.sh
if [ "${PROBE:-0}" = 1 ]; then
    timeout 120 python3 -m bench.l2_prefetch_probe --out "$OUT/l2_prefetch_probe_h200.json" > "$OUT/probe.log" 2>&1
    echo "probe exit $?"; tail -6 "$OUT/probe.log"
fi
if [ -n "${TEST_ARGS:-}" ]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -ra -p no:cacheprovider $TEST_ARGS > "$OUT/tests.log" 2>&1
    echo "tests exit $? after $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -12
fi
left=$(( LIMIT_S - ($(date +%s) - start) - 20 ))
timeout "$left" python3 -m bench.decode_ab --out "$OUT/decode_ab_h200.json" "$@" > "$OUT/decode_ab.log" 2>&1
echo "decode_ab exit $? after $(( $(date +%s) - start )) s"
pack_jit_cache; pack_logs; rm -f "$OUT/jit_cache.tgz"
grep -E "^\[|Error|error" "$OUT/decode_ab.log" | tail -30
sed -n '/decode step (ms)/,$p' "$OUT/decode_ab.log" | head -60
