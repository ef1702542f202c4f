#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit): bench.engine_step_profile on 20b with every decode
# opt-in (FP8 QKV / O / unembedding, MXFP4 experts up to 8 tokens); WITH_120B=1 adds 120b with FP8 QKV / O /
# unembedding. Extra arguments go to both runs.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
O="--dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3"
step esp20 240 python3 -m bench.engine_step_profile --model gpt-oss-20b $O --mxfp4-decode-max-tokens 8 \
    --out "$OUT/engine_step_profile_20b_h200.json" "$@"
[ "${WITH_120B:-0}" = 1 ] && step esp120 300 python3 -m bench.engine_step_profile --model gpt-oss-120b $O \
    --out "$OUT/engine_step_profile_120b_h200.json" "$@"
pack_jit_cache
tail -c 3000 "$OUT/esp20.log"; echo; [ -f "$OUT/esp120.log" ] && tail -c 3000 "$OUT/esp120.log"
