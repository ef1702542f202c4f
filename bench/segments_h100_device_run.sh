#!/usr/bin/env bash
# One H100 device call (repo root; carry .whl .jit .dg_src): 20b decode steps at 64-128 sequences and short prompts with
# the segments GEMM off / on (bench/decode_ab.py, FP8 QKV / O / unembedding), then the engine's GPU tests with the tree's
# defaults. DG_USE=1 LIMIT_S=420 bash bench/segments_h100_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step decode_ab 260 python3 -m bench.decode_ab --models gpt-oss-20b --variants fp8-dense,fp8-dense-segments \
    --batches 64,96,128 --max-batch 128 --ctx 1024 --prefill-lens 96,128 --rounds 2 --profile-batch 128 \
    --headroom-gb 6 --out "$OUT/decode_ab_segments_20b.json"
grep -v "^  " "$OUT/decode_ab.log" | tail -30
step e2e_tests 120 python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_e2e_gpu.py
tail -3 "$OUT/e2e_tests.log"
