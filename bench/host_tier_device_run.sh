#!/usr/bin/env bash
# One device call for the prefix cache's host tier and the tenant-salted prefix cache (repo root on the GPU
# machine; carry .whl .jit .whl_struct): what a large host tier's registration costs at replica start, 120b
# conversations outgrowing the GPU pool (GPU cache alone against GPU + host tier, and the copy rate), 20b's
# shared-prefix TTFT with the cache off / on / salted per tenant, then the GPU tests while time is left.
#   LIMIT_S=560 bash bench/host_tier_device_run.sh
set -u
LIMIT_S=${LIMIT_S:-560}
source scripts/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_struct/*.whl \
    > "$LOGS/pip_struct.log" 2>&1 || { echo "serve wheels failed"; tail -5 "$LOGS/pip_struct.log"; }
free -g | head -2
step host_tier_120b 260 python3 -m bench.host_kv_tier --model gpt-oss-120b --modes gpu,gpu+host \
    --register-gib 16,48 --out "$OUT/host_kv_tier_120b_h200.json"
tail -9 "$OUT/host_tier_120b.log"
[ "${HOST_TIER_ONLY:-0}" = 1 ] && { pack_logs; exit 0; }
step prefix_tenants_20b 120 python3 -m bench.prefix_cache --model gpt-oss-20b --tenants 4 \
    --out "$OUT/prefix_cache_tenants_20b_h200.json"
tail -8 "$OUT/prefix_tenants_20b.log"
# (ray is not on the device: the two engine test files that import it cannot be collected)
step gpu_tests 400 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/engine tests/kernels \
    --ignore=tests/engine/test_parallel_ray.py --ignore=tests/engine/test_decode_front_choice.py
tail -8 "$OUT/gpu_tests.log"
pack_logs
