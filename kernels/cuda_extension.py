"""Building this project's CUDA C++ kernels (csrc/*.cu) for Hopper with torch's cpp_extension, on first use.

`load(sources, name, build_dir_env)` compiles csrc/<source> (one file, or several: a .cu kernel that nvcc builds
without torch's headers and a .cpp binding for the host compiler, built in parallel) for sm_90a into a per-extension
folder under ~/.cache/gpt_oss_serve (or the folder an environment variable names) and returns the loaded module; nvcc
and ninja must be present. Importing a kernel module builds nothing: its wrapper calls this on its first launch.
"""

from __future__ import annotations

import os
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def load(sources: str | list[str], name: str, build_dir_env: str, cache_subdir: str):
    from torch.utils.cpp_extension import load as cpp_load

    build = Path(os.environ.get(build_dir_env, Path.home() / ".cache" / "gpt_oss_serve" / cache_subdir))
    build.mkdir(parents=True, exist_ok=True)
    names = [sources] if isinstance(sources, str) else list(sources)
    return cpp_load(name=name, sources=[str(CSRC / s) for s in names], build_directory=str(build),
                    extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "-O3"], extra_cflags=["-O3"],
                    verbose=False)
