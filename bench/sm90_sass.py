"""Static SM90 code of the prefill epilogue kernels' variants, compiled here without a GPU (Triton's bundled ptxas
and cuobjdump): SASS instructions per thread and the PTX instructions that tell the variants apart.

Instruction-bound kernels (the prefill SwiGLU + quantization tiles, the dispatch quantization; kernels/moe/NOTES.md,
item 5) are compared by what they issue before a GPU times them. Each row starts from the shipped precompile manifest's
entry for the launch the engine makes (120b, FAST_DIV and PDL on, the launch's divisibility-by-16 specialization),
with the switches' constexprs set as the row says.

    python -m bench.sm90_sass [--out bench/results/sm90_sass_epilogues.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import tempfile

from engine import triton_precompile as tp

MANIFEST = "gpt-oss-120b.tp1.ep1.sm90.json"
TILES = "kernels.moe.epilogues_triton._swiglu_quant_tiles_kernel"
DISPATCH = "kernels.moe.epilogues_triton._dispatch_quant_kernel"
# PTX instructions counted per row: the sigmoid's SFU approximations, the divisions, the shared-memory split
PTX_OPS = ("ex2.approx.ftz.f32", "rcp.approx.ftz.f32", "div.full.f32", "div.rn.f32", "st.shared", "ld.global")
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+\S")


def shipped_entry(name: str, **want) -> dict:
    """The shipped manifest's entry of kernel `name` whose constexprs include `want`."""
    for spec in tp.Manifest.load(tp.MANIFEST_DIR / MANIFEST).specializations:
        if spec["name"] == name and all(tp.constexpr_values(spec).get(k) == v for k, v in want.items()):
            return spec
    raise LookupError(f"no entry of {name} with {want} in {MANIFEST}")


def with_constexprs(spec: dict, **values) -> dict:
    """`spec` with some constexprs changed (the word loads read h as int32, so its pointer type follows WORDS)."""
    spec = copy.deepcopy(spec)
    names = tp.resolve_kernel(spec["name"]).arg_names
    index = {names[k[0]]: i for i, k in enumerate(spec["constant_keys"])}
    for name, value in values.items():
        spec["constant_vals"][index[name]] = value
    if "WORDS" in values:
        spec["signature"]["h_ptr"] = "*i32" if values["WORDS"] else "*bf16"
    return spec


def compile_sm90(spec: dict):
    return tp.compile_spec(spec, 90)[1]


def sass_instructions(kernel) -> int:
    """Instructions in the kernel's SASS (cuobjdump of its cubin; the trailing BRA-to-self padding included)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        listing = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in listing.splitlines() if SASS_LINE.match(line))


def describe(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {"sass": sass_instructions(kernel), **{op: ptx.count(op) for op in PTX_OPS}}


def rows() -> list[dict]:
    tiles = shipped_entry(TILES, FAST_DIV=True, PDL=True)
    dispatch = shipped_entry(DISPATCH, BLOCK_KB=8, PDL=True)
    out = []
    for words, mufu in ((False, False), (True, False), (False, True), (True, True)):
        out.append({"kernel": "swiglu tiles", "WORDS": words, "MUFU": mufu,
                    **describe(compile_sm90(with_constexprs(tiles, WORDS=words, MUFU=mufu)))})
    for fast_div in (False, True):
        out.append({"kernel": "dispatch quant", "FAST_DIV": fast_div,
                    **describe(compile_sm90(with_constexprs(dispatch, FAST_DIV=fast_div)))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/sm90_sass_epilogues.json")
    args = parser.parse_args()
    import triton

    table = rows()
    cols = ["kernel", "switches", "sass", *PTX_OPS]
    print(" | ".join(cols))
    for r in table:
        switches = ", ".join(f"{k}={r[k]}" for k in ("WORDS", "MUFU", "FAST_DIV") if k in r)
        print(" | ".join(str(v) for v in (r["kernel"], switches, r["sass"], *(r[op] for op in PTX_OPS))))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"triton": triton.__version__, "manifest": MANIFEST, "arch": "sm_90", "rows": table}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
