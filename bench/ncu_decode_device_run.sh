#!/usr/bin/env bash
# One device call: Nsight Compute counters for the batch-1 decode step's streaming kernels
# (bench/ncu_decode_kernels.py). Repo root on the GPU machine, carry .whl:
#   LIMIT_S=560 bash bench/ncu_decode_device_run.sh [kernel-script args...]
# Writes under $OUT: timing.log (do_bench, cold L2), ncu_details.txt.gz (every section of every profiled
# launch), ncu_source_mxfp4.csv.gz / ncu_source_slab.csv.gz (per-SASS-instruction stall samples), logs.tgz.
set -u
LIMIT_S=${LIMIT_S:-560}
source scripts/device_env.sh
export MXFP4_CUDA_BUILD_DIR=/tmp/mxfp4_build
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
step build 240 python3 -c "from kernels.moe import mxfp4_cuda as mc; print(mc.build())"
tail -2 "$OUT/build.log"
step timing 120 python3 -m bench.ncu_decode_kernels --time "$@"
tail -8 "$OUT/timing.log"
step ncu 300 "$NCU" --clock-control none --set full -k "regex:mxfp4|_slab_gemv|_fp8_grouped" --launch-count 18 \
    -f -o /tmp/prof python3 -m bench.ncu_decode_kernels --calls 2 "$@"
tail -5 "$OUT/ncu.log"
"$NCU" -i /tmp/prof.ncu-rep --page details --print-units base 2>&1 | gzip > "$OUT/ncu_details.txt.gz"
"$NCU" -i /tmp/prof.ncu-rep --page raw --csv 2>&1 | gzip > "$OUT/ncu_raw.csv.gz"
for k in mxfp4 slab; do
    "$NCU" -i /tmp/prof.ncu-rep -k "regex:$k" --launch-count 1 --page source --csv --print-source sass 2>&1 \
        | gzip > "$OUT/ncu_source_$k.csv.gz"
done
ls -la "$OUT"
pack_logs
