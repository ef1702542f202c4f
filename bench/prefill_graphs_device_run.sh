#!/usr/bin/env bash
# One device call for the piecewise prefill CUDA graphs (repo root on the GPU machine; carry .whl .jit
# .dg_src; DG_USE=1):
#  1. GPU tests: the engine on the GPU kernels (TESTS, default tests/engine/test_e2e_gpu.py: prefill graphs
#     against their eager pieces bit for bit, engine tokens with and without graphs; TESTS= skips);
#  2. python -m bench.prefill_ab --variants graphs (eager vs graphs, same process) on 20b (LENS_20B, default
#     1k,2k,4k,8k) and 120b (LENS_120B, default 1k,8k), ROUNDS rounds (default 3); tables printed last.
#   DG_USE=1 bash bench/prefill_graphs_device_run.sh       LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
TESTS=${TESTS-tests/engine/test_e2e_gpu.py}
[ -n "$TESTS" ] && step tests "${TESTS_S:-200}" python3 -m pytest -q -ra -s -p no:cacheprovider $TESTS
[ -n "$TESTS" ] && { grep -E "padded graphs|passed|failed|Error" "$OUT/tests.log" | tail -12; }
step prefill_20b "${S_20B:-150}" python3 -m bench.prefill_ab --model gpt-oss-20b --lens "${LENS_20B:-1024,2048,4096,8192}" \
    --variants graphs --rounds "${ROUNDS:-3}" --out "$OUT/prefill_ab_graphs_20b_h200.json"
step prefill_120b "${S_120B:-200}" python3 -m bench.prefill_ab --model gpt-oss-120b --lens "${LENS_120B:-1024,8192}" \
    --variants graphs --rounds "${ROUNDS:-3}" --out "$OUT/prefill_ab_graphs_120b_h200.json"
pack_jit_cache; pack_logs
echo "---- summary"
grep -hE "captured|tokens=|Error|error" "$OUT/prefill_20b.log" "$OUT/prefill_120b.log" | tail -14
