#!/usr/bin/env bash
# Build deep_gemm three ways in parallel and keep the first that passes scripts/deep_gemm_smoke.py.
# The plain build (2026-11-30) crashed in its first GEMM inside std::regex (IncludeParser), the
# signature of libstdc++ template code bound across two C++ runtimes; the variants isolate _C:
#   A: -static-libstdc++      B: hidden visibility + -Bsymbolic      C: both
# Prints the winner's name last (nothing if none); the winner is at /tmp/dgs_<V>.  Needs device_env.sh.
set -u
LOGS=${LOGS:-/tmp/logs}
VIS="-fvisibility=hidden -fvisibility-inlines-hidden"
for v in A B C; do
    case $v in A) F=""; L="-static-libstdc++";; B) F="$VIS"; L="-Wl,-Bsymbolic";; C) F="$VIS"; L="-static-libstdc++ -Wl,-Bsymbolic";; esac
    ( CFLAGS="$F" LDFLAGS="$L" DG_BUILD_ROOT=/tmp/dgb_$v OUT=$LOGS/dg_$v bash scripts/build_deep_gemm.sh /tmp/dgs_$v \
          > "$LOGS/dg_build_$v.log" 2>&1
      cd /tmp && PYTHONPATH=/tmp/dgs_$v:$PYTHONPATH DG_JIT_CACHE_DIR=/tmp/jit/dg_$v timeout 150 \
          python3 -m scripts.deep_gemm_smoke > "$LOGS/dg_smoke_$v.log" 2>&1
      echo "variant $v smoke exit $?" >> "$LOGS/dg_smoke_$v.log" ) &
done
wait
for v in A B C; do grep -E "^-> |variant|why_unavailable|Error" "$LOGS/dg_smoke_$v.log" | tail -3 >&2; done
for v in A B C; do
    if grep -q "why_unavailable: ''" "$LOGS/dg_smoke_$v.log"; then echo "$v"; break; fi
done
