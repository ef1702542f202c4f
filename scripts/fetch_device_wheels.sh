#!/usr/bin/env bash
# The `.whl/` folder the lent H200 installs from (scripts/device_env.sh): FlashInfer 0.5.3, apache-tvm-ffi and the
# small pure dependencies FlashInfer imports, for the device's Python 3.12 on manylinux x86_64 (~12 MB; the carry
# limit is 64 MiB). torch, triton, numpy and the CUDA runtimes are the device's own. Left out on purpose:
# nvidia-cudnn-frontend (11.6 MB; FlashInfer imports it only inside try blocks) and nvidia-cutlass-dsl (large).
# `.whl/` is git-ignored, so a fresh checkout has none: run this (needs a package index), then carry ".whl".
#   bash scripts/fetch_device_wheels.sh [DEST]         default DEST=.whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
    flashinfer-python==0.5.3 "apache-tvm-ffi==0.1.15.post2" click einops ninja nvidia-ml-py packaging requests \
    tabulate tqdm urllib3 idna certifi charset-normalizer
ls "$DEST"/*.whl | wc -l | xargs echo "wheels in $DEST:"
du -sh "$DEST"
