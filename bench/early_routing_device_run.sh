#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit), branch early-routing: the MoE epilogues' plan and
# bias rows (SwiGLU + quant, combine), the down GEMM's plan, the split decode attention's lengths, sinks and first
# page ids, and the slab GEMV's weight scales and bias read before the PDL wait (kernels/pdl.py switches).
#  1. GPU tests: the MoE kernels (incl. the PDL-graph-equals-plain-launches test) and the engine's graphs-vs-eager test;
#  2. bench.decode_ab, both models: every early load / plan late / epilogues late / down late, b = 1 and 4, ROUNDS
#     rounds (default 3).
#   bash bench/early_routing_device_run.sh          LIMIT_S (default 560)
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
if [ "${NO_TESTS:-0}" != 1 ]; then
    step tests 200 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py tests/kernels/test_attention_gpu.py tests/kernels/test_layers_gpu.py \
        tests/engine/test_e2e_gpu.py::test_engine_with_cuda_graphs_generates_what_it_does_eagerly
    tail -3 "$OUT/tests.log"
fi
step decode_ab 330 python3 -m bench.decode_ab --models "${MODELS:-gpt-oss-120b,gpt-oss-20b}" \
    --variants fp8-dense,fp8-dense-late-routing,fp8-dense-late-epilogues,fp8-dense-late-down,fp8-dense-late-attention,fp8-dense-late-slab \
    --rounds "${ROUNDS:-3}" --batches 1,4 --max-batch 4 --out "$OUT/decode_ab_early_routing_h200.json"
pack_logs
grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A7 "decode step (ms)" | head -24
