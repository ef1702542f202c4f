#!/usr/bin/env bash
# One device call for the MXFP4 decode GEMM's ring fix (repo root on the GPU machine; carry .whl):
#   LIMIT_S=560 bash bench/mxfp4_ring_device_run.sh
# Build, GPU tests of the kernel and the decode layer, cold eager timings of the step's streaming kernels,
# bench/mxfp4_decode.py (graphs; a ring-config sweep at T = 1 on 20b shapes), Nsight Compute of the new kernel
# and the slab GEMV. FlashInfer's modules build in the background for the next call (FI_BUILD=1).
set -u
LIMIT_S=${LIMIT_S:-560}
export FI_BUILD=1
source scripts/device_env.sh
export MXFP4_CUDA_BUILD_DIR=$PWD/build/mxfp4_cuda
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step build 240 python3 -c "from kernels.moe import mxfp4_cuda as mc; print(mc.build())"
tail -2 "$OUT/build.log"
step gpu_tests 120 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_mxfp4_cuda.py tests/kernels/test_mxfp4_decode_layer.py
tail -3 "$OUT/gpu_tests.log"
step timing 90 python3 -m bench.ncu_decode_kernels --time
tail -6 "$OUT/timing.log"
step bench 240 python3 -m bench.mxfp4_decode --tokens 1,4,8 --mma-sweep "kind=0;tiles_per_block=2,4,8;k_splits=2,3,5;depth=4,8" \
    --out "$OUT/mxfp4_cuda_decode_ring_h200.json"
tail -14 "$OUT/bench.log"
step ncu 120 "$NCU" --clock-control none --set full -k "regex:mxfp4|_slab_gemv" --launch-count 12 -f -o /tmp/prof \
    python3 -m bench.ncu_decode_kernels --calls 2 --only mxfp4_gate_up,mxfp4_down,slab_qkv,slab_o
"$NCU" -i /tmp/prof.ncu-rep --page raw --csv 2>&1 | gzip > "$OUT/ncu_raw.csv.gz"
"$NCU" -i /tmp/prof.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_source.csv.gz"
[ -n "$FI_PID" ] && wait "$FI_PID"
tail -2 "$LOGS/flashinfer_build.log"
mv "$OUT"/*.log "$LOGS"/  # a call returns at most 8 files: the logs travel in logs.tgz
pack_logs
ls "$OUT"
