#!/usr/bin/env bash
# One device call for kernels/pdl.py's early trigger and the down GEMM's first weight tile before its PDL wait
# (repo root on the GPU machine; carry .whl .jit):
#   the GPU tests that compare PDL graphs (with either switch) against plain launches, bit for bit; then
#   bench.decode_ab on 120b (FP8 QKV / O / unembedding: what the b = 1 target runs) and 20b (every decode opt-in),
#   each switch against the variant without it, in one process per model.
#   bash bench/early_trigger_device_run.sh        LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py \
    tests/engine/test_e2e_gpu.py -k "pdl_launches or cuda_graph_decode_equals_eager"
tail -n 3 "$OUT/tests.log"
step decode_120b 260 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2,4 --rounds 2 --max-batch 4 \
    --variants "${VARIANTS_120B:-fp8-dense,fp8-dense-early,fp8-dense-down-tile,fp8-dense-early-down-tile}" \
    --out "$OUT/decode_ab_early_trigger_120b_h200.json"
step decode_20b 200 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,2,4 --rounds 2 --max-batch 4 \
    --variants "${VARIANTS_20B:-fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-early}" \
    --out "$OUT/decode_ab_early_trigger_20b_h200.json"
cp "$OUT"/decode_*.log "$LOGS"/ 2>/dev/null
pack_logs
pack_jit_cache
echo "---- summary"
grep -E "ms/step|x1\.|x0\." "$OUT/decode_120b.log" "$OUT/decode_20b.log" | tail -30
