#!/usr/bin/env bash
# One device call: K splits of the FP8 decode GEMMs at T <= 4 (bench/decode_ab "splits-G-D" variants), 20b then
# 120b in what time is left. Repo root on the GPU machine; carry .whl .jit:
#   LIMIT_S=585 bash bench/decode_splits_device_run.sh
set -u
LIMIT_S=${LIMIT_S:-585}
source scripts/device_env.sh
step decode_ab_20b $(( $(left) - 5 )) python3 -m bench.decode_ab --models gpt-oss-20b \
    --variants fused+pdl,splits-4-8,splits-8-8,splits-4-6 --batches 1,2,4 --max-batch 4 --rounds 3 \
    --out "$OUT/decode_ab_splits_20b_h200.json"
grep -v "^ \|^kernels\|Warning\|warn" "$OUT/decode_ab_20b.log" | tail -7
[ "${WITH_120B:-0}" = 1 ] && step decode_ab_120b $(( $(left) - 5 )) python3 -m bench.decode_ab --models gpt-oss-120b \
    --variants fused+pdl,splits-4-8,splits-8-8 --batches 1,2,4 --max-batch 4 --rounds 2 --headroom-gb 6 \
    --out "$OUT/decode_ab_splits_120b_h200.json"
[ -f "$OUT/decode_ab_120b.log" ] && grep -v "^ \|^kernels\|Warning\|warn" "$OUT/decode_ab_120b.log" | tail -6
mv "$OUT"/*.log "$LOGS"/
pack_logs
