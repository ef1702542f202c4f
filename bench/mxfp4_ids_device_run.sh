#!/usr/bin/env bash
# One device call: the MXFP4 decode GEMM taking each block's routing from the front's ids (one round trip) against
# counts + token_of_row (mxfp4_decode_layer.ROUTE_FROM_IDS). Repo root on the GPU machine; carry .whl .jit:
#   LIMIT_S=585 bash bench/mxfp4_ids_device_run.sh
set -u
LIMIT_S=${LIMIT_S:-585}
source scripts/device_env.sh
export MXFP4_CUDA_BUILD_DIR=$PWD/build/mxfp4_cuda
step build 240 python3 -c "from kernels.moe import mxfp4_cuda as mc; print(mc.build())"
tail -2 "$OUT/build.log"
step gpu_tests 120 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_mxfp4_cuda.py \
    tests/kernels/test_mxfp4_decode_layer.py
tail -3 "$OUT/gpu_tests.log"
step decode_ab $(( $(left) - 5 )) python3 -m bench.decode_ab --models gpt-oss-20b \
    --variants fp8-dense+mxfp4-8-counts,fp8-dense+mxfp4-8 --batches 1,2,4,8 --max-batch 8 --rounds 3 \
    --out "$OUT/decode_ab_mxfp4_ids_20b_h200.json"
grep -v "^ \|^kernels\|Warning" "$OUT/decode_ab.log" | tail -8
mv "$OUT"/*.log "$LOGS"/
pack_logs
