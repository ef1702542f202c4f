#!/usr/bin/env bash
# One device call (repo root on the GPU machine; carry .whl .jit), 2026-12-03: the GPU tests of the engine step's
# work outside its CUDA graph (one-copy upload, the one-launch plan fill, the Triton greedy argmax) and the engine's
# graphs-vs-eager test; bench.engine_step_profile (each of MODELS, default 20b, with every decode opt-in); the end-to-end
# engine run at batch 1 (bench.e2e --engine-runs b1) of the same configuration.
#   MODELS="gpt-oss-20b gpt-oss-120b" NO_TESTS=1 PROFILE=0 bash bench/engine_overhead_device_run.sh
#   (120b: FP8 QKV / O / unembedding; PROFILE=0 skips bench.engine_step_profile, E2E=0 the bench.e2e run; PREFILL_LENS, default 1024: the
#   prompt lengths bench.e2e times first; DG_USE=1 with .dg_src carried: DeepGEMM's prefill GEMMs)
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
opts() {  # every decode opt-in for the model
    local o="--dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3"
    [ "$1" = gpt-oss-20b ] && o="$o --mxfp4-decode-max-tokens 8"
    echo "$o"
}
if [ "${NO_TESTS:-0}" != 1 ]; then
    step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py \
        tests/engine/test_e2e_gpu.py::test_engine_with_cuda_graphs_generates_what_it_does_eagerly \
        tests/kernels/test_attention_gpu.py -k "upload or fill_decode or argmax or eagerly or replays_in_a_cuda_graph or no_host_sync"
    tail -3 "$OUT/gpu_tests.log"
fi
for MODEL in ${MODELS:-gpt-oss-20b}; do
    TAG=${MODEL#gpt-oss-}
    [ "${PROFILE:-1}" = 1 ] && step esp_$TAG 200 python3 -m bench.engine_step_profile --model "$MODEL" $(opts $MODEL) \
        --out "$OUT/engine_step_profile_${TAG}_h200.json" && tail -c 1200 "$OUT/esp_$TAG.log"
    [ "${E2E:-1}" = 1 ] && step e2e_$TAG 330 python3 -m bench.e2e --device cuda --models "$MODEL" --prefill-lens "${PREFILL_LENS:-1024}" --contexts 1024 \
        --max-batch 1 --engine-runs b1 --model-share 1.0 --headroom-gb 6 --budget-s 300 $(opts $MODEL) \
        --out "$OUT/e2e_h200_${TAG}_b1.json"
    [ -f "$OUT/e2e_$TAG.log" ] && grep -E "engine run|decode b=1|Error" "$OUT/e2e_$TAG.log" | tail -4
done
pack_jit_cache
