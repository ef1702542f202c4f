#!/usr/bin/env bash
# One device call for the one-token MoE decode front as one CUDA cluster (kernels/moe/decode_front_cuda.py; repo root
# on the GPU machine, carry .whl .jit): build the extension, its GPU tests (twin, the Triton front bit for bit on
# exact inputs, graphs with and without PDL, a whole model's graph decode against eager), then bench.decode_ab
# against the Triton front: 120b with FP8 QKV / O / unembedding, 20b with every decode opt-in.
#   LIMIT_S=440 bash bench/decode_front_cuda_device_run.sh
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step build 150 python3 -c "import time; t = time.time(); from kernels.moe import decode_front_cuda as c; c._extension(); print(f'built in {time.time() - t:.0f} s')"
tail -n 3 "$OUT/build.log"
step tests 110 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_decode_front_cuda_gpu.py \
    tests/engine/test_e2e_gpu.py -k "cuda_front or cuda_graph_decode_equals_eager"
tail -n 4 "$OUT/tests.log"
step decode_120b 120 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,2 --rounds 3 --max-batch 2 \
    --variants fp8-dense,fp8-dense-cuda-front --out "$OUT/decode_ab_cuda_front_120b_h200.json"
step decode_20b 100 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,2 --rounds 3 --max-batch 2 \
    --variants fp8-dense+mxfp4-8,fp8-dense+mxfp4-8-cuda-front --out "$OUT/decode_ab_cuda_front_20b_h200.json"
echo "---- summary"
grep -h -A3 "decode step (ms)" "$OUT/decode_120b.log" "$OUT/decode_20b.log"
grep -h -E "_decode_front_kernel|front_kernel" "$OUT/decode_120b.log" "$OUT/decode_20b.log" | head -8
