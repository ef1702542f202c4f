#!/usr/bin/env bash
# One device call for the engine warm-up (repo root on the GPU machine; carry .whl, and .jit once it holds
# flashinfer_jit.tgz; FI_BUILD=1 builds FlashInfer's sink modules when .jit has none, packed into $OUT):
#  1. while FlashInfer builds: the kernel GPU tests named in KERNEL_TESTS (default: MoE and layers);
#  2. python -m bench.warm_up_probe on 20b: cold vs warmed-up engine, each in a fresh process with empty
#     Triton / DeepGEMM caches; the table printed last; the capture's Triton cache packed for the next call;
#  3. the engine's GPU tests (ENGINE_TESTS, default tests/engine/test_e2e_gpu.py; empty skips).
#   FI_BUILD=1 bash bench/warm_up_device_run.sh          LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
KERNEL_TESTS=${KERNEL_TESTS-tests/kernels/test_moe_gpu.py tests/kernels/test_layers_gpu.py}
[ -n "$KERNEL_TESTS" ] && step kernel_tests "${KERNEL_S:-200}" python3 -m pytest -q -ra -p no:cacheprovider $KERNEL_TESTS
[ -n "$FI_PID" ] && { wait "$FI_PID"; echo "flashinfer: $(tail -2 "$LOGS/flashinfer_build.log" | tr '\n' ' ')"; }
step probe "${PROBE_S:-300}" python3 -m bench.warm_up_probe --model gpt-oss-20b --out "$OUT/warm_up_probe_20b_h200.json" \
    --cache-out "$OUT/jit_cache_triton.txz" ${PROBE_ARGS:-}
ENGINE_TESTS=${ENGINE_TESTS-tests/engine/test_e2e_gpu.py}
[ -n "$ENGINE_TESTS" ] && step engine_tests "${ENGINE_S:-200}" python3 -m pytest -q -ra -p no:cacheprovider $ENGINE_TESTS
pack_logs
echo "---- summary"
for f in kernel_tests engine_tests; do [ -f "$OUT/$f.log" ] && echo "$f: $(tail -1 "$OUT/$f.log")"; done
grep -hE "Error|error" "$OUT/probe.log" | tail -5
tail -5 "$OUT/probe.log"
