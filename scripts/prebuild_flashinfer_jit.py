"""Build every FlashInfer JIT module the attention backend can load, so serving never waits on nvcc.

    FLASHINFER_WORKSPACE_BASE=/persistent/dir python -m scripts.prebuild_flashinfer_jit [--backends fa3,fa2]

Needs nvcc (CUDA_HOME) and the [gpu] extra, not a GPU: without one, name the target with
FLASHINFER_CUDA_ARCH_LIST="9.0a" (the H200's arch; FlashInfer files the cache under it). Later
processes with the same FLASHINFER_WORKSPACE_BASE and package versions find the modules built and
skip the ~70 s-per-variant compile. MAX_JOBS caps ninja's parallel nvcc jobs (each fa3 job can
take several GB of host memory).
"""

from __future__ import annotations

import argparse
import time

from kernels.attention import flashinfer_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fa3,fa2", help="comma-separated prefill backends")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-decode", action="store_true", help="skip FlashInfer's no-sink decode (benchmark only)")
    args = parser.parse_args()
    backends = tuple(b for b in args.backends.split(",") if b)
    specs = flashinfer_ops.jit_specs(args.head_dim, backends, with_decode=not args.no_decode)
    print(f"flashinfer {flashinfer_ops.FLASHINFER_VERSION}: building {len(specs)} modules into {flashinfer_ops.jit_cache_dir()}")
    for spec in specs:
        start = time.perf_counter()
        spec.build(verbose=False)
        print(f"  {spec.name}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
