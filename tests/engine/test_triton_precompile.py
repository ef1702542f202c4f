"""engine/triton_precompile.py on the CPU: manifests match by shapes, split and arch; entries compile for an
SM90 target in the worker process (no GPU needed) into Triton's cache, where a second compile finds them;
broken entries are reported, not fatal; the shipped manifests still fit the kernels they name.
(tests/engine/test_triton_precompile_gpu.py checks that a kernel launch finds what the workers compiled.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import triton_precompile as tp
from engine.config import EngineConfig
from model.config import GptOssConfig

DIV16 = [["tt.divisibility", 16]]


def norm_spec(block: int = 4096, has_delta: bool = True, name: str = "kernels.layers.triton_ops._add_rms_norm_kernel"):
    """An add_rms_norm specialization in Triton's serialized form (what a bf16 launch at D = 2880 records)."""
    args = ["x_ptr", "delta_ptr", "w_ptr", "sum_ptr", "out_ptr", "n", "eps", "stride_x", "stride_delta",
            "stride_sum", "stride_out", "HAS_DELTA", "BLOCK", "PDL", "bias_ptr", "q_ptr", "sf_ptr", "stride_q",
            "sf_k_stride", "HAS_BIAS", "QUANT", "NUM_KB"]
    types = ["*bf16", "*bf16", "*fp32", "*bf16", "*bf16", "i32", "fp32", "i32", "i32", "i32", "i32", "constexpr",
             "constexpr", "constexpr", "*bf16", "*bf16", "*bf16", "i32", "i32", "constexpr", "constexpr", "constexpr"]
    div16 = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 14, 15, 16, 17, 18)
    return {"name": name, "signature": dict(zip(args, types)),
            "constant_keys": [[11], [12], [13], [19], [20], [21]],
            "constant_vals": [has_delta, block, False, False, False, 1],
            "attrs_keys": [[i] for i in div16], "attrs_vals": [DIV16] * len(div16),
            "options": {"num_warps": 4, "num_stages": 3}}


def manifest(specs, shapes=None, tp_size=1, ep_size=1, arch=90) -> tp.Manifest:
    return tp.Manifest(shapes if shapes is not None else tp.shapes_of(GptOssConfig.preset("gpt-oss-20b")), tp_size,
                       ep_size, arch, specs, {"by": "tests"})


def cache_entries(root: Path) -> set[str]:
    return {p.parent.name for p in root.glob("*/*.json") if not p.name.startswith("__grp__")}


def test_find_manifest_matches_shapes_split_and_arch(tmp_path):
    m20 = GptOssConfig.preset("gpt-oss-20b")
    manifest([norm_spec()]).save(tmp_path / "20b.json")
    found = tp.find_manifest(m20, 1, 1, 90, [tmp_path])
    assert found is not None and found.specializations == [norm_spec()] and found.path == tmp_path / "20b.json"
    assert tp.find_manifest(GptOssConfig.preset("gpt-oss-120b"), 1, 1, 90, [tmp_path]) is None
    assert tp.find_manifest(m20, 2, 1, 90, [tmp_path]) is None
    assert tp.find_manifest(m20, 1, 1, 100, [tmp_path]) is None


def test_manifest_dirs_env_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv(tp.MANIFEST_PATH_ENV, str(tmp_path))
    assert tp.manifest_dirs() == [tmp_path, tp.MANIFEST_DIR]


def test_unique_drops_repeats_and_the_cache_key():
    a = json.dumps(dict(norm_spec(), key="k1"))
    b = json.dumps(dict(norm_spec(), key="k2", target={"backend": "cuda", "arch": 90, "warp_size": 32}))
    c = json.dumps(norm_spec(has_delta=False))
    got = tp.unique([a, b, c, a])
    assert len(got) == 2 and all("key" not in s and "target" not in s for s in got)


def test_start_for_needs_cuda_and_the_setting():
    m20 = GptOssConfig.preset("gpt-oss-20b")
    assert tp.start_for(m20, EngineConfig(device="cpu")) is None
    assert tp.start_for(m20, EngineConfig(device="cuda", triton_precompile=False)) is None


