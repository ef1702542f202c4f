#!/usr/bin/env bash
# Build DeepGEMM (the `deep_gemm` module) from source on the GPU host, against that host's own torch,
# so that its _C extension matches torch's C++ ABI (the prebuilt sgl-deep-gemm wheels do not on torch 2.11).
#
#   bash scripts/build_deep_gemm.sh [TARGET]     # from the repo root; default TARGET=/tmp/dg_site
#   then: export PYTHONPATH=TARGET:$PYTHONPATH   # put it before any other dir holding a deep_gemm
#
# Input: .dg_src/deepgemm_src.tgz (git-ignored; DeepGEMM/ with third-party/cutlass/include and
# third-party/fmt/include at the submodule pins, see DeepGEMM/DG_SOURCE.txt inside). Nothing is fetched.
# The extension is one C++ file (csrc/python_api.cpp, pybind11 + torch headers), compiled by setuptools'
# plain build_ext with torch's CUDAExtension settings (no nvcc, no ninja at build time); the GEMM
# kernels are JIT-compiled at run time with nvcc (or NVRTC, DG_JIT_USE_NVRTC=1) from the headers this
# build copies into TARGET/deep_gemm/include (deep_gemm, cute, cutlass). No apache-tvm-ffi is involved.
# Build tools missing from the interpreter (setuptools, wheel, packaging) are taken from
# .dg_src/wheels if present. Env: PYTHON (default python3), CUDA_HOME, MAX_JOBS (default nproc),
# DG_BUILD_ROOT (default /tmp/dg_build), DG_SRC_TGZ, OUT (full log copied to $OUT/dg_build.log),
# DG_DRY_RUN=1 (no CUDA: skip the extension and the import check; checks the layout only).
set -euo pipefail

TARGET=${1:-/tmp/dg_site}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC_TGZ=${DG_SRC_TGZ:-$REPO/.dg_src/deepgemm_src.tgz}
WHEELS=$REPO/.dg_src/wheels
BUILD_ROOT=${DG_BUILD_ROOT:-/tmp/dg_build}
PY=${PYTHON:-python3}
DRY=${DG_DRY_RUN:-0}
LOG=$BUILD_ROOT.log          # outside BUILD_ROOT, which is wiped below
T0=$(date +%s)

stamp() { echo "[dg-build +$(( $(date +%s) - T0 ))s] $*"; }
copy_log() { if [[ -n "${OUT:-}" && -f "$LOG" ]]; then mkdir -p "$OUT" && cp -f "$LOG" "$OUT/dg_build.log" || true; fi; }
die() {
  echo "ERROR: $*" >&2
  if [[ -f "$LOG" ]]; then echo "---- last 80 lines of $LOG ----" >&2; tail -n 80 "$LOG" >&2; fi
  copy_log
  exit 1
}
trap 'rc=$?; if (( rc != 0 )); then copy_log; echo "build_deep_gemm.sh FAILED (exit $rc) after $(( $(date +%s) - T0 ))s" >&2; fi' EXIT

: > "$LOG"
[[ -f "$SRC_TGZ" ]] || die "missing $SRC_TGZ (assemble it first; see the header of this script)"
command -v "$PY" >/dev/null || die "no interpreter '$PY'"

# ---- 1. sources -------------------------------------------------------------------------------
rm -rf "$BUILD_ROOT"
mkdir -p "$BUILD_ROOT"
tar -xzf "$SRC_TGZ" -C "$BUILD_ROOT" || die "cannot extract $SRC_TGZ"
SRC=$BUILD_ROOT/DeepGEMM
for f in setup.py csrc/python_api.cpp deep_gemm/__init__.py deep_gemm/include/deep_gemm \
         third-party/cutlass/include/cute third-party/cutlass/include/cutlass third-party/fmt/include/fmt/format.h; do
  [[ -e "$SRC/$f" ]] || die "tarball lacks DeepGEMM/$f"
done
stamp "extracted to $SRC"
cat "$SRC/DG_SOURCE.txt" 2>/dev/null || true

# ---- 2. interpreter, torch, build tools -----------------------------------------------------------
"$PY" - <<'PY' || die "cannot import torch with $PY"
import sys, torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, cxx11 abi {int(torch.compiled_with_cxx11_abi())})")
PY
PYDEPS=$BUILD_ROOT/pydeps
need=()
for mod in setuptools wheel packaging; do
  "$PY" -c "import $mod" 2>/dev/null || need+=("$mod")
