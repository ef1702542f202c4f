#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit): bench.decode_timeline at batch 1 with every decode
# opt-in, 20b (FP8 QKV / O / unembedding, MXFP4 experts up to 8 tokens) and 120b (FP8 QKV / O / unembedding).
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
O="--dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3"
step tl20 150 python3 -m bench.decode_timeline --model gpt-oss-20b --batch 1 $O --mxfp4-decode-max-tokens 8 --out "$OUT/decode_timeline_20b_b1_opt_ins_h200.json"
step tl120 240 python3 -m bench.decode_timeline --model gpt-oss-120b --batch 1 $O --out "$OUT/decode_timeline_120b_b1_opt_ins_h200.json"
pack_jit_cache
head -c 2500 "$OUT/tl20.log"; echo; head -c 2500 "$OUT/tl120.log"
