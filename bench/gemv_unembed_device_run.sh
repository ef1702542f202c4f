#!/usr/bin/env bash
# One device call for the FP8 unembedding GEMV (repo root on the GPU machine; carry .whl .jit):
#   STAGE=sweep: bench.gemv_slab and bench.gemv_sweep on the unembedding shape at T = 1, 2;
#   STAGE=step (default): the FP8 linear GPU tests, then bench.decode_ab on 20b with every opt-in and on 120b with the
#   FP8 dense layers, each against its "-lm-head-64" variant (the unembedding on QKV / O's config, as before 2026-12-03).
#   bash bench/gemv_unembed_device_run.sh        LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
if [ "${STAGE:-step}" = sweep ]; then
    step slab 200 python3 -m bench.gemv_slab --shapes unembed --tokens 1,2 --configs 4,7,8,9,10 --out "$OUT/gemv_slab_unembed_h200.json"
    step sweep 150 python3 -m bench.gemv_sweep --shapes unembed --tokens 1,2 --out "$OUT/gemv_fp8_unembed_h200.json"
    tail -n 4 "$OUT/slab.log"; tail -n 6 "$OUT/sweep.log"
    exit 0
fi
step tests 90 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_layers_gpu.py -k "fp8_linear or fp8_gemv"
tail -n 2 "$OUT/tests.log"
step decode_20b 200 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense+mxfp4-8-lm-head-64,fp8-dense+mxfp4-8 --out "$OUT/decode_ab_lm_head_config_20b_h200.json"
step decode_120b 200 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense-lm-head-64,fp8-dense --out "$OUT/decode_ab_lm_head_config_120b_h200.json"
pack_logs
echo "---- summary"
grep -E "ms/step" "$OUT/decode_20b.log" "$OUT/decode_120b.log"
