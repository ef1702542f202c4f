#!/usr/bin/env bash
# One device call that measures the prefill SwiGLU tiles reading (gate, up) pairs as int32 words and the SFU
# sigmoid (Fp8Experts.swiglu_words / swiglu_mufu, the defaults since 2026-12-06, measured then on an H100 only;
# kernels/moe/NOTES.md, item 5). Repo root on the GPU machine; carry .whl .jit .dg_src (120b needs the H200's
# memory: kind nvidia-h200, needs_h200). Builds what .jit / .dg_src lack in the background (FlashInfer's sink
# modules, DeepGEMM; the 20b step took > 100 s on a bare machine) while bench.swiglu_ab and bench.dispatch_ab (the
# dispatch quantization by launch shape) run, then: the SwiGLU / layer GPU tests, bench.prefill_ab --variants
# swiglu-mufu at 120b 8k (FP8 QKV / O, ROUNDS rounds; H200 only), the engine's GPU tests against its torch twin, and
# last the same A/B at 20b 4k. $OUT gets results.tgz (the JSON and logs), logs.tgz and what was built
# (flashinfer_jit.tgz, dg_site.tgz, JIT caches).
#   LIMIT_S=560 bash bench/swiglu_device_run.sh
set -u
DEVICE_START=$(date +%s)
export FI_BUILD=${FI_BUILD:-1} DG_USE=${DG_USE:-1} DG_BUILD=${DG_BUILD:-1}
source scripts/device_env.sh
step swiglu_ab 90 python3 -m bench.swiglu_ab --out "$OUT/swiglu_ab_mufu.json"
step dispatch_ab 60 python3 -m bench.dispatch_ab --out "$OUT/dispatch_ab.json"
wait_builds
step gpu_tests 150 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py \
    -k "swiglu or layer_matches_bf16 or dispatch_swiglu"
tail -4 "$OUT/gpu_tests.log"
if [ "${PREFILL:-1}" = 1 ]; then  # PREFILL=0 FI_BUILD=0 DG_USE=0: the kernel A/B and the tests alone, no builds
MEM_MIB=$(gpu_mem_mib)
if [ "${MEM_MIB:-0}" -lt 120000 ]; then echo "prefill_120b: skipped (120b's FP8 experts need the H200's memory)"; else
step prefill_120b 200 python3 -m bench.prefill_ab --model gpt-oss-120b --lens 8192 --variants swiglu-mufu \
    --dense-dtype fp8_e4m3 --rounds "${ROUNDS:-3}" --out "$OUT/prefill_ab_swiglu_mufu_120b_h200.json"; fi
fi
# the engine on the GPU kernels with the SwiGLU defaults of 2026-12-06 (words + MUFU), against its torch twin
step e2e_gpu 150 python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_e2e_gpu.py \
    -k "twin or prefill_graphs or generates_what"
tail -3 "$OUT/e2e_gpu.log"
# the 20b forward last (measured on an H100 before; the engine check above comes first)
[ "${PREFILL:-1}" = 1 ] && step prefill_20b 200 python3 -m bench.prefill_ab --model gpt-oss-20b --lens 4096 \
    --variants swiglu-mufu --dense-dtype fp8_e4m3 --rounds "${ROUNDS:-3}" --out "$OUT/prefill_ab_swiglu_mufu_20b.json"
pack_jit_cache; pack_logs
echo "---- summary"
grep -E "contiguous|T=1|4k|8k" "$OUT/swiglu_ab.log" | tail -6
grep -E "MB;|kb8 w4|DIFFERS" "$OUT/dispatch_ab.log"
tail -n 12 "$OUT/prefill_20b.log" "$OUT/prefill_120b.log" 2>/dev/null
# at most 8 files come back: the step logs and JSON in one archive beside the builds and the JIT caches
(cd "$OUT" && tar czf results.tgz -- *.log *.json && rm -f -- *.log *.json)
ls "$OUT"
