set -u
LIMIT_S=300
export DG_USE=1
source scripts/device_env.sh
step probe 280 python3 -m bench.batch_shape_probe --device cuda --model gpt-oss-20b --out "$OUT/batch_shape_probe_h200.json"
tail -40 "$OUT/probe.log"
