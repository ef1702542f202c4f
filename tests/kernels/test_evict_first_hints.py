"""kernels.moe.fp8_quant.WEIGHTS_EVICT_FIRST reaches the code: compiled for sm_90 here (no GPU needed), the decode
kernels that stream weights (the MoE decode GEMM, the slab GEMV, the FP8 GEMV) mark those loads L2 evict-first
with the switch on, and nothing without it. The MoE GEMM's weights go through Triton's cp.async pipeline, where a
hint could be dropped without any output changing, so only the PTX shows it. Outputs: tests/kernels/*_gpu.py."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("triton")
from engine import triton_precompile as tp  # noqa: E402
from tests.kernels.test_pdl_early_loads import pdl_entry, slab_spec  # noqa: E402

POLICY = "createpolicy.fractional.L2::evict_first"


def with_evict_first(spec: dict, on: bool) -> dict:
    spec = copy.deepcopy(spec)
    names = tp.resolve_kernel(spec["name"]).arg_names
    index = names.index("EVICT_FIRST")
    spec["signature"]["EVICT_FIRST"] = "constexpr"
    keys = [k[0] for k in spec["constant_keys"]]
    if index in keys:
        spec["constant_vals"][keys.index(index)] = on
    else:
        spec["constant_keys"].append([index])
        spec["constant_vals"].append(on)
    return spec


def fp8_gemv_spec() -> dict:
    """A PDL launch of the FP8 GEMV as the unembedding makes it (128-row blocks, no split, no bias; N 201088, K 2880
    of 2944: the pointers and those integers divisible by 16, as the launch specializes them)."""
    args = tp.resolve_kernel("kernels.layers.fp8_gemv_triton._fp8_gemv_kernel").arg_names
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16",
             "partial_ptr": "*fp32", "tickets_ptr": "*i32"}
    consts = {"HAS_BIAS": False, "BLOCK_T": 16, "BLOCK_N": 128, "NUM_KB": 23, "KB_PER_SPLIT": 23, "SPLIT_K": 1,
              "DOT_F16": True, "PDL": True}
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in args if a != "EVICT_FIRST"}
    by16 = [[i] for i, a in enumerate(args) if a in types or a in ("n", "k", "k_w", "stride_x", "stride_w", "stride_y")]
    options = dict(pdl_entry("_add_rms_norm_kernel")["options"], num_warps=4, num_stages=3, launch_pdl=True)
    return {"name": "kernels.layers.fp8_gemv_triton._fp8_gemv_kernel", "signature": signature,
            "constant_keys": [[args.index(a)] for a in consts], "constant_vals": list(consts.values()),
            "attrs_keys": by16, "attrs_vals": [[["tt.divisibility", 16]]] * len(by16), "options": options}


def slab_spec_without_switch() -> dict:
    spec = slab_spec(True)
    spec["signature"].pop("EVICT_FIRST", None)  # slab_spec lists every argument; with_evict_first adds it back
    return spec


# kernel -> (its entry, the PTX load instruction its weights arrive through)
KERNELS = {"moe decode gemm": (lambda: pdl_entry("_fp8_grouped_gemm_decode_kernel"), "cp.async"),
           "slab gemv": (slab_spec_without_switch, "ld.global"),
           "fp8 gemv": (fp8_gemv_spec, "cp.async")}


def hinted_loads(spec: dict, load: str) -> tuple[int, int, int]:
    """(evict-first policies created, `load` lines with an L2 cache hint, `load` lines without) in the sm_90 PTX."""
    ptx = tp.compile_spec(spec, 90)[1].asm["ptx"].splitlines()
    loads = [line for line in ptx if load in line and "commit_group" not in line and "wait_group" not in line]
    hinted = sum("L2::cache_hint" in line for line in loads)
    return sum(POLICY in line for line in ptx), hinted, len(loads) - hinted


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_weight_loads_carry_the_evict_first_hint(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entry, load = KERNELS[kernel]
    policies, hinted, plain = hinted_loads(with_evict_first(entry(), True), load)
    assert policies >= 1 and hinted >= 1, f"{kernel}: {policies} evict-first policies, {hinted} hinted {load}"
    if kernel != "slab gemv":  # the GEMMs' activations come through the same pipeline, unhinted
        assert plain >= 1, f"{kernel}: every {load} hinted ({hinted}), the activations' too"
    policies, hinted, plain = hinted_loads(with_evict_first(entry(), False), load)
    assert policies == hinted == 0 and plain >= 1, f"{kernel} without the switch: {policies} policies, {hinted} hinted"
