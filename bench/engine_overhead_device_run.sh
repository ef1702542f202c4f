#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit), 2026-12-03: the GPU tests of the one-copy step
# upload, the one-launch decode plan fill and the rotary in the FP8 QKV slab GEMV's tail; bench.decode_ab of that
# rotary against the separate kernel (20b with every decode opt-in, batch 1-2); bench.engine_step_profile on 20b.
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step gpu_tests 170 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_e2e_gpu.py::test_engine_with_cuda_graphs_generates_what_it_does_eagerly \
    tests/kernels/test_attention_gpu.py tests/kernels/test_layers_gpu.py -k "upload or fill_decode or slab or eagerly or replays_in_a_cuda_graph"
tail -4 "$OUT/gpu_tests.log"
step ab20 150 python3 -m bench.decode_ab --models gpt-oss-20b --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-rotary-apart \
    --batches 1,2 --max-batch 2 --rounds 2 --out "$OUT/decode_ab_qkv_rotary_20b_h200.json"
tail -12 "$OUT/ab20.log"
step esp20 200 python3 -m bench.engine_step_profile --model gpt-oss-20b --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 \
    --mxfp4-decode-max-tokens 8 --out "$OUT/engine_step_profile_20b_one_copy_h200.json"
pack_jit_cache
tail -c 2200 "$OUT/esp20.log"
