#!/usr/bin/env bash
# One short device call for the rotary table (repo root on the GPU machine; carry .whl .jit): its GPU tests and the
# layers' rotary GPU tests, then a 20b batch-1 decode timeline with every opt-in (compare the at::native kernels and
# the step with bench/results/decode_timeline_20b_b1_opt_ins_h200.json).
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 60 python3 -m pytest -q -ra -p no:cacheprovider tests/model/test_rotary_table.py tests/kernels/test_layers_gpu.py -k rotary
tail -n 2 "$OUT/tests.log"
step tl20 150 python3 -m bench.decode_timeline --model gpt-oss-20b --batch 1 --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 \
    --mxfp4-decode-max-tokens 8 --out "$OUT/decode_timeline_20b_b1_opt_ins_rotary_table_h200.json"
head -c 2200 "$OUT/tl20.log"
