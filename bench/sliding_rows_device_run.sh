#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit .dg_src), 2026-12-03: the sliding-window prefill
# kernel over the step's own k / v rows and with 16-key tail steps (kernels/attention/sliding_prefill_triton.py).
#  1. GPU tests: attention (the kernel's launch shapes incl. the tails, the backend over bf16 / fp8 caches and fresh
#     prompts, which take the rows), the prefill graphs' replay against their eager pieces, the Triton argmax, the
#     decode front and the norms (their weights loaded before the PDL wait);
#  2. bench.attention --prefill-only at 4k / 8k: the kernel over bf16 pages, fp8 pages and rows, per launch shape;
#  3. bench.prefill_ab --variants sliding-rows (pages / rows, tail or not, each under its own prefill graphs) on
#     120b 8k and 20b 4k with FP8 QKV / O, ROUNDS rounds (default 3), with DeepGEMM when it is there.
#   DG_USE=1 DG_BUILD=1 bash bench/sliding_rows_device_run.sh     (DG_BUILD: build DeepGEMM from .dg_src meanwhile)
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
if [ "${NO_TESTS:-0}" != 1 ]; then
    step tests 170 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_attention_gpu.py \
        "tests/engine/test_e2e_gpu.py::test_prefill_graphs_replay_what_their_pieces_do_eagerly"
    tail -3 "$OUT/tests.log"
    step tests_more 90 python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_engine_gpu.py \
        tests/kernels/test_moe_gpu.py tests/kernels/test_layers_gpu.py -k "argmax or front or norm"
    tail -2 "$OUT/tests_more.log"
fi
step attention 120 python3 -m bench.attention --prefill-only --prefill-lens "${ATTN_LENS:-4096,8192}" \
    --out "$OUT/attention_sliding_rows_h200.json"
if [ -n "$DG_PID" ]; then wait "$DG_PID"; tail -2 "$LOGS/dg_build_stdout.log"; fi
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__file__)" 2>&1 | tail -1
for spec in ${AB:-gpt-oss-120b:8192 gpt-oss-20b:4096}; do
    MODEL=${spec%%:*}; LEN=${spec##*:}; TAG=${MODEL#gpt-oss-}
    step ab_$TAG 240 python3 -m bench.prefill_ab --model "$MODEL" --lens "$LEN" --variants sliding-rows \
        --rounds "${ROUNDS:-3}" --dense-dtype fp8_e4m3 --kv-cache-dtype "${KV:-auto}" \
        --out "$OUT/prefill_ab_sliding_rows_${TAG}_h200.json"
    grep -E "^tokens=" "$OUT/ab_$TAG.log" | tail -1
done
pack_jit_cache; pack_logs
echo "---- summary"
grep -E "^prefill triton" "$OUT/attention.log" | grep "window=128" | tail -30
