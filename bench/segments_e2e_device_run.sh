#!/usr/bin/env bash
# One H200 device call (repo root; carry .whl .jit .dg_src): 120b max throughput at 1k in / 1k out through
# LLMEngine (fp8 K/V, 512 requests at once) with the segments GEMM on (the default, 16 rows) and off (0: DeepGEMM's
# contiguous GEMM), one after the other on the same machine (bench.e2e --no-table: only the 1k prefill point, the
# 1k/1k estimate and the engine run). ROWS (default "16 0") sets the order. Run it with needs_h200 (it exits at once
# on a GPU of less memory).
#   DG_USE=1 LIMIT_S=590 bash bench/segments_e2e_device_run.sh
# On a bare machine (no .jit/flashinfer*.tgz, no .dg_src/dg_site.tgz: a fresh checkout) add FI_BUILD=1 DG_BUILD=1 and
# carry .dg_src/deepgemm_src.tgz (scripts/pack_deep_gemm_src.sh): the call builds both first (~2 min) and returns
# them in $OUT for the next call's carry.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
wait_builds
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
MEM_MIB=$(gpu_mem_mib)
if [ "${MEM_MIB:-0}" -lt 120000 ]; then
    echo "120b's FP8 experts with 512 sequences of K/V need the H200's memory: this GPU has $MEM_MIB MiB"; exit 1
fi
for rows in ${ROWS:-16 0}; do
    step "e2e_rows$rows" "${RUN_S:-270}" python3 -m bench.e2e --device cuda --models gpt-oss-120b --model-share 1.0 \
        --prefill-lens 1024 --contexts 8192 --max-batch 512 --headroom-gb 4 --kv-cache-dtype fp8_e4m3 \
        --engine-runs 1k/1k --no-table --moe-segments-max-rows "$rows" --budget-s $(( ${RUN_S:-270} - 20 )) \
        --out "$OUT/e2e_h200_120b_1k1k_segments_$rows.json"
    grep -E "^\[|Error|error" "$OUT/e2e_rows$rows.log" | tail -6
done
rm -f "$OUT"/*.png  # a call returns at most 8 files
pack_logs
echo "---- summary (output tok/s of the engine run)"
for rows in ${ROWS:-16 0}; do
    python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['models']['gpt-oss-120b']; \
print('rows', sys.argv[2], [(x['requests'], round(x['output_tok_s']), round(x['wall_s'], 2), x['moe_segments_max_rows']) \
for x in r.get('engine_runs', [])], 'estimate', [round(t['output_tok_s']) for t in r['throughput']])" \
        "$OUT/e2e_h200_120b_1k1k_segments_$rows.json" "$rows" 2>&1 | tail -1
done
