#!/usr/bin/env bash
# Pack the build input of scripts/build_deep_gemm.sh from a DeepGEMM checkout with its submodules:
#   git clone https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM
#   git checkout 54e22612409371d6364144b69086735beb54e98b && git submodule update --init --recursive
#   bash scripts/pack_deep_gemm_src.sh /path/to/DeepGEMM      # -> .dg_src/deepgemm_src.tgz (~2.5 MB)
# or, from bare git directories of the three repositories (no work trees, e.g. mirrors):
#   bash scripts/pack_deep_gemm_src.sh --git-dirs DEEPGEMM.git CUTLASS.git FMT.git [COMMIT]
#   (COMMIT defaults to 54e22612409371d6364144b69086735beb54e98b; the submodule pins are read from it)
# Kept: DeepGEMM's tree (no .git, tests or docs), cutlass include/ + LICENSE.txt and fmt include/ +
# LICENSE (header-only), i.e. what the extension build and the run-time JIT read. The GPU hosts used
# here reach no git host, so the tarball travels with `carry`; `.dg_src/` is git-ignored.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--git-dirs" ]; then
    DG=${2:?DeepGEMM git dir}; CUTLASS=${3:?cutlass git dir}; FMT=${4:?fmt git dir}
    COMMIT=${5:-54e22612409371d6364144b69086735beb54e98b}
    pin() { git --git-dir="$DG" ls-tree "$COMMIT" "third-party/$1" | awk '{print $3}'; }
    CHECKOUT=$(mktemp -d)
    trap 'rm -rf "$CHECKOUT"' EXIT
    git --git-dir="$DG" archive "$COMMIT" | tar -x -C "$CHECKOUT"
    mkdir -p "$CHECKOUT/third-party/cutlass" "$CHECKOUT/third-party/fmt"
    git --git-dir="$CUTLASS" archive "$(pin cutlass)" include LICENSE.txt | tar -x -C "$CHECKOUT/third-party/cutlass"
    git --git-dir="$FMT" archive "$(pin fmt)" include LICENSE | tar -x -C "$CHECKOUT/third-party/fmt"
    printf 'Build input assembled for scripts/build_deep_gemm.sh (not a git checkout).\n. %s\nthird-party/cutlass %s\nthird-party/fmt %s\n' \
        "$COMMIT" "$(pin cutlass)" "$(pin fmt)" > "$CHECKOUT/DG_SOURCE.txt"
    mkdir -p "$REPO/.dg_src"
    tar -C "$(dirname "$CHECKOUT")" --transform "s|^$(basename "$CHECKOUT")|DeepGEMM|" \
        --exclude="$(basename "$CHECKOUT")/tests" -czf "$REPO/.dg_src/deepgemm_src.tgz" "$(basename "$CHECKOUT")"
    echo "wrote $REPO/.dg_src/deepgemm_src.tgz ($(du -h "$REPO/.dg_src/deepgemm_src.tgz" | cut -f1)) from git dirs at $COMMIT"
    exit 0
fi
SRC=$(cd "${1:?usage: pack_deep_gemm_src.sh DEEPGEMM_CHECKOUT | --git-dirs DG CUTLASS FMT [COMMIT]}" && pwd)
[ -f "$SRC/setup.py" ] && [ -d "$SRC/third-party/cutlass/include" ] && [ -d "$SRC/third-party/fmt/include" ] \
    || { echo "$SRC is not a DeepGEMM checkout with submodules (setup.py, third-party/{cutlass,fmt}/include)" >&2; exit 1; }
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/DeepGEMM/third-party/cutlass" "$STAGE/DeepGEMM/third-party/fmt"
tar -C "$SRC" --exclude=.git --exclude=./third-party --exclude=./tests --exclude=./docs -cf - . | tar -C "$STAGE/DeepGEMM" -xf -
cp -r "$SRC/third-party/cutlass/include" "$SRC/third-party/cutlass/LICENSE.txt" "$STAGE/DeepGEMM/third-party/cutlass/"
cp -r "$SRC/third-party/fmt/include" "$STAGE/DeepGEMM/third-party/fmt/"
cp "$SRC/third-party/fmt/LICENSE"* "$STAGE/DeepGEMM/third-party/fmt/" 2>/dev/null || true
{ echo "Build input assembled for scripts/build_deep_gemm.sh (not a git checkout)."
  for d in . third-party/cutlass third-party/fmt; do
      echo "$d $(git -C "$SRC/$d" rev-parse HEAD 2>/dev/null || echo unknown)"
  done; } > "$STAGE/DeepGEMM/DG_SOURCE.txt"
mkdir -p "$REPO/.dg_src"
tar -C "$STAGE" -czf "$REPO/.dg_src/deepgemm_src.tgz" DeepGEMM
echo "wrote $REPO/.dg_src/deepgemm_src.tgz ($(du -h "$REPO/.dg_src/deepgemm_src.tgz" | cut -f1))"
