"""The wheel `pip install .` builds carries what the code loads from beside itself at run time: the CUDA C++
sources kernels/cuda_extension.py compiles on a GPU host's first use, and the Triton manifests of
engine/triton_precompile.py. Checked in an installed layout (the wheel unpacked, the checkout off the path)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # from a copy of the files git would commit: setuptools reuses a build/ folder left in the checkout
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    tree = tmp_path_factory.mktemp("tree")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    out = tmp_path_factory.mktemp("wheel")
    # torch requires setuptools, so the build needs nothing from the network
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(tree)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("gptoss_serve-*.whl")
    return path


def test_the_wheel_holds_the_cuda_sources_and_the_triton_manifests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".cpp"))
    manifests = sorted(p.name for p in (ROOT / "engine" / "triton_manifests").glob("*.json"))
    assert sources and manifests
    missing = [f"csrc/{s}" for s in sources if f"csrc/{s}" not in names]
    missing += [f"engine/triton_manifests/{m}" for m in manifests if f"engine/triton_manifests/{m}" not in names]
    assert not missing, missing
    assert "engine/cli.py" in names and "serve_app/__init__.py" in names


def test_an_installed_wheel_finds_them_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no .pth files, so the editable install of this checkout is not on the path; the venv's packages are
    code = (f"import sys; sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
            "from kernels import cuda_extension\n"
            "from engine import triton_precompile\n"
            "print(cuda_extension.CSRC)\n"
            "print(triton_precompile.MANIFEST_DIR)\n"
            "for name in ('decode_front.cu', 'decode_front_binding.cpp', 'mxfp4_decode.cu', 'mxfp4_decode_binding.cpp'):\n"
            "    assert (cuda_extension.CSRC / name).is_file(), name\n"
            "assert any(triton_precompile.MANIFEST_DIR.glob('gpt-oss-120b.*.json'))\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    csrc, manifests = out.stdout.split()
    assert Path(csrc).resolve() == (site / "csrc").resolve()
    assert Path(manifests).resolve() == (site / "engine" / "triton_manifests").resolve()
