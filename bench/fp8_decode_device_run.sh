#!/usr/bin/env bash
# One device call: build the CUDA FP8 decode GEMM, its GPU tests, the kernel bench, then (VARIANTS set) the
# decode step A/B with it.  carry [".whl", ".jit"];  VARIANTS="fused+pdl,cuda-gemm" bash bench/fp8_decode_device_run.sh
source scripts/device_env.sh
export FP8_DECODE_BUILD_DIR=$PWD/build/fp8_decode MXFP4_CUDA_BUILD_DIR=$PWD/build/mxfp4_cuda
step build 240 python3 -c "from kernels.moe import fp8_decode_cuda as fc; print(fc.build())"
tail -3 "$OUT/build.log"
step tests 200 python3 -m pytest -q -x tests/kernels/test_fp8_decode_cuda.py \
    "tests/kernels/test_moe_gpu.py::test_layer_on_the_cuda_decode_gemm"
tail -3 "$OUT/tests.log"
if [ "${BENCH:-1}" = 1 ]; then
    step bench 240 python3 -m bench.fp8_decode --models "${MODELS_E:-32,128}" --out "$OUT/fp8_decode_cuda_h200.json"
    sed -n '/us per call/,$p' "$OUT/bench.log"
fi
if [ -n "${VARIANTS:-}" ]; then
    [ -n "$FI_PID" ] && wait "$FI_PID"
    step decode_ab 400 python3 -m bench.decode_ab --models "${AB_MODELS:-gpt-oss-20b}" --variants "$VARIANTS" \
        --batches "${AB_BATCHES:-1,2,4,8}" --max-batch 8 --rounds "${AB_ROUNDS:-2}" --out "$OUT/decode_ab_cuda_gemm.json"
    sed -n '/decode step (ms)/,$p' "$OUT/decode_ab.log" | head -30
fi
[ -n "$FI_PID" ] && wait "$FI_PID"
pack_jit_cache
mv "$OUT"/*.log "$LOGS"/ 2>/dev/null; pack_logs
