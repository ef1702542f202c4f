set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
step slab 200 python3 -m bench.gemv_slab --shapes unembed --tokens 1,2 --configs 4,7,8,9,10 --out "$OUT/gemv_slab_unembed_h200.json"
step sweep 150 python3 -m bench.gemv_sweep --shapes unembed --tokens 1,2 --out "$OUT/gemv_fp8_unembed_h200.json"
tail -n 4 "$OUT/slab.log"; tail -n 6 "$OUT/sweep.log"
