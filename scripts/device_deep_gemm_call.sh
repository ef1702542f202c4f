#!/usr/bin/env bash
# One device call: deep_gemm build variants (scripts/deep_gemm_variants.sh); with a working one, the
# DeepGEMM GPU tests and python -m bench.moe (args passed through), the build back as $OUT/dg_site.tgz.
set -u
S=$(date +%s)
source scripts/device_env.sh
python3 -c "import torch; print(torch.__config__.show())" | grep -i -E "gcc|compiler" | head -2
W=$(bash scripts/deep_gemm_variants.sh)
echo "working variant: ${W:-none} at $(( $(date +%s) - S )) s"
if [ -n "$W" ]; then
    tar czf "$OUT/dg_site.tgz" -C /tmp/dgs_$W .
    export PYTHONPATH=/tmp/dgs_$W:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/jit/deep_gemm
    timeout 150 python3 -m pytest -q -ra -p no:cacheprovider -k "deep_gemm or layer" tests/kernels/test_moe_gpu.py \
        > "$LOGS/tests_dg.log" 2>&1
    echo "deep_gemm tests: $(tail -1 "$LOGS/tests_dg.log") at $(( $(date +%s) - S )) s"
    grep -E "^FAILED" "$LOGS/tests_dg.log" | head -5
    for i in $(seq 0 7); do timeout 150 python3 -m bench.moe --warmup-shard "$i/8" "$@" >> "$LOGS/warmup.log" 2>&1 & done
    wait
    echo "warm-up done at $(( $(date +%s) - S )) s"
    timeout $(( 560 - ($(date +%s) - S) )) python3 -m bench.moe --out "$OUT/moe_h200.json" "$@" > "$OUT/bench.log" 2>&1
    echo "bench exit $? at $(( $(date +%s) - S )) s"
    grep -E "^ *(20b|120b) |^gate_up" "$OUT/bench.log" | tail -24
fi
pack_jit_cache; pack_logs
