"""The decode kernels that load what their predecessor did not write before griddepcontrol.wait (kernels/pdl.py)
keep doing so: their shipped manifest entries compiled for sm_90 here (no GPU needed) issue global loads ahead of
the wait in the PTX. A refactor that moves those loads after the wait undoes a measured gain (kernels/layers/NOTES.md,
"A small kernel's HBM loads ... before the PDL wait") without changing any output, so only this sees it."""

from __future__ import annotations

import pytest

from engine import triton_precompile as tp

# kernel -> global loads it issues before the wait: the norm's scale; the router's rows and bias; cos, sin, slots;
# the down GEMM's plan (number of active experts, the slot's expert, its count)
EARLY_LOADS = {"_add_rms_norm_kernel": 1, "_decode_front_kernel": 2, "_rotary_qkv_kernel": 3,
               "_fp8_grouped_gemm_decode_kernel": 3}
# constexprs the entry must have: the down GEMM's launch, not gate_up's (whose predecessor writes the plan)
NEEDS = {"_fp8_grouped_gemm_decode_kernel": {"EARLY_ROUTING": True}}


def pdl_entry(short: str) -> dict:
    manifest = tp.Manifest.load(tp.MANIFEST_DIR / "gpt-oss-20b.tp1.ep1.sm90.json")
    for spec in manifest.specializations:
        if not (spec["name"].endswith("." + short) and spec["options"].get("launch_pdl")):
            continue
        if all(tp.constexpr_values(spec).get(a) == v for a, v in NEEDS.get(short, {}).items()):
            return spec
    raise AssertionError(f"no PDL launch of {short} with {NEEDS.get(short, {})} in the shipped manifest")


def ptx_around_the_wait(spec: dict) -> tuple[int, int]:
    """(global loads before griddepcontrol.wait, after it) in the entry's sm_90 PTX."""
    ptx = tp.compile_spec(spec, 90)[1].asm["ptx"].splitlines()
    waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    assert len(waits) == 1, f"{spec['name']}: {len(waits)} griddepcontrol.wait in the PTX"
    return sum("ld.global" in line for line in ptx[:waits[0]]), sum("ld.global" in line for line in ptx[waits[0]:])


@pytest.mark.parametrize("short", sorted(EARLY_LOADS))
def test_loads_come_before_the_wait(short, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    before, after = ptx_around_the_wait(pdl_entry(short))
    assert before >= EARLY_LOADS[short], f"{short}: {before} global loads before the wait, {after} after"
    assert after >= 1  # the predecessor's output is still read after it


def slab_spec(scaled_with_bias: bool) -> dict:
    """A PDL launch of the FP8 slab GEMV (QKV / O at decode: FP8 dense weights are an opt-in, so the shipped
    manifests hold none), with or without the weights' block scales and the bias."""
    args = tp.resolve_kernel("kernels.layers.slab_gemv_triton._slab_gemv_kernel").arg_names
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
             "partial_ptr": "*fp32", "tickets_ptr": "*i32"}
    consts = {"HAS_SCALE": scaled_with_bias, "HAS_BIAS": scaled_with_bias, "BLOCK_T": 16, "BLOCK_N": 64, "NKB": 2,
              "SPLIT_K": 12, "WEIGHTS_FIRST": True, "PDL": True}
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in args}
    ptrs = [[i] for i, a in enumerate(args) if a in types]  # 16-byte aligned, as torch allocates
    options = dict(pdl_entry("_add_rms_norm_kernel")["options"], num_warps=4, num_stages=3, launch_pdl=True)
    return {"name": "kernels.layers.slab_gemv_triton._slab_gemv_kernel", "signature": signature,
            "constant_keys": [[args.index(a)] for a in consts], "constant_vals": list(consts.values()),
            "attrs_keys": ptrs, "attrs_vals": [[["tt.divisibility", 16]]] * len(ptrs), "options": options}


def test_slab_gemv_reads_its_scales_and_bias_before_the_wait(tmp_path, monkeypatch):
    """The weights' block scales and the bias join the weights ahead of the wait: the scaled, biased launch issues
    at least two more global loads there than the plain one (the weights' loads are the same in both)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    plain_before, _ = ptx_around_the_wait(slab_spec(False))
    before, after = ptx_around_the_wait(slab_spec(True))
    assert before >= plain_before + 2, f"{before} global loads before the wait (plain launch: {plain_before})"
    assert after >= 1  # the activations
