#!/usr/bin/env bash
# One device call for the per-pair epilogues' expert ids loaded with their rows (kernels/moe/epilogues_triton.IDS_FIRST;
# repo root on the GPU machine; carry .whl .jit): the MoE GPU tests, then bench.decode_ab against the "-serial-ids"
# variants (20b with every opt-in, 120b with FP8 dense layers).   LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 100 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_moe_gpu.py tests/kernels/test_mxfp4_decode_layer.py \
    -k "swiglu or combine or routed or layer or front or decode"
tail -n 3 "$OUT/tests.log"
step decode_20b 130 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense+mxfp4-8-serial-ids,fp8-dense+mxfp4-8 --out "$OUT/decode_ab_ids_first_20b_h200.json"
step decode_120b 160 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4 --rounds 2 --max-batch 4 \
    --variants fp8-dense-serial-ids,fp8-dense --out "$OUT/decode_ab_ids_first_120b_h200.json"
pack_logs
echo "---- summary"
grep -hE "ms/step" "$OUT"/decode_*.log
