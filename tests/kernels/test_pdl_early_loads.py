"""The decode kernels that load what their predecessor did not write before griddepcontrol.wait (kernels/pdl.py)
keep doing so: their shipped manifest entries compiled for sm_90 here (no GPU needed) issue global loads ahead of
the wait in the PTX. A refactor that moves those loads after the wait undoes a measured gain (kernels/layers/NOTES.md,
"A small kernel's HBM loads ... before the PDL wait") without changing any output, so only this sees it."""

from __future__ import annotations

import pytest

from engine import triton_precompile as tp

# kernel -> global loads it issues before the wait: the norm's scale; the router's rows and bias; cos, sin, slots
EARLY_LOADS = {"_add_rms_norm_kernel": 1, "_decode_front_kernel": 2, "_rotary_qkv_kernel": 3,
               # branch early-routing: the epilogues' plan + bias rows, the down GEMM's plan, the split decode's plan
               "_swiglu_quant_kernel": 3, "_combine_kernel": 4, "_fp8_grouped_gemm_decode_kernel": 3,
               "_sink_decode_split_kernel": 3}
# constexprs an entry must have (the down GEMM's launch, not gate_up's)
NEEDS = {"_fp8_grouped_gemm_decode_kernel": {"EARLY_ROUTING": True}}


def pdl_entry(short: str) -> dict:
    manifest = tp.Manifest.load(tp.MANIFEST_DIR / "gpt-oss-20b.tp1.ep1.sm90.json")
    for spec in manifest.specializations:
        if not (spec["name"].endswith("." + short) and spec["options"].get("launch_pdl")):
            continue
        names = tp.resolve_kernel(spec["name"]).arg_names
        consts = {names[k[0]]: v for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
        if all(consts.get(a) == v for a, v in NEEDS.get(short, {}).items()):
            return spec
    raise AssertionError(f"no PDL launch of {short} in the shipped manifest")


@pytest.mark.parametrize("short", sorted(EARLY_LOADS))
def test_loads_come_before_the_wait(short, tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    src, options = tp.source_and_options(pdl_entry(short))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"].splitlines()
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    assert len(waits) == 1, f"{short}: {len(waits)} griddepcontrol.wait in the PTX"
    before = sum("ld.global" in line for line in ptx[:waits[0]])
    after = sum("ld.global" in line for line in ptx[waits[0]:])
    assert before >= EARLY_LOADS[short], f"{short}: {before} global loads before the wait, {after} after"
    assert after >= 1  # the predecessor's output is still read after it
