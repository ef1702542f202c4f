#!/usr/bin/env bash
# One device call for the FP8 sink prefill probe (repo root on the GPU machine; carry .whl, and .jit if built):
# FlashInfer's bf16 fa3 sink modules (FI_BUILD=1 when .jit has none) and the FP8 sink single-prefill module build
# in parallel; then the per-head quantizer's GPU tests and bench.fp8_sink_prefill_probe. The FP8 module comes back
# as $OUT/flashinfer_fp8_sink.tgz (carry it in .jit/ next time).
#   FI_BUILD=1 bash bench/fp8_sink_prefill_device_run.sh        LIMIT_S (default 560) bounds the whole script
set -u
DEVICE_START=$(date +%s)
source scripts/device_env.sh
python3 - > "$LOGS/fp8_build.log" 2>&1 <<'PY' &
import os, pathlib, tarfile, time
from bench.fp8_sink_prefill_probe import fp8_single_spec
from kernels.attention import flashinfer_ops
spec, start = fp8_single_spec(), time.time()
spec.build(verbose=False)
print(f"built {spec.name} in {time.time() - start:.0f} s")
so = next(pathlib.Path(flashinfer_ops.jit_cache_dir()).rglob(f"{spec.name}.so"))
with tarfile.open(os.environ["OUT"] + "/flashinfer_fp8_sink.tgz", "w:gz") as tar:
    tar.add(so, arcname=f"{spec.name}/{spec.name}.so")
PY
FP8_PID=$!
[ -n "$FI_PID" ] && wait "$FI_PID"
wait "$FP8_PID"
tail -n 2 "$LOGS"/flashinfer_build.log "$LOGS/fp8_build.log" 2>/dev/null
step tests 60 python3 -m pytest -q -ra -p no:cacheprovider tests/kernels/test_fp8_heads.py
tail -n 2 "$OUT/tests.log"
step probe 300 python3 -m bench.fp8_sink_prefill_probe --out "$OUT/fp8_sink_prefill_probe_h200.json"
pack_logs  # (no Triton cache: a call returns at most 8 files)
echo "---- summary"
tail -n 12 "$OUT/probe.log"
