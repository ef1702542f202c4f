#!/usr/bin/env bash
# Source at the start of a device call (repo root on the GPU machine):  source scripts/device_env.sh
# Sets up, from what `carry` brought:
#  - .whl/*.whl (flashinfer-python, apache-tvm-ffi, ...) installed into /tmp/site, on PYTHONPATH;
#  - FlashInfer's sink-prefill modules: prebuilt ones from .jit/*.tgz (<name>/<name>.so), else built
#    now in parallel (FI_BUILD=1, in the background: wait on $FI_PID) and packed into
#    $OUT/flashinfer_jit.tgz for the next call's .jit/;
#  - deep_gemm (only with DG_USE=1: the from-source build segfaults in its first GEMM on the H200,
#    2026-11-30): a built package from .dg_src/dg_site.tgz, else (DG_BUILD=1) built from source with
#    scripts/build_deep_gemm.sh in the background (wait on $DG_PID), packed into $OUT/dg_site.tgz;
#  - Triton and DeepGEMM JIT caches from .jit/jit_cache*.t?z into /tmp/jit (pack_jit_cache writes
#    $OUT/jit_cache_triton.txz and $OUT/jit_cache_deep_gemm.txz for the next call: one file each, xz, as a
#    file over 16 MiB does not come back; the single jit_cache.tgz had outgrown it by 2026-11-30).
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/jit/triton \
    DG_JIT_CACHE_DIR=/tmp/jit/deep_gemm
# DeepGEMM finds nvcc through CUDA_HOME (a wrapper nvcc on PATH would point it at /usr/local).
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LOGS=/tmp/logs  # setup logs; pack_logs puts them in $OUT/logs.tgz (a call returns at most 8 files)
mkdir -p "$OUT" "$LOGS" /tmp/site /tmp/jit/triton /tmp/jit/deep_gemm /tmp/dg_site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$LOGS/pip.log"; }
export PYTHONPATH=/tmp/dg_site:/tmp/site:$PWD:${PYTHONPATH:-}
for t in .jit/jit_cache*.t?z; do [ -f "$t" ] && tar xf "$t" -C /tmp/jit; done
# FlashInfer loads a module from its AOT folder without invoking ninja.
AOT=/tmp/site/flashinfer/data/aot
mkdir -p "$AOT"
for t in .jit/flashinfer*.tgz; do [ -f "$t" ] && tar xzf "$t" -C "$AOT"; done
FI_PID=""
if [ "${FI_BUILD:-0}" = 1 ] && [ -z "$(ls .jit/flashinfer*.tgz 2>/dev/null)" ]; then
    ( python3 - <<'PY'

import concurrent.futures, pathlib, shutil, tarfile, time, os
from kernels.attention import flashinfer_ops
specs = flashinfer_ops.jit_specs(64, ("fa3",), with_decode=False)
start = time.time()
with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
    list(pool.map(lambda s: s.build(verbose=False), specs))
print(f"built {[s.name for s in specs]} in {time.time() - start:.0f} s")
with tarfile.open(os.environ["OUT"] + "/flashinfer_jit.tgz", "w:gz") as tar:
    for s in specs:
        so = next(pathlib.Path(flashinfer_ops.jit_cache_dir()).rglob(f"{s.name}.so"))
        tar.add(so, arcname=f"{s.name}/{s.name}.so")
print("packed", os.path.getsize(os.environ["OUT"] + "/flashinfer_jit.tgz"), "bytes")
PY
    ) > "$LOGS/flashinfer_build.log" 2>&1 &
    FI_PID=$!
fi
DG_PID=""
if [ "${DG_USE:-0}" != 1 ]; then
    :
elif [ -f .dg_src/dg_site.tgz ]; then
    tar xzf .dg_src/dg_site.tgz -C /tmp/dg_site
elif [ "${DG_BUILD:-0}" = 1 ] && [ -f .dg_src/deepgemm_src.tgz ]; then
    ( OUT=$LOGS bash scripts/build_deep_gemm.sh /tmp/dg_site > "$LOGS/dg_build_stdout.log" 2>&1 \
        && tar czf "$OUT/dg_site.tgz" -C /tmp/dg_site . ; echo "deep_gemm build exit $?" >> "$LOGS/dg_build_stdout.log" ) &
    DG_PID=$!
fi
# wait_builds: wait for the builds FI_BUILD=1 / DG_BUILD=1 started in the background (none: returns at once), with
# their logs' last lines. A measurement that needs FlashInfer or deep_gemm calls it first, so one call on a bare
# machine (a fresh checkout carries no .jit/flashinfer*.tgz or .dg_src/dg_site.tgz) builds, then measures.
wait_builds() {
    if [ -n "$FI_PID" ]; then wait "$FI_PID"; echo "flashinfer: $(tail -2 "$LOGS/flashinfer_build.log" | tr '\n' ' ')"; fi
    if [ -n "$DG_PID" ]; then wait "$DG_PID"; echo "deep_gemm: $(tail -1 "$LOGS/dg_build_stdout.log")"; fi
    FI_PID="" DG_PID=""
}
# step NAME SECONDS CMD...: run CMD under min(SECONDS, what LIMIT_S leaves of this call), log to $OUT/NAME.log
DEVICE_START=${DEVICE_START:-$(date +%s)}
left() { echo $(( ${LIMIT_S:-560} - ($(date +%s) - DEVICE_START) - 15 )); }
step() {
    local name=$1 secs=$2; shift 2
    local l; l=$(left)
    [ "$l" -lt "$secs" ] && secs=$l
    if [ "$secs" -le 5 ]; then echo "$name: skipped (no time left)"; return; fi
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $? after $(( $(date +%s) - DEVICE_START )) s"
}
pack_logs() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
# the GPU's memory in MiB (an H100 has ~80,000, an H200 ~143,000: a call without needs_h200 may get either)
gpu_mem_mib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1; }
pack_jit_cache() {
    local d
    for d in triton deep_gemm; do XZ_OPT=-6 tar cJf "$OUT/jit_cache_$d.txz" -C /tmp/jit "$d" 2>/dev/null; done
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
