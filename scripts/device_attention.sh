#!/usr/bin/env bash
# One device call for the attention work: install the carried wheels, make prebuilt FlashInfer
# modules (.jit/<name>/<name>.so, from scripts/prebuild_flashinfer_jit.py) loadable, run the GPU
# tests, then the benchmark. Logs and JSON go to $OUT. Usage (repo root): bash scripts/device_attention.sh [bench args]
set -u
OUT=${OUT:-/tmp/attention_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws  # modules not prebuilt are JIT-compiled here
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
# FlashInfer loads a module from its AOT folder without invoking ninja; keep only those that load here.
python3 - "$OUT/aot.log" <<'PY'
import pathlib, shutil, sys, traceback
import torch, tvm_ffi
torch.cuda.init()
aot = pathlib.Path("/tmp/site/flashinfer/data/aot")
for so in sorted(pathlib.Path(".jit").glob("*/*.so")):
    try:
        tvm_ffi.load_module(str(so))
    except Exception:  # report and fall back to JIT for this module
        open(sys.argv[1], "a").write(traceback.format_exc())
        print(f"prebuilt {so.parent.name} does not load here; it will be JIT-compiled")
        continue
    (aot / so.parent.name).mkdir(parents=True, exist_ok=True)
    shutil.copy(so, aot / so.parent.name)
    print(f"prebuilt: {so.parent.name}")
PY
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -ra -p no:cacheprovider ${TEST_ARGS:-tests/kernels/test_attention_gpu.py} 2>&1 \
  | tee "$OUT/tests.log" | tail -30
timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.attention --out "$OUT/attention_h200.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -45
