#!/usr/bin/env bash
# One H200 device call (repo root; carry .whl .jit .dg_src): where 120b's decode step goes in the throughput regime,
# and the segments GEMM's A/B there. bench.decode_timeline (a replayed graph step under the profiler, every kernel on
# the device timeline) at BATCHES (default "512:1024 128:2048": batch:context, fp8 K/V) with the MoE's segments GEMM
# on (16 rows, the default) and off (0: DeepGEMM's contiguous GEMM), alternated per batch. Run it with needs_h200
# (120b's 117 GB of FP8 experts).
#   DG_USE=1 LIMIT_S=560 bash bench/throughput_timeline_device_run.sh
# On a bare machine add FI_BUILD=1 DG_BUILD=1 (bench/segments_e2e_device_run.sh says how).
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
wait_builds
MEM_MIB=$(gpu_mem_mib)
if [ "${MEM_MIB:-0}" -lt 120000 ]; then
    echo "120b's FP8 experts need the H200's memory: this GPU has $MEM_MIB MiB"; exit 1
fi
for point in ${BATCHES:-512:1024 128:2048}; do
    b=${point%%:*} ctx=${point##*:}
    for rows in ${ROWS:-16 0}; do
        name="tl120_b${b}_rows$rows"
        step "$name" "${RUN_S:-150}" python3 -m bench.decode_timeline --model gpt-oss-120b --batch "$b" --ctx "$ctx" \
            --headroom-gb 4 --kv-cache-dtype fp8_e4m3 --moe-segments-max-rows "$rows" \
            --out "$LOGS/decode_timeline_120b_b${b}_ctx${ctx}_segments${rows}_h200.json"
        grep -E "replayed step|Error" "$OUT/$name.log" | tail -2
    done
done
pack_logs  # the JSON files travel in logs.tgz (a call returns at most 8 files)
echo "---- kernels of each run (top 8 by what they add to the step)"
for f in "$OUT"/tl120_*.log; do echo "== $f"; sed -n '/^kernel /,+8p' "$f"; done
