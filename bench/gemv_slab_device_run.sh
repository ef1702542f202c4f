#!/usr/bin/env bash
# One device call: the slab GEMV's GPU tests, then its sweep against cuBLAS / the split-K GEMVs (bench/gemv_slab.py).
#   LIMIT_S=560 bash bench/gemv_slab_device_run.sh        (carry .whl; writes under $OUT)
source scripts/device_env.sh
step gpu_tests_slab 240 python3 -m pytest -q -m gpu tests/kernels/test_layers_gpu.py -k slab
tail -3 "$OUT/gpu_tests_slab.log"
step gemv_slab 420 python3 -m bench.gemv_slab --out "$OUT/gemv_slab_h200.json" ${SWEEP_ARGS:-}
tail -8 "$OUT/gemv_slab.log"
pack_jit_cache
