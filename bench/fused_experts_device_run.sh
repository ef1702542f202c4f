#!/usr/bin/env bash
# One device call for the FP8 decode experts in one launch (csrc/fp8_decode_experts.cu; repo root on the GPU
# machine; carry .whl .jit .dg_src):
#  1. build the extension (returned as $OUT/fde_build.tgz; carried in .jit/ it is reused: FDE_PREBUILT);
#  2. its GPU tests (tests/kernels/test_fp8_decode_experts.py);
#  3. python -m bench.fused_experts_probe (the experts alone, one launch per ring depth vs three; occupancy),
#     then python -m bench.moe at T = MOE_TOKENS (default 1,2,4,8): the layer as the decode step runs it, three
#     launches (fp8_routed) against one (fp8_fused), with the other variants of that bench;
#  4. python -m bench.decode_ab over MODELS: fused+pdl against fused-experts at BATCHES (default 1,2,4,8).
#   DG_USE=1 LIMIT_S=580 bash bench/fused_experts_device_run.sh      (SKIP_MOE=1 / SKIP_AB=1 leave 3 / 4 out)
set -u
LIMIT_S=${LIMIT_S:-560}
source scripts/device_env.sh
export FP8_DECODE_EXPERTS_BUILD_DIR=/tmp/fde_build
mkdir -p "$FP8_DECODE_EXPERTS_BUILD_DIR"
[ -f .jit/fde_build.tgz ] && tar xzf .jit/fde_build.tgz -C "$FP8_DECODE_EXPERTS_BUILD_DIR"
step build 240 python3 -c "from kernels.moe import fp8_decode_experts as m; print(m.build())"
tail -3 "$OUT/build.log"
tar czf "$OUT/fde_build.tgz" -C "$FP8_DECODE_EXPERTS_BUILD_DIR" . 2>/dev/null
step gpu_tests 180 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_fp8_decode_experts.py ${EXTRA_TESTS:-}
tail -6 "$OUT/gpu_tests.log"
[ "${PROBE:-1}" = 1 ] && step probe 120 python3 -m bench.fused_experts_probe --out "$OUT/fused_experts_probe_h200.json"
[ "${SKIP_MOE:-0}" = 1 ] || step moe 200 python3 -m bench.moe --tokens "${MOE_TOKENS:-1,2,4,8}" --skip gemm,dense,decode \
    --out "$OUT/moe_fused_experts_h200.json"
[ "${SKIP_AB:-0}" = 1 ] || step decode_ab "$(left)" python3 -m bench.decode_ab --models "${MODELS:-gpt-oss-20b,gpt-oss-120b}" \
    --variants fused+pdl,fused-experts --batches "${BATCHES:-1,2,4,8}" --max-batch 8 \
    --out "$OUT/decode_ab_fused_experts_h200.json" ${DECODE_ARGS:-}
pack_jit_cache; pack_logs
[ -f "$OUT/probe.log" ] && tail -8 "$OUT/probe.log"
[ -f "$OUT/moe.log" ] && grep -E "fp8_routed|fp8_fused" "$OUT/moe.log" | head -20
[ -f "$OUT/decode_ab.log" ] && grep -vE "Warn|warn" "$OUT/decode_ab.log" | grep -A12 "decode step (ms)" | head -30
exit 0
