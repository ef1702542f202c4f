#!/usr/bin/env bash
# One device call for bench.power_probe (repo root on the GPU machine; carry .whl .jit .dg_src; DG_USE=1): clocks,
# power and throttle reasons during back-to-back and isolated prefill forwards and decode steps, 20b (prefill
# 1k, 4k; decode b=1, 64) then 120b with fp8 K/V (prefill 8k; decode b=1; RUN_120B=0 skips); tables printed last.
#   DG_USE=1 bash bench/power_probe_device_run.sh       LIMIT_S (default 560) bounds the whole script; PROBE_ARGS adds
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step power_20b "${P20_S:-200}" python3 -m bench.power_probe --model gpt-oss-20b --prefill 1024,4096 --decode 1,64 \
    --out "$OUT/power_probe_20b_h200.json" ${PROBE_ARGS:-}
[ "${RUN_120B:-1}" = 1 ] && step power_120b "${P120_S:-240}" python3 -m bench.power_probe --model gpt-oss-120b \
    --prefill 8192 --decode 1 --kv-cache-dtype fp8_e4m3 --headroom-gb 6 --out "$OUT/power_probe_120b_h200.json" ${PROBE_ARGS:-}
pack_logs
echo "---- summary"
for f in power_20b power_120b; do [ -f "$OUT/$f.log" ] && grep -vE "Warn|warn" "$OUT/$f.log" | tail -8; done
