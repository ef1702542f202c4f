#!/usr/bin/env bash
# One device call for the one-token MoE layer as one persistent CUDA kernel (kernels/moe/moe_decode_layer_cuda.py;
# repo root on the GPU machine, carry .whl .jit): build the extensions (with the CUDA front, the split path it is
# compared with), the kernel's GPU tests, the probe (bench/moe_decode_layer_probe.py) and, where it saw the kernel win
# (AB=auto), 120b's decode step with and without it; MOE=1 the layer against the split path in one process (bench.moe
# at T = 1: rows fp8_routed and fp8_layer, both models); AB=1 adds bench.decode_ab (120b with FP8 QKV / O / unembedding,
# 20b with every decode opt-in), the decode step with and without the kernel; ENGINE=1 adds 120b's and 20b's
# batch-1 engine runs with decode_moe='fused'. TESTS=0 skips the tests, PROBE=0 the kernel's trace probe
# (bench/moe_decode_layer_probe.py), MOE=0 the layer bench.
#   LIMIT_S=580 bash bench/moe_decode_layer_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step build 150 python3 -m scripts.prebuild_cuda_kernels --only decode_front,moe_decode_layer
tail -n 3 "$OUT/build.log"
[ "${TESTS:-1}" = 1 ] && step tests 200 python3 -m pytest -q -ra -x -p no:cacheprovider \
    tests/kernels/test_moe_decode_layer_cuda_gpu.py -k "${TEST_K:-not zzz_none}"
[ -f "$OUT/tests.log" ] && tail -n 12 "$OUT/tests.log"
if [ "${PROBE:-1}" = 1 ]; then
    step probe 150 python3 -m bench.moe_decode_layer_probe --out "$OUT/moe_decode_layer_probe_h200.json"
    tail -n 40 "$OUT/probe.log"
fi
# the decode step A/B only where the probe saw the kernel beat the split path (AB=auto, the default)
if [ "${AB:-auto}" = auto ] && [ -f "$OUT/moe_decode_layer_probe_h200.json" ]; then
    AB_VARIANT=$(python3 - "$OUT/moe_decode_layer_probe_h200.json" <<'PY'
import json, sys
us = json.load(open(sys.argv[1]))["us"]
split = min(us["split"], us.get("split_again", us["split"]))
best = min((v, k) for k, v in us.items() if k.startswith("layer_"))
if best[0] < split:
    print("fp8-dense-layer-cp-async" if "cp_async" in best[1] else "fp8-dense-layer")
PY
)
    if [ -n "$AB_VARIANT" ]; then
        step decode_120b_auto 150 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2 --rounds 3 \
            --max-batch 2 --variants "fp8-dense-cuda-front,$AB_VARIANT" --out "$OUT/decode_ab_layer_120b_h200.json"
        grep -h -A4 "decode step (ms)" "$OUT/decode_120b_auto.log"
    else
        echo "probe: the kernel did not beat the split path; no decode A/B"
    fi
fi
if [ "${MOE:-1}" = 1 ]; then
    step moe 200 python3 -m bench.moe --tokens 1 --skip gemm,decode,dense --out "$OUT/moe_layer_t1_h200.json"
    grep -E "fp8_routed|fp8_layer|FAILED" "$OUT/moe.log"
fi
if [ "${AB:-auto}" = 1 ]; then
    step decode_120b 150 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2 --rounds 3 --max-batch 2 \
        --variants fp8-dense-cuda-front,fp8-dense-layer --out "$OUT/decode_ab_layer_120b_h200.json"
    step decode_20b 120 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,2 --rounds 3 --max-batch 2 \
        --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-layer --out "$OUT/decode_ab_layer_20b_h200.json"
    echo "---- summary"
    grep -h -A4 "decode step (ms)" "$OUT/decode_120b.log" "$OUT/decode_20b.log"
fi
if [ "${ENGINE:-0}" = 1 ]; then
    step e2e_120b 170 python3 -m bench.e2e --device cuda --models gpt-oss-120b --prefill-lens 1024 --contexts 1024 \
        --max-batch 1 --engine-runs b1 --model-share 1.0 --headroom-gb 6 --budget-s 160 --dense-dtype fp8_e4m3 \
        --lm-head-dtype fp8_e4m3 --decode-moe fused --out "$OUT/e2e_h200_120b_b1_fused_layer.json"
    grep -h "engine run b1:" "$OUT/e2e_120b.log"
    step e2e_20b 150 python3 -m bench.e2e --device cuda --models gpt-oss-20b --prefill-lens 1024 --contexts 1024 \
        --max-batch 1 --engine-runs b1 --model-share 1.0 --headroom-gb 6 --budget-s 140 --dense-dtype fp8_e4m3 \
        --lm-head-dtype fp8_e4m3 --mxfp4-decode-max-tokens 8 --decode-moe fused --out "$OUT/e2e_h200_20b_b1_fused_layer.json"
    grep -h "engine run b1:" "$OUT/e2e_20b.log"
fi
pack_jit_cache
