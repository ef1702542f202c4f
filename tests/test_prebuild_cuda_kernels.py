"""scripts/prebuild_cuda_kernels.py's reporting: where torch cannot compile CUDA (a CPU build of torch, CI's) the
failure is named and the exit status is 1, an unknown extension is a usage error; the build itself runs where nvcc
and a CUDA torch are (bench/decode_front_cuda_device_run.sh)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin", HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "scripts.prebuild_cuda_kernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch can compile the kernel")
def test_without_nvcc_the_failure_is_named_and_the_status_is_1(tmp_path):
    done = run(tmp_path, "--only", "decode_front")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "decode_front: FAILED" in done.stderr and "CUDA_HOME" in done.stderr


def test_unknown_extension_is_a_usage_error(tmp_path):
    done = run(tmp_path, "--only", "decode_front,int4_gemm")
    assert done.returncode == 2 and "unknown extension(s) ['int4_gemm']" in done.stderr
