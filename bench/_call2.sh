set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_e2e_gpu.py tests/kernels/test_attention_gpu.py -k "upload or fill_decode or graph or engine or replay or e2e"
tail -5 "$OUT/gpu_tests.log"
step esp20 240 python3 -m bench.engine_step_profile --model gpt-oss-20b --dense-dtype fp8_e4m3 --lm-head-dtype fp8_e4m3 --mxfp4-decode-max-tokens 8 --out "$OUT/engine_step_profile_20b_one_copy_h200.json"
pack_jit_cache
tail -c 2500 "$OUT/esp20.log"