done
if (( ${#need[@]} )); then
  stamp "missing build tools: ${need[*]}; installing from $WHEELS"
  whls=()
  for n in "${need[@]}"; do
    w=$(ls "$WHEELS/$n"-*.whl 2>/dev/null | head -n 1 || true)
    [[ -n "$w" ]] || die "$n is missing and there is no $WHEELS/$n-*.whl"
    whls+=("$w")
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$PYDEPS" "${whls[@]}" >>"$LOG" 2>&1 \
    || die "pip could not install ${whls[*]}"
  export PYTHONPATH=$PYDEPS${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$PYDEPS/bin:$PATH
  "$PY" -c 'import setuptools, wheel, packaging' || die "build tools still not importable"
fi
"$PY" -c 'import setuptools, wheel; print("setuptools", setuptools.__version__, "| wheel", wheel.__version__)'

# ---- 3. compilers, CUDA toolkit -----------------------------------------------------------------
if (( DRY == 0 )); then
  # setup.py builds with setuptools' own build_ext (not torch's BuildExtension): the compiler is the one
  # Python was built with (sysconfig CXX, e.g. x86_64-linux-gnu-g++), or $CXX.
  PY_CXX=$("$PY" -c 'import sysconfig; print((sysconfig.get_config_var("CXX") or "g++").split()[0])')
  # The H200 image exports CC/CXX=/opt/gcc/bin/{gcc,g++}, a wrapper whose builds link libstdc++
  # statically: _C then crashed in its first GEMM, in std::regex's locale code (2026-11-30; the
  # distribution's g++ 13, libstdc++ dynamic, works). Prefer the distribution compiler (DG_CXX).
  DG_CXX=${DG_CXX:-$(command -v x86_64-linux-gnu-g++ || true)}
  if [[ -n "$DG_CXX" && -x "$DG_CXX" ]]; then
    export CC=$DG_CXX CXX=$DG_CXX   # setuptools compiles and links C++ extensions with CC
  fi
  if [[ -z "${CXX:-}" ]] && ! command -v "$PY_CXX" >/dev/null; then
    command -v g++ >/dev/null || die "no C++ compiler ($PY_CXX or g++)"
    export CC=gcc CXX=g++
    echo "note: $PY_CXX absent, using CC=gcc CXX=g++"
  fi
  echo "host compiler: $("${CXX:-$PY_CXX}" --version | head -n 1)"
  if [[ -z "${CUDA_HOME:-}" ]]; then
    CUDA_HOME=${CUDA_PATH:-}
    if [[ -z "$CUDA_HOME" ]]; then
      cands=()
      command -v nvcc >/dev/null && cands+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
      cands+=(/usr/local/cuda)
      for c in "${cands[@]}"; do   # a /usr/local/bin/nvcc wrapper script would give /usr/local: skip that
        if [[ -x "$c/bin/nvcc" && -f "$c/include/cuda_runtime.h" ]]; then CUDA_HOME=$c; break; fi
      done
    fi
  fi
  [[ -n "${CUDA_HOME:-}" ]] || die "cannot find the CUDA toolkit (set CUDA_HOME)"
  export CUDA_HOME
  [[ -x "$CUDA_HOME/bin/nvcc" ]] || die "no nvcc under CUDA_HOME=$CUDA_HOME (set CUDA_HOME)"
  echo "CUDA_HOME=$CUDA_HOME: $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')"
  # torch's ATen/cuda headers need cuBLAS/cuSPARSE/cuSOLVER headers and DeepGEMM needs nvrtc.h + libnvrtc.
  # A toolkit assembled from pip wheels (as /usr/local/cuda on these images may be) can lack them; the torch
  # venv's nvidia-* wheels carry them (site-packages/nvidia/cu13/{include,lib}). Search there second.
  mapfile -t NV_DIRS < <("$PY" - <<'PY'
import os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
for r in roots:
    for sub in sorted(os.listdir(r)):
        d = os.path.join(r, sub)
        if os.path.isdir(os.path.join(d, "include")) or os.path.isdir(os.path.join(d, "lib")):
            print(d)
PY
  )
  EXTRA_INC=()
  for h in cuda.h cuda_runtime.h cuda_runtime_api.h nvrtc.h cusparse.h cublas_v2.h cublasLt.h cusolverDn.h; do
    [[ -f "$CUDA_HOME/include/$h" ]] && continue
    found=""
    for d in "${NV_DIRS[@]}"; do
      if [[ -f "$d/include/$h" ]]; then found=$d/include; break; fi
    done
    [[ -n "$found" ]] || die "header $h is neither in $CUDA_HOME/include nor in the venv's nvidia/*/include"
    [[ " ${EXTRA_INC[*]} " == *" $found "* ]] || EXTRA_INC+=("$found")
    echo "$h: from $found"
  done
  [[ -f "$CUDA_HOME/include/cccl/cuda/std/utility" || -f "$CUDA_HOME/include/cuda/std/utility" ]] \
    || die "no CCCL headers (cuda/std/utility) under $CUDA_HOME/include[/cccl]"
  if (( ${#EXTRA_INC[@]} )); then
    CPATH_ADD=$(IFS=:; echo "${EXTRA_INC[*]}")
    export CPATH=$CPATH_ADD${CPATH:+:$CPATH}      # searched after setup.py's -I dirs
  fi
  # setup.py links -lcudart -lnvrtc from $CUDA_HOME/lib64: give the linker unversioned names from wherever
  # the libraries are, and record their directories as RPATH so `import deep_gemm` finds libnvrtc.so.13.
  LINKDIR=$BUILD_ROOT/linkdir
  mkdir -p "$LINKDIR"
  RPATHS=()
  for lib in cudart nvrtc; do
    dirs=("$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/targets/x86_64-linux/lib")
    for d in "${NV_DIRS[@]}"; do dirs+=("$d/lib"); done
    found=""
    for d in "${dirs[@]}"; do
      if [[ -e "$d/lib$lib.so" ]]; then found=$d/lib$lib.so; break; fi
      v=$(ls "$d/lib$lib.so."[0-9]* 2>/dev/null | head -n 1 || true)
      if [[ -n "$v" ]]; then found=$v; break; fi
    done
    [[ -n "$found" ]] || die "no lib$lib.so* under $CUDA_HOME or the venv's nvidia/*/lib"
    ln -sf "$(readlink -f "$found")" "$LINKDIR/lib$lib.so"
    rdir=$(dirname "$(readlink -f "$found")")
    [[ " ${RPATHS[*]} " == *" $rdir "* ]] || RPATHS+=("$rdir")
    echo "lib$lib: $found"
  done
  for d in "${RPATHS[@]}"; do LDFLAGS="-Wl,-rpath,$d ${LDFLAGS:-}"; done
  export LDFLAGS
  export LIBRARY_PATH=$LINKDIR${LIBRARY_PATH:+:$LIBRARY_PATH}
fi

# torch >= 2.14 headers demand C++20; DeepGEMM's setup.py pins -std=c++17 for the host compile.
TORCH_INC=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
if grep -qs "C++20 or later" "$TORCH_INC/ATen/ATen.h" "$TORCH_INC/torch/all.h" "$TORCH_INC/c10/macros/Macros.h"; then
  sed -i 's/-std=c++17/-std=c++20/' "$SRC/setup.py"
  stamp "torch headers require C++20: host compile switched to -std=c++20"
fi

# ---- 4. build -------------------------------------------------------------------------------------
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export DG_USE_LOCAL_VERSION=0 DG_FORCE_BUILD=1
if (( DRY )); then export DG_SKIP_CUDA_BUILD=1; fi
# setup.py would bake these into deep_gemm/envs.py as defaults; leave them to the run-time environment.
unset DG_JIT_CACHE_DIR DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_CPP_STANDARD
stamp "building (one C++ translation unit, so MAX_JOBS=$MAX_JOBS does not matter; expect 1-3 min); log: $LOG"
T1=$(date +%s)
( cd "$SRC" && "$PY" setup.py build ) >>"$LOG" 2>&1 || die "setup.py build failed"
stamp "build done in $(( $(date +%s) - T1 ))s"

# ---- 5. install into TARGET -------------------------------------------------------------------------
PKG=$(ls -d "$SRC"/build/lib*/deep_gemm 2>/dev/null | head -n 1 || true)
[[ -n "$PKG" ]] || die "no build/lib*/deep_gemm after the build"
if (( DRY == 0 )); then
  ls "$PKG"/_C*.so >/dev/null 2>&1 || die "the build made no deep_gemm/_C*.so"
fi
for d in include/deep_gemm include/cute include/cutlass; do
  [[ -d "$PKG/$d" ]] || die "built package lacks $d (the JIT needs it)"
done
mkdir -p "$TARGET"
rm -rf "$TARGET/deep_gemm"
cp -r "$PKG" "$TARGET/deep_gemm"
cp -f "$SRC/DG_SOURCE.txt" "$TARGET/deep_gemm/" 2>/dev/null || true
stamp "installed to $TARGET/deep_gemm ($(du -sh "$TARGET/deep_gemm" | cut -f1))"

# ---- 6. smoke check -----------------------------------------------------------------------------------
if (( DRY )); then
  stamp "dry run: extension and import check skipped"
  copy_log
  exit 0
fi
if ldd "$TARGET"/deep_gemm/_C*.so | grep -q 'not found'; then
  echo "note: unresolved before torch loads (usually fine, torch brings them):"
  ldd "$TARGET"/deep_gemm/_C*.so | grep 'not found' || true
fi
( cd /tmp && PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} "$PY" - "$TARGET" ) <<'PY' >>"$LOG" 2>&1 || die "import check failed"
import os, sys
import torch
import deep_gemm
print(deep_gemm.__file__)
want = os.path.realpath(os.path.join(sys.argv[1], "deep_gemm"))
assert os.path.realpath(os.path.dirname(deep_gemm.__file__)) == want, f"imported {deep_gemm.__file__}, not the build in {want}"
names = ["m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_masked", "fp8_fp4_gemm_nt",
         "get_mk_alignment_for_contiguous_layout", "get_tma_aligned_size"]
missing = [n for n in names if not hasattr(deep_gemm, n)]
assert not missing, f"deep_gemm lacks {missing}"
print("deep_gemm", getattr(deep_gemm, "__version__", "?"), "ok:", ", ".join(names))
PY
tail -n 2 "$LOG"
( cd /tmp && PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import deep_gemm; print(deep_gemm.__file__)' ) \
  || die "python -c 'import deep_gemm' failed"
stamp "OK. Use: export PYTHONPATH=$TARGET:\$PYTHONPATH  (CUDA_HOME=$CUDA_HOME for the JIT)"
copy_log
