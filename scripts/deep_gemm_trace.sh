#!/usr/bin/env bash
# Where does a deep_gemm build crash? Runs scripts/deep_gemm_smoke.py with scripts/segv_trace.c preloaded
# and resolves the frames inside deep_gemm's _C with addr2line. Needs the build unpacked at $1.
#   bash scripts/deep_gemm_trace.sh /tmp/dg_site      (after `source scripts/device_env.sh`)
set -u
SITE=${1:-/tmp/dg_site}
gcc -shared -fPIC -O1 -o /tmp/segv_trace.so scripts/segv_trace.c || exit 1
SO=$(ls "$SITE"/deep_gemm/_C*.so)
PYTHONPATH=$SITE:$PYTHONPATH LD_PRELOAD=/tmp/segv_trace.so timeout 120 python3 -m scripts.deep_gemm_smoke > /tmp/dg_trace.log 2>&1
echo "smoke exit $?"
grep -E "^-> |ok:|Error|error" /tmp/dg_trace.log | tail -8
sed -n '/native backtrace/,/proc\/self\/maps/p' /tmp/dg_trace.log | head -40
for off in $(grep -oE "_C[^(]*\(\+0x[0-9a-f]+\)" /tmp/dg_trace.log | grep -oE "0x[0-9a-f]+"); do
    addr2line -f -C -i -e "$SO" "$off" | paste -sd' ' | cut -c1-300
done
