#!/usr/bin/env bash
# One device call for the MoE combine inside the next norm (Fp8Experts.defer_combine; repo root on the GPU machine;
# carry .whl .jit): its GPU tests, then the decode A/B (own-combine variants as baselines) on 20b with every
# opt-in and on 120b with the FP8 dense layers, and the eager prefill A/B (bench.prefill_ab --variants combine).
#   bash bench/combine_norm_device_run.sh        LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step tests 120 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_layers_gpu.py \
    "tests/kernels/test_moe_gpu.py::test_deferred_combine_in_the_next_norm_changes_nothing" \
    "tests/kernels/test_mxfp4_decode_layer.py::test_layer_matches_twin_and_beats_fp8_against_the_reference"
tail -n 3 "$OUT/tests.log"
step decode_20b 150 python3 -m bench.decode_ab --models gpt-oss-20b --batches 1,4,16 --rounds 3 \
    --variants fp8-dense+mxfp4-8-own-combine,fp8-dense+mxfp4-8 --out "$OUT/decode_ab_combine_norm_20b_h200.json"
step decode_120b 170 python3 -m bench.decode_ab --models gpt-oss-120b --batches 1,4,16 --rounds 2 \
    --variants fp8-dense-own-combine,fp8-dense --out "$OUT/decode_ab_combine_norm_120b_h200.json"
step prefill_20b 90 python3 -m bench.prefill_ab --model gpt-oss-20b --lens 4096 --variants combine --rounds 3 \
    --out "$OUT/prefill_ab_combine_20b_h200.json"
pack_logs
echo "---- summary"
grep -E "^\[|x[0-9]\.[0-9]{2}" "$OUT/decode_20b.log" | tail -n 8
grep -E "x[0-9]\.[0-9]{2}" "$OUT/decode_120b.log" | tail -n 4
tail -n 8 "$OUT/prefill_20b.log"
