#!/usr/bin/env bash
# One H200 device call (repo root; carry .whl .jit .dg_src): the segments GEMM against DeepGEMM on the MoE layer
# (bench/moe_segments.py), then 120b decode steps at 64-512 sequences and short prompts with the segments GEMM off /
# on in one process (bench/decode_ab.py; bf16 QKV / O / unembedding and the CUDA front: the engine's defaults, as in
# the max-throughput runs).
#   DG_USE=1 LIMIT_S=580 bash bench/segments_ab_device_run.sh
#   (LAYER_MODELS=120b BATCHES=128,256,512 PREFILL_LENS=512 CTX=512: a shorter call; 512 sequences of 1k context
#   do not fit the bf16 K/V pool next to 120b)
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
step bench 150 python3 -m bench.moe_segments --models "${LAYER_MODELS:-120b,20b}" --out "$OUT/moe_segments.json"
sed -n '/^model   T/,$p' "$OUT/bench.log"
step decode_ab 400 python3 -m bench.decode_ab --models gpt-oss-120b --variants \
    fused+pdl-cuda-front,fused+pdl-cuda-front-segments --batches "${BATCHES:-64,96,128,256,512}" --max-batch 512 --ctx "${CTX:-1024}" \
    --prefill-lens "${PREFILL_LENS:-256,512,768}" --rounds 2 --profile-batch 128 --headroom-gb 6 --out "$OUT/decode_ab_segments_120b.json"
grep -v "^  " "$OUT/decode_ab.log" | tail -45
pack_logs
