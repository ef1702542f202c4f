#!/usr/bin/env bash
# One device call for the CUDA C++ MXFP4 decode GEMM (repo root on the GPU machine; carry .whl .jit):
#   LIMIT_S=560 bash bench/mxfp4_cuda_device_run.sh [bench args...]
# Builds csrc/mxfp4_decode.cu, dumps its SASS, runs tests/kernels/test_mxfp4_cuda.py, then
# bench/mxfp4_decode.py (FP8 / Triton MXFP4 / CUDA MXFP4 in one process); JSON and logs under $OUT.
set -u
LIMIT_S=${LIMIT_S:-560}
source scripts/device_env.sh
export MXFP4_CUDA_BUILD_DIR=/tmp/mxfp4_build
step build 240 python3 -c "from kernels.moe import mxfp4_cuda as mc; print(mc.build())"
tail -3 "$OUT/build.log"
so=$(ls $MXFP4_CUDA_BUILD_DIR/*.so 2>/dev/null | head -1)
CUOBJDUMP=$(command -v cuobjdump || echo "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump")
[ -n "$so" ] && "$CUOBJDUMP" -sass "$so" | gzip > "$OUT/mxfp4_decode_sass.txt.gz"
step gpu_tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_mxfp4_cuda.py
tail -4 "$OUT/gpu_tests.log"
step bench $(( LIMIT_S - 30 )) python3 -m bench.mxfp4_decode --out "$OUT/mxfp4_cuda_decode_h200.json" "$@"
tail -16 "$OUT/bench.log"
pack_logs
