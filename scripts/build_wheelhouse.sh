#!/usr/bin/env bash
# Offline wheelhouse for GPU hosts without registry access: this project's dependencies with the
# [gpu] extra (flashinfer-python, apache-tvm-ffi and what they pull in; DeepGEMM is built from source), as wheels
# for the hosts' Python and platform. Left out: torch, triton and the CUDA runtime wheels that the
# host's own CUDA build of torch brings (a registry torch would be a different, multi-GB build).
#
#   scripts/build_wheelhouse.sh [DEST]           # default DEST=wheelhouse; PYTHON_VERSION=3.12
#   scripts/build_wheelhouse.sh --resolve-only   # print the pinned list, download nothing
#
# On the GPU host (torch already installed):
#   pip install --no-index --find-links DEST -e ".[gpu]"
# then prebuild FlashInfer's JIT modules once: python -m scripts.prebuild_flashinfer_jit
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-wheelhouse}
PYV=${PYTHON_VERSION:-3.12}
PLATFORM=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORM+=(--platform "$p")
done
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT
# Resolve the whole set for the target interpreter without installing anything.
python3 -m pip install -q --dry-run --ignore-installed --only-binary=:all: --python-version "$PYV" \
  "${PLATFORM[@]}" --target "$(mktemp -d)" --report "$REPORT" ".[gpu]"
PINS=$(python3 - "$REPORT" <<'PY'
import json, re, sys
# torch's own stack comes with the host's torch; the nvidia-* packages named below are not CUDA
# runtimes and stay in.
host_provided = re.compile(r"^(torch|triton|nvidia-(?!ml-py|cudnn-frontend|cutlass-dsl).*)$")
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if item.get("is_direct") or host_provided.match(name):
        continue
    print(f"{name}=={meta['version']}")
PY
)
if [ "$DEST" = "--resolve-only" ]; then
  echo "$PINS"
  exit 0
fi
mkdir -p "$DEST"
echo "$PINS" > "$DEST/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" "${PLATFORM[@]}" \
  -d "$DEST" -r "$DEST/requirements.txt"
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST (pins in $DEST/requirements.txt)"
