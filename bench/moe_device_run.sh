#!/usr/bin/env bash
# One device call for the kernel work (repo root on the GPU machine; carry .whl .jit .dg_src):
#  1. scripts/device_env.sh: wheels; FlashInfer modules and deep_gemm, built now when not carried
#     (deep_gemm from source against the host's torch: scripts/build_deep_gemm.sh);
#  2. the Triton kernel GPU tests (layers, MoE) while those build; DeepGEMM's tests once it is built;
#  3. python -m bench.moe with the given args (e.g. --quick --skip gemm,dense);
#  4. what to carry next time comes back in $OUT: flashinfer_jit.tgz and dg_site.tgz (-> .jit/ and
#     .dg_src/), jit_cache.tgz (Triton + DeepGEMM kernels -> .jit/).
#   bash bench/moe_device_run.sh [bench.moe args]        LIMIT_S (default 560) bounds the whole call
set -u
LIMIT_S=${LIMIT_S:-560}
start=$(date +%s)
left() { echo $(( LIMIT_S - ($(date +%s) - start) )); }
FI_BUILD=${FI_BUILD:-1} DG_BUILD=${DG_BUILD:-1} DG_USE=${DG_USE:-1} source scripts/device_env.sh
timeout 300 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_layers_gpu.py tests/kernels/test_moe_gpu.py \
    > "$LOGS/tests_triton.log" 2>&1
echo "triton kernel tests exit $? at $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/tests_triton.log")"
[ -n "$DG_PID" ] && wait "$DG_PID"
tail -2 "$LOGS/dg_build_stdout.log" 2>/dev/null
timeout 120 python3 -m bench.moe --probe 2>&1 | tail -3
if python3 -c "from kernels.moe import deep_gemm_ops as d; raise SystemExit(0 if d.available() else 1)" 2>/dev/null; then
    timeout $(( $(left) / 3 )) python3 -m pytest -q -ra -p no:cacheprovider -k "deep_gemm or decode_path" \
        tests/kernels/test_moe_gpu.py > "$LOGS/tests_deep_gemm.log" 2>&1
    echo "deep_gemm tests exit $? at $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/tests_deep_gemm.log")"
fi
timeout $(( $(left) - 40 )) python3 -m bench.moe --out "$OUT/moe_h200.json" "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? at $(( $(date +%s) - start )) s"
[ -n "$FI_PID" ] && { timeout 20 tail --pid="$FI_PID" -f /dev/null; tail -2 "$LOGS/flashinfer_build.log"; }
pack_jit_cache; pack_logs
grep -E "FAILED|Error" "$OUT/bench.log" | head -5
grep -E "^decode GEMM .*best|^ *(20b|120b) " "$OUT/bench.log" | tail -30
