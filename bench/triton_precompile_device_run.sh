#!/usr/bin/env bash
# One device call for engine/triton_precompile.py (repo root on the GPU machine; carry .whl .jit):
#  1. tests/engine/test_triton_precompile_gpu.py (recorded specializations, precompiled in worker processes,
#     are cache hits for the next launch);
#  2. python -m bench.triton_precompile_probe for each model in MODELS (default gpt-oss-20b gpt-oss-120b): record
#     the manifest over an empty Triton cache, then a fresh process over another empty cache with it; the manifests
#     come back as $OUT/<model>.json (for engine/triton_manifests/).
#   LIMIT_S=560 bash bench/triton_precompile_device_run.sh
#   PROBE_ARGS=--shipped SUFFIX=_shipped ...: the precompile phase only, over engine/triton_manifests
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
echo "cpus: $(nproc)"
step gpu_tests "${TEST_S:-150}" python3 -m pytest -q -ra -p no:cacheprovider tests/engine/test_triton_precompile_gpu.py
for m in ${MODELS:-gpt-oss-20b gpt-oss-120b}; do
    step "probe_$m" "${PROBE_S:-300}" python3 -m bench.triton_precompile_probe --model "$m" --timeout-s "${PHASE_S:-200}" --kv-cache-gib "${KV_GIB:-6}" \
        --out "$OUT/triton_precompile_probe_${m#gpt-oss-}${SUFFIX:-}_h200.json" --manifest-out "$OUT/$m.json" ${PROBE_ARGS:-}
    tail -12 "$OUT/probe_$m.log"
done
pack_logs
echo "---- summary"
tail -3 "$OUT/gpu_tests.log"
