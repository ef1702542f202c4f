#!/usr/bin/env bash
# One device call: the slab GEMV's split-K partials finished by the rotary kernel / the post-attention norm
# (Attention.qkv_partials / o_partials). Repo root on the GPU machine; carry .whl .jit:
#   LIMIT_S=580 bash bench/partials_device_run.sh [decode_ab args...]
# GPU tests of kernels/layers (and the MXFP4 kernel, built meanwhile), then bench/decode_ab on 20b.
set -u
LIMIT_S=${LIMIT_S:-580}
source scripts/device_env.sh
export MXFP4_CUDA_BUILD_DIR=$PWD/build/mxfp4_cuda
( python3 -c "from kernels.moe import mxfp4_cuda as mc; print(mc.build())" > "$LOGS/mxfp4_build.log" 2>&1 ) &
BUILD_PID=$!
step gpu_tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_layers_gpu.py
tail -3 "$OUT/gpu_tests.log"
wait $BUILD_PID; tail -1 "$LOGS/mxfp4_build.log"
step gpu_tests_mxfp4 90 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_mxfp4_cuda.py
tail -2 "$OUT/gpu_tests_mxfp4.log"
step decode_ab $(( $(left) - 5 )) python3 -m bench.decode_ab --models gpt-oss-20b \
    --variants fp8-dense+mxfp4-8-tails,fp8-dense+mxfp4-8-o-tail,fp8-dense+mxfp4-8 --batches 1,2 --max-batch 8 \
    --rounds 3 --out "$OUT/decode_ab_partials_20b_h200.json" "$@"
tail -40 "$OUT/decode_ab.log"
mv "$OUT"/*.log "$LOGS"/
pack_logs
ls "$OUT"