def test_precompile_process_fills_the_cache_and_reports_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    specs = [norm_spec(), norm_spec(has_delta=False),
             norm_spec(name="kernels.layers.triton_ops._no_such_kernel"),
             dict(norm_spec(), signature={"x_ptr": "*bf16"})]  # arguments the kernel does not have
    report = tp.Precompile(manifest(specs), 90, workers=2).wait(timeout=300)
    assert report["exit"] == 0, report
    assert report["specializations"] == 4 and report["compiled"] == 2 and report["workers"] == 2
    failed = {f["kernel"]: f["error"] for f in report["failed"]}
    assert failed["kernels.layers.triton_ops._no_such_kernel"].startswith("AttributeError")
    assert "not the kernel's" in failed["kernels.layers.triton_ops._add_rms_norm_kernel"]
    compiled = cache_entries(tmp_path / "cache")
    assert len(compiled) == 2

    # the same entries again, in this process: both found in the cache, nothing new compiled
    from triton import knobs

    hits = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    for spec in specs[:2]:
        name, _, error, _ = tp.compile_one(spec, 90)
        assert error is None
    assert hits == [True, True]
    assert cache_entries(tmp_path / "cache") == compiled


def test_cancel_stops_the_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    running = tp.Precompile(manifest([norm_spec(block=b) for b in (1024, 2048, 4096, 8192)]), 90, workers=1)
    running.cancel()
    assert running.proc.returncode is not None


@pytest.mark.parametrize("path", sorted(tp.MANIFEST_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_manifests_fit_the_kernels(path):
    """Every entry names a kernel that exists and takes the arguments it was recorded with (a kernel whose
    arguments change needs its manifest recorded again: python -m bench.triton_precompile_probe on a GPU)."""
    m = tp.Manifest.load(path)
    assert m.specializations and m.arch >= 80
    assert set(m.shapes) == set(tp.SHAPE_FIELDS)
    for spec in m.specializations:
        tp.source_and_options(spec)


def test_manifests_are_shipped_for_both_models():
    shapes = [tp.Manifest.load(p).shapes for p in tp.MANIFEST_DIR.glob("*.json")]
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        assert tp.shapes_of(GptOssConfig.preset(name)) in shapes, name


def test_the_probe_records_at_the_serve_defaults():
    """bench/triton_precompile_probe.py writes the Serve decode replica's engine config out by hand (no pydantic
    on the GPU host): the two must agree, or the manifests cover another config than what replicas run."""
    from bench.triton_precompile_probe import engine_config
    from serve_app.config import ServeAppConfig

    serve = ServeAppConfig.from_args({"model": "random:gpt-oss-20b", "kv_cache_memory_gib": 6})
    assert engine_config("cuda", 6, True) == serve.engine_config("cuda", "decode")


def test_shipped_entries_compile_here(tmp_path, monkeypatch):
    """Two entries of the shipped 20b manifest (recorded with the GPU host's Triton) compile with this one."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    m = tp.Manifest.load(tp.MANIFEST_DIR / "gpt-oss-20b.tp1.ep1.sm90.json")
    norms = [s for s in m.specializations if s["name"].endswith("._add_rms_norm_kernel")][:2]
    assert len(norms) == 2
    for spec in norms:
        name, _, error, _ = tp.compile_one(spec, m.arch)
        assert error is None, error
    assert len(cache_entries(tmp_path / "cache")) == 2


def test_a_broken_manifest_is_skipped(tmp_path):
    (tmp_path / "a_broken.json").write_text("{not json")
    (tmp_path / "b_no_fields.json").write_text("{}")
    manifest([norm_spec()]).save(tmp_path / "c_good.json")
    found = tp.find_manifest(GptOssConfig.preset("gpt-oss-20b"), 1, 1, 90, [tmp_path])
    assert found is not None and found.path.name == "c_good.json"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU failure path")
def test_start_for_failing_to_start_is_logged_not_raised(caplog):
    """device=cuda on a machine without one: the capability query fails; the engine build must not."""
    with caplog.at_level("WARNING", logger="engine.triton_precompile"):
        assert tp.start_for(GptOssConfig.preset("gpt-oss-20b"), EngineConfig(device="cuda")) is None
    assert "Triton precompile not started" in caplog.text
