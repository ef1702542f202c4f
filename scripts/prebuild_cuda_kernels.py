"""Build this project's CUDA C++ kernels (csrc/*.cu) where a node is set up, so a replica never waits on nvcc.

    python -m scripts.prebuild_cuda_kernels [--only decode_front,mxfp4_decode]

Needs nvcc (CUDA_HOME) and ninja, not a GPU. Each extension lands in its folder under ~/.cache/gpt_oss_serve
(kernels/cuda_extension.py; DECODE_FRONT_CUDA_BUILD_DIR / MXFP4_CUDA_BUILD_DIR move them); later processes of the
same user load the built module instead of compiling (both together: 30 s on an H200 node). Both build at
once, each in its own process; exit status 1 if either fails (a replica then falls back to the Triton front, EngineConfig.decode_front).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time

EXTENSIONS = ("decode_front", "mxfp4_decode")


def build(name: str) -> float:
    start = time.perf_counter()
    if name == "decode_front":
        from kernels.moe import decode_front_cuda

        decode_front_cuda.build_in_background().result()
    else:
        from kernels.moe import mxfp4_cuda

        mxfp4_cuda.build()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(EXTENSIONS), help=f"comma-separated, of {', '.join(EXTENSIONS)}")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(EXTENSIONS))
    if unknown:
        parser.error(f"unknown extension(s) {unknown}; choose from {list(EXTENSIONS)}")
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(len(names)) as pool:
        for name, future in [(n, pool.submit(build, n)) for n in names]:
            try:
                print(f"{name}: built in {future.result():.0f} s", flush=True)
            except Exception as e:  # report every extension, then fail
                failed += 1
                print(f"{name}: FAILED ({type(e).__name__}: {str(e)[:2000]})", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
