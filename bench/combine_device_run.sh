#!/usr/bin/env bash
# One device call for the MoE combine without a branch per pair (kernels/moe/epilogues_triton.COMBINE_BRANCH_FREE;
# repo root on the GPU machine; carry .whl .jit): its GPU tests, then bench.decode_ab, the default (a branch per pair)
# against the "-branch-free-combine" variants (20b with every opt-in; WITH_120B=1: 120b with FP8 dense layers too),
# then (E2E=1, default) the batch-1 engine run of 20b with every opt-in and the branch-free combine switched on.
# LIMIT_S (default 560) bounds the whole script.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 70 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py -k "combine_without or routed_forward"
tail -n 2 "$OUT/tests.log"
step decode_20b 150 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-branch-free-combine --out "$OUT/decode_ab_combine_20b_h200.json"
[ "${WITH_120B:-0}" = 1 ] && step decode_120b 150 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense,fp8-dense-branch-free-combine --out "$OUT/decode_ab_combine_120b_h200.json"
echo "---- summary"
grep -hE "x1\.|x0\." "$OUT"/decode_*.log
if [ "${E2E:-1}" = 1 ]; then
    step e2e_20b 200 python3 -c "import sys; from kernels.moe import epilogues_triton as e; e.COMBINE_BRANCH_FREE = True; \
from bench.e2e import main; sys.exit(main(sys.argv[1:]))" --device cuda --models gpt-oss-20b --prefill-lens 1024 \
        --contexts 1024 --max-batch 1 --engine-runs b1 --model-share 1.0 --headroom-gb 6 --budget-s 180 \
        --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 --mxfp4-decode-max-tokens 8 --out "$OUT/e2e_h200_20b_b1_branch_free_combine.json"
    grep -E "engine run|decode b=1|Error" "$OUT/e2e_20b.log" | tail -3
fi
