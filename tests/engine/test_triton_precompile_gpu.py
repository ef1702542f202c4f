"""engine/triton_precompile.py on the GPU: what a kernel launch records, compiled in the precompile's worker
processes into an empty Triton cache, is what the next launch of that kernel finds there (the cache keys agree),
and the kernel computes the same."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = torch.device("cuda")


class Listener:
    def __init__(self):
        self.hits, self.misses = [], []

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        (self.hits if cache_hit else self.misses).append(src.name)


def _launch(x, delta, w, qkv, cos, sin):
    from kernels.layers import triton_ops

    s, h = triton_ops.add_rms_norm(x, delta, w, 1e-5)
    normed = triton_ops.add_rms_norm(x, None, w, 1e-5)
    q, k, v = triton_ops.rotary_qkv(qkv, cos, sin, 16, 2, 64)
    return [s, h, normed, q, k, v]


def _forget_compiled_kernels():
    """Drop every Triton kernel's in-memory cache, as a fresh process would start."""
    from triton.runtime.jit import JITFunction

    import kernels.layers.triton_ops as ops

    for obj in vars(ops).values():
        while obj is not None and not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
            obj = obj.fn
        if isinstance(obj, JITFunction):
            obj.device_caches.clear()


def test_recorded_specializations_precompiled_are_cache_hits(tmp_path, monkeypatch):
    from triton import knobs

    from engine.triton_precompile import Manifest, Precompile, record, unique

    x = torch.randn(37, 2880, device=DEV, dtype=torch.bfloat16)
    delta = torch.randn_like(x)
    w = torch.rand(2880, device=DEV) + 0.5
    qkv = torch.randn(37, 20 * 64, device=DEV, dtype=torch.bfloat16)
    angles = torch.arange(37, device=DEV, dtype=torch.float32)[:, None] * torch.rand(32, device=DEV)
    cos, sin = angles.cos(), angles.sin()

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "first"))
    _forget_compiled_kernels()
    specs: list[str] = []
    with record(specs):
        first = _launch(x, delta, w, qkv, cos, sin)
    assert len(unique(specs)) >= 3, specs  # two add_rms_norm specializations and the rotary kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second"))  # empty: only what the workers put there
    major, minor = torch.cuda.get_device_capability()
    manifest = Manifest({}, 1, 1, 10 * major + minor, unique(specs), {})
    report = Precompile(manifest, manifest.arch, workers=2).wait()
    assert report["exit"] == 0 and report["failed"] == [] and report["compiled"] == len(manifest.specializations), report

    _forget_compiled_kernels()
    listener = Listener()
    monkeypatch.setattr(knobs.compilation, "listener", listener)
    again = _launch(x, delta, w, qkv, cos, sin)
    torch.cuda.synchronize()
    assert listener.misses == [] and len(listener.hits) == len(manifest.specializations), (listener.hits,
                                                                                          listener.misses)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_shipped_manifest_holds_what_the_layer_kernels_launch():
    """The 20b manifest's add_rms_norm and rotary entries (recorded on 2026-12-01, their dense_dtype arguments
    appended by hand on 2026-12-02): what an eager bf16 launch at gpt-oss's shapes specializes is among them."""
    import json

    from engine.triton_precompile import MANIFEST_DIR, Manifest, record, unique
    from kernels.layers import triton_ops

    manifest = Manifest.load(MANIFEST_DIR / "gpt-oss-20b.tp1.ep1.sm90.json")
    shipped = {json.dumps(s, sort_keys=True) for s in manifest.specializations}
    _forget_compiled_kernels()
    specs: list[str] = []
    with record(specs):
        for t in (1, 37):
            x = torch.randn(t, 2880, device=DEV, dtype=torch.bfloat16)
            w = torch.rand(2880, device=DEV) + 0.5
            triton_ops.add_rms_norm(x, torch.randn_like(x), w, 1e-5)
            triton_ops.add_rms_norm(x, None, w, 1e-5)
            qkv = torch.randn(t, 80 * 64, device=DEV, dtype=torch.bfloat16)
            angles = torch.rand(t, 32, device=DEV)
            cache = torch.zeros(64, 16, 8, 64, device=DEV, dtype=torch.bfloat16)
            slots = torch.arange(t, device=DEV, dtype=torch.int64)
            triton_ops.rotary_qkv(qkv, angles.cos(), angles.sin(), 64, 8, 64, (cache, torch.zeros_like(cache), slots))
    torch.cuda.synchronize()
    launched = [json.dumps(s, sort_keys=True) for s in unique(specs)]
    assert len(launched) == 4, launched  # norm with and without delta, rotary at 1 token (a constant) and 37
    missing = [s for s in launched if s not in shipped]
    assert not missing, missing[:2]
