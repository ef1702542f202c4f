#!/usr/bin/env bash
# Build deep_gemm three ways in parallel and keep the first that passes scripts/deep_gemm_smoke.py.
# The plain build (2026-11-30) crashed in its first GEMM inside std::regex (IncludeParser ->
# _BracketMatcher::_M_ready -> locale facet code), and so did builds with -static-libstdc++ and with
# -Bsymbolic: the libstdc++ facet code sits inside _C, as if the compiler wrapper on the image
# (/opt/gcc/bin/g++, "g++-real") linked it statically. Variants now:
#   A: the distribution's own g++ (not the wrapper), libstdc++ dynamic
#   B: the wrapper with -pthread (libstdc++'s locale init runs only where threads look active)
#   C: both
# Prints the winner's name last (nothing if none); the winner is at /tmp/dgs_<V>.  Needs device_env.sh.
set -u
LOGS=${LOGS:-/tmp/logs}
SYS_CXX=$(ls /usr/bin/x86_64-linux-gnu-g++-1[0-9] /usr/bin/g++-1[0-9] /usr/bin/g++ 2>/dev/null | head -1)
SYS_CC=$SYS_CXX  # setuptools compiles and links C++ extensions with CC: g++ also links libstdc++
{ echo "system g++: ${SYS_CXX:-none}"; file -L /opt/gcc/bin/g++ 2>&1; head -c 400 /opt/gcc/bin/g++ | strings | head -8
  ls -la /usr/bin/*g++* 2>&1 | head; } >&2
for v in A B C; do
    case $v in A) X="$SYS_CXX"; C="$SYS_CC"; L="";; B) X=""; C=""; L="-pthread";; C) X="$SYS_CXX"; C="$SYS_CC"; L="-pthread";; esac
    ( if [ -n "$X" ]; then export CXX=$X CC=$C DG_CXX=$X; else export DG_CXX=/opt/gcc/bin/g++; fi
      LDFLAGS="$L" DG_BUILD_ROOT=/tmp/dgb_$v OUT=$LOGS/dg_$v bash scripts/build_deep_gemm.sh /tmp/dgs_$v \
          > "$LOGS/dg_build_$v.log" 2>&1
      cd /tmp && PYTHONPATH=/tmp/dgs_$v:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/jit/dg_$v timeout 150 \
          python3 -m scripts.deep_gemm_smoke > "$LOGS/dg_smoke_$v.log" 2>&1
      echo "variant $v smoke exit $?" >> "$LOGS/dg_smoke_$v.log"
      SO=$(ls /tmp/dgs_$v/deep_gemm/_C*.so 2>/dev/null)
      echo "variant $v: libstdc++ $(ldd "$SO" 2>/dev/null | grep -c stdc++) dynamic, locale init defined inside: $(nm -C "$SO" 2>/dev/null | grep -c ' T std::locale::_S_initialize')" >> "$LOGS/dg_smoke_$v.log" ) &
done
wait
for v in A B C; do grep -E "^-> |variant|why_unavailable|Error" "$LOGS/dg_smoke_$v.log" | tail -4 >&2; done
for v in A B C; do
    if grep -q "why_unavailable: ''" "$LOGS/dg_smoke_$v.log"; then echo "$v"; break; fi
done
