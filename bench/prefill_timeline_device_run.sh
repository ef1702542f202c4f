#!/usr/bin/env bash
# One device call for the prefill timelines (repo root on the GPU machine; carry .whl .jit .dg_src; DG_USE=1, and
# DG_BUILD=1 while .dg_src holds only the source tarball: DeepGEMM is built first, ~90 s, packed into $OUT):
#  python -m bench.prefill_timeline on 20b (TOKENS_20B, default 1k,4k; with the prefill graphs, then 4k eager) and
#  120b (TOKENS_120B, default 8k; fp8 K/V as the README's 120b runs; RUN_120B=0 skips), with --stacks; each under its
#  own time guard, logs in $OUT, the tables printed last.
#   DG_USE=1 DG_BUILD=1 bash bench/prefill_timeline_device_run.sh      LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
[ -n "$DG_PID" ] && { wait "$DG_PID"; echo "deep_gemm: $(tail -1 "$LOGS/dg_build_stdout.log")"; }
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
step timeline_20b "${T20_S:-220}" python3 -m bench.prefill_timeline --model gpt-oss-20b --tokens "${TOKENS_20B:-1024,4096}" \
    --stacks --out "$OUT/prefill_timeline_20b_h200.json"
step timeline_20b_eager "${T20E_S:-90}" python3 -m bench.prefill_timeline --model gpt-oss-20b --tokens 4096 \
    --no-prefill-graphs --stacks --out "$OUT/prefill_timeline_20b_eager_h200.json"
[ "${RUN_120B:-1}" = 1 ] && step timeline_120b "${T120_S:-200}" python3 -m bench.prefill_timeline --model gpt-oss-120b \
    --tokens "${TOKENS_120B:-8192}" --kv-cache-dtype fp8_e4m3 --headroom-gb 6 --stacks --out "$OUT/prefill_timeline_120b_h200.json"
pack_jit_cache; pack_logs
echo "---- summary"
for f in timeline_20b timeline_20b_eager timeline_120b; do
    [ -f "$OUT/$f.log" ] && grep -vE "Warn|warn" "$OUT/$f.log" | grep -A40 "prefill .* tokens" | head -60
done
