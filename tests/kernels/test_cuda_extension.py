"""kernels/cuda_extension.py: which file it compiles, for which GPU, into which folder (the compile itself needs
nvcc and a CUDA build of torch: the GPU tests of each kernel build it)."""

from __future__ import annotations

import torch.utils.cpp_extension

from kernels import cuda_extension


def test_load_compiles_the_named_source_for_sm90a_into_its_folder(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: seen.update(kw) or "module")
    monkeypatch.setenv("SOME_BUILD_DIR", str(tmp_path / "b"))
    assert cuda_extension.load("mxfp4_decode.cu", "mxfp4_decode_ext", "SOME_BUILD_DIR", "unused") == "module"
    assert seen["name"] == "mxfp4_decode_ext" and seen["build_directory"] == str(tmp_path / "b")
    assert (tmp_path / "b").is_dir() and seen["sources"] == [str(cuda_extension.CSRC / "mxfp4_decode.cu")]
    assert "-gencode=arch=compute_90a,code=sm_90a" in seen["extra_cuda_cflags"]
    cuda_extension.load(["decode_front.cu", "decode_front_binding.cpp"], "decode_front_ext", "SOME_BUILD_DIR", "x")
    assert seen["sources"] == [str(cuda_extension.CSRC / s) for s in ("decode_front.cu", "decode_front_binding.cpp")]
    # the sources the kernel wrappers name exist; the .cu kernels include no torch header (nvcc would parse it)
    for source in ("decode_front.cu", "decode_front_binding.cpp", "decode_front.cuh", "mxfp4_decode.cu",
                   "mxfp4_decode_binding.cpp", "mxfp4_decode.cuh"):
        assert (cuda_extension.CSRC / source).is_file()
    for source in ("decode_front.cu", "decode_front.cuh", "mxfp4_decode.cu", "mxfp4_decode.cuh"):
        assert "torch" not in "".join(line for line in (cuda_extension.CSRC / source).read_text().splitlines()
                                      if line.startswith("#include")), source


def test_default_folder_is_under_the_user_cache(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: seen.update(kw))
    monkeypatch.delenv("SOME_BUILD_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cuda_extension.load("mxfp4_decode.cu", "mxfp4_decode_ext", "SOME_BUILD_DIR", "mxfp4_cuda")
    assert seen["build_directory"] == str(tmp_path / ".cache" / "gpt_oss_serve" / "mxfp4_cuda")
