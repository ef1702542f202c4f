#!/usr/bin/env bash
# One device call for the MoE combine without a branch per pair (kernels/moe/epilogues_triton.COMBINE_BRANCH_FREE;
# repo root on the GPU machine; carry .whl .jit): its GPU tests, then bench.decode_ab, the default (a branch per pair)
# against the "-branch-free-combine" variants (20b with every opt-in, 120b with FP8 dense layers; WITH_120B=0: 20b only).   LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 60 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py -k "combine_without or routed_forward"
tail -n 2 "$OUT/tests.log"
step decode_20b 150 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-branch-free-combine --out "$OUT/decode_ab_combine_20b_h200.json"
[ "${WITH_120B:-1}" = 1 ] && step decode_120b 150 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense,fp8-dense-branch-free-combine --out "$OUT/decode_ab_combine_120b_h200.json"
echo "---- summary"
grep -hE "ms/step" "$OUT"/decode_*.log
