#!/usr/bin/env bash
# One device call for the one-token MoE decode front as one CUDA cluster (kernels/moe/decode_front_cuda.py; repo root
# on the GPU machine, carry .whl .jit): build the extension (scripts/prebuild_cuda_kernels.py), its GPU tests (twin,
# the Triton front bit for bit on exact inputs, graphs with and without PDL, decode_front through build_model), the
# engine's GPU suites (graphs vs eager with decode_front='cuda' among them); AB=1 adds bench.decode_ab against the
# Triton front (120b with FP8 QKV / O / unembedding, 20b with every decode opt-in); ENGINE_AB=N adds N alternations of
# 120b's batch-1 engine run (bench.e2e --engine-runs b1, FP8 QKV / O / unembedding) with --decode-front triton / auto;
# TESTS=0 skips the test step, TEST_K selects tests (pytest -k).
#   LIMIT_S=560 bash bench/decode_front_cuda_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step build 150 python3 -m scripts.prebuild_cuda_kernels --only decode_front
tail -n 3 "$OUT/build.log"
[ "${TESTS:-1}" = 1 ] && step tests 330 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_decode_front_cuda_gpu.py \
    tests/engine/test_e2e_gpu.py tests/engine/test_engine_gpu.py -k "${TEST_K:-not nothing}"
[ -f "$OUT/tests.log" ] && tail -n 6 "$OUT/tests.log"
if [ "${AB:-0}" = 1 ]; then
    step decode_120b 120 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2 --rounds 3 --max-batch 2 \
        --variants fp8-dense,fp8-dense-cuda-front --out "$OUT/decode_ab_cuda_front_120b_h200.json"
    step decode_20b 100 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,2 --rounds 3 --max-batch 2 \
        --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-cuda-front --out "$OUT/decode_ab_cuda_front_20b_h200.json"
    echo "---- summary"
    grep -h -A3 "decode step (ms)" "$OUT/decode_120b.log" "$OUT/decode_20b.log"
fi
mkdir -p /tmp/ab
for i in $(seq "${ENGINE_AB:-0}"); do
    for front in triton auto; do
        step "e2e_${front}_$i" 150 python3 -m bench.e2e --device cuda --models gpt-oss-120b --prefill-lens 1024 \
            --contexts 1024 --max-batch 1 --engine-runs b1 --model-share 1.0 --headroom-gb 6 --budget-s 140 \
            --prefill-chunk 2048 --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 --decode-front "$front" \
            --out "/tmp/ab/e2e_h200_120b_b1_front_${front}_$i.json"
        grep -h "engine run b1:" "$OUT/e2e_${front}_$i.log"
    done
done
if [ "${ENGINE_AB:-0}" -gt 0 ]; then  # one file back for every run's JSON and plots (a call returns 8 files)
    tar czf "$OUT/engine_ab_front.tgz" -C /tmp/ab .
else
    pack_jit_cache
fi
