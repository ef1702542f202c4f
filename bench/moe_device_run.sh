#!/usr/bin/env bash
# One device call for the FP8 MoE (repo root on the GPU machine; carry .whl .jit .dg_src): deep_gemm from
# .dg_src (built now if no dg_site.tgz is carried), its smoke test, the MoE GPU tests, then python -m
# bench.moe (args passed through) after parallel warm-up shards. The build comes back as $OUT/dg_site.tgz
# (carry it in .dg_src/ next time). Until 2026-11-30 this file probed sgl-deep-gemm wheels instead.
#   bash bench/moe_device_run.sh [bench.moe args]
set -u
S=$(date +%s)
DG_USE=1 DG_BUILD=1 source scripts/device_env.sh
[ -n "$DG_PID" ] && wait "$DG_PID"
tail -1 "$LOGS/dg_build_stdout.log" 2>/dev/null
( cd /tmp && timeout 150 python3 -m scripts.deep_gemm_smoke > "$LOGS/dg_smoke.log" 2>&1 ); echo "smoke exit $? at $(( $(date +%s) - S )) s"
grep why_unavailable "$LOGS/dg_smoke.log"
timeout 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py > "$LOGS/tests_moe.log" 2>&1
echo "MoE GPU tests: $(tail -1 "$LOGS/tests_moe.log") at $(( $(date +%s) - S )) s"
grep -E "^FAILED|^SKIPPED" "$LOGS/tests_moe.log" | head -5
for i in $(seq 0 7); do timeout 150 python3 -m bench.moe --warmup-shard "$i/8" "$@" >> "$LOGS/warmup.log" 2>&1 & done
wait
echo "warm-up done at $(( $(date +%s) - S )) s"
timeout $(( 565 - ($(date +%s) - S) )) python3 -m bench.moe --out "$OUT/moe_h200.json" "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? at $(( $(date +%s) - S )) s"
grep -E "^ *(20b|120b) +[0-9]+ |^gate_up" "$OUT/bench.log" | tail -16
pack_jit_cache; pack_logs
