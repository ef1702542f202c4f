#!/usr/bin/env bash
# One device call for the norms computed by the kernels that read them (kernels/layers/pending_norm.py) and the
# rotary table (repo root on the GPU machine; carry .whl .jit):
#   GPU tests (the rotary table, the fused front's norm), bench.decode_ab on 20b with every opt-in against its
#   "-no-norm-fusion" variant, then a 20b batch-1 timeline with every opt-in (compare with
#   bench/results/decode_timeline_20b_b1_opt_ins_h200.json).  MODEL=gpt-oss-120b: the 120b FP8-dense A/B instead.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 130 python3 -m pytest -q -ra -p no:cacheprovider tests/model/test_rotary_table.py tests/kernels/test_layers_gpu.py tests/engine/test_triton_precompile_gpu.py \
    tests/kernels/test_moe_gpu.py -k "rotary or pending_norm or fused_front or routed_forward or slab or shipped"
tail -n 3 "$OUT/tests.log"
if [ "${MODEL:-gpt-oss-20b}" = gpt-oss-120b ]; then
    step decode_120b 300 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4 --rounds 2 --max-batch 4 \
        --variants fp8-dense-no-norm-fusion,fp8-dense --out "$OUT/decode_ab_norm_fusion_120b_h200.json"
else
    step decode_20b 220 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4 --rounds 2 --max-batch 4 \
        --variants fp8-dense+mxfp4-8-no-norm-fusion,fp8-dense+mxfp4-8 --out "$OUT/decode_ab_norm_fusion_20b_h200.json"
    step tl20 150 python3 -m bench.decode_timeline --model gpt-oss-20b --batch 1 --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 \
        --mxfp4-decode-max-tokens 8 --out "$OUT/decode_timeline_20b_b1_norm_fusion_h200.json"
fi
pack_logs
echo "---- summary"
grep -hE "ms/step|passed|failed" "$OUT"/*.log | tail -n 12
[ -f "$OUT/tl20.log" ] && head -c 1800 "$OUT/tl20.log"
