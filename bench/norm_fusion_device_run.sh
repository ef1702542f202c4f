#!/usr/bin/env bash
# One device call for the residual add in O's slab GEMV + the norm in the MoE front (kernels/layers/pending_norm.py;
# repo root on the GPU machine; carry .whl .jit): GPU tests, then bench.decode_ab against the "-no-norm-fusion"
# variants: 20b with every opt-in, 120b with FP8 dense layers (STAGE=timeline: a 20b batch-1 timeline instead of 120b).
#   bash bench/norm_fusion_device_run.sh        LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 140 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_layers_gpu.py tests/kernels/test_moe_gpu.py \
    tests/engine/test_triton_precompile_gpu.py tests/engine/test_e2e_gpu.py \
    -k "slab or fp8_linear or pending_norm or fused_front or routed_forward or shipped or norm_left"
tail -n 3 "$OUT/tests.log"
step decode_20b 150 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,2 --rounds 2 --max-batch 2 \
    --variants fp8-dense+mxfp4-8-no-norm-fusion,fp8-dense+mxfp4-8 --out "$OUT/decode_ab_norm_fusion_20b_h200.json"
if [ "${STAGE:-ab}" = timeline ]; then
    step tl20 150 python3 -m bench.decode_timeline --model gpt-oss-20b --batch 1 --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 \
        --mxfp4-decode-max-tokens 8 --out "$OUT/decode_timeline_20b_b1_norm_fusion_h200.json"
else
    step decode_120b 230 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2 --rounds 2 --max-batch 2 \
        --variants fp8-dense-no-norm-fusion,fp8-dense --out "$OUT/decode_ab_norm_fusion_120b_h200.json"
fi
pack_logs
echo "---- summary"
grep -hE "ms/step" "$OUT"/decode_*.log
[ -f "$OUT/tl20.log" ] && head -c 1800 "$OUT/tl20.log"
