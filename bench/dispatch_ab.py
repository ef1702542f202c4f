"""The prefill dispatch quantization (kernels/moe/epilogues_triton.dispatch_quant: each token's bf16 row quantized
per 128 channels to FP8 and stored into its top-4 pairs' rows of the contiguous layout) by launch shape, same
process, beside a device copy of the same bytes.

    python -m bench.dispatch_ab [--out bench/results/dispatch_ab.json]

Two numbers first (120b, 8k prompt): reads 8,192 x 2,880 bf16 (47 MB), writes 32,768 rows x 2,944 FP8 (96.5 MB)
and their fp32 scales (3 MB): 147 MB, ~37 us at 4 TB/s; no FLOPs to speak of. The sweep asks whether the launch
shape bounds it: k-blocks per program (the shipped prefill shape is 8, one program per token and 1,024 channels) and
warps. Every IEEE variant's output must equal the shipped shape's bit for bit; fast_div's codes one FP8 step off are
counted. (It was written when the forward's profile seemed to give ~89 us per call; that was 72 calls counted as 36,
the kernel also quantizing the FP8 O projection's input. H200, 2026-12-06: the shipped shape is the fastest, 52.8 us
at 120b 8k against a 39.5 us copy; kernels/moe/NOTES.md, item 5.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from bench.moe_common import distinct_experts
from kernels.moe import epilogues_triton as epi
from kernels.moe.fp8_quant import fp8_steps, padded

HIDDEN = 2880
# (name, tokens, experts): the prompt sizes whose forwards the prefill targets time
SHAPES = (("20b 4k", 4096, 32), ("120b 8k", 8192, 128))
# (k-blocks per program, warps); (8, 4) is what dispatch_quant launches for prefill-sized calls
LAUNCHES = ((8, 4), (8, 2), (8, 8), (4, 4), (4, 2), (2, 2), (2, 1), (1, 1), (16, 4), (16, 8), (32, 8))


def sweep(name: str, tokens: int, experts: int, dev) -> dict:
    from kernels.moe import routing_triton

    ids = distinct_experts(tokens, experts, seed=tokens).to(dev)
    plan = routing_triton.plan_contiguous(ids, 0, experts, 128)
    x = torch.randn(tokens, HIDDEN, device=dev).bfloat16() * 3
    pairs = ids.numel()
    moved = tokens * HIDDEN * 2 + pairs * padded(HIDDEN) * (1 + 4 / 128)
    row = {"shape": name, "tokens": tokens, "pairs": pairs, "bytes": moved}
    written = plan.row_of_pair.long().flatten()
    src = torch.empty(int(moved) // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_us = do_bench(lambda: dst.copy_(src)) * 1e3  # reads and writes `moved` bytes in all
    row["copy ceiling"] = {"us": copy_us, "GB/s": moved / copy_us / 1e3}
    want = None
    for fast_div in (False, True):
        for kbp, warps in LAUNCHES:
            a = epi.Fp8Rows.empty(1, plan.num_rows, padded(HIDDEN), dev)

            def run(a=a, kbp=kbp, warps=warps, fast_div=fast_div):
                epi.dispatch_quant(x, plan.row_of_pair, 4, a, fast_div=fast_div, kb_per_program=kbp, num_warps=warps)

            run()
            got = (a.data[written].clone(), a.scales_rows()[written].clone())
            us = do_bench(run) * 1e3
            label = f"{'fast' if fast_div else 'ieee'} kb{kbp} w{warps}"
            entry = {"us": us, "GB/s": moved / us / 1e3}
            if want is None:
                want = got  # the shipped launch, IEEE: the reference of every other variant
            elif not fast_div:
                entry["bitwise"] = bool(torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                                        and torch.equal(got[1], want[1]))
            else:
                steps = fp8_steps(got[0], want[0])
                entry["off1"] = float((steps == 1).float().mean())
                entry["more"] = int((steps > 1).sum())
            row[label] = entry
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/dispatch_ab.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = [sweep(name, tokens, experts, dev) for name, tokens, experts in SHAPES]
    for row in rows:
        ceiling = row["copy ceiling"]
        print(f"{row['shape']}: {row['bytes'] / 1e6:.0f} MB; copy of the same bytes {ceiling['us']:.1f} us "
              f"({ceiling['GB/s']:.0f} GB/s)")
        for label, entry in row.items():
            if not isinstance(entry, dict) or label == "copy ceiling":
                continue
            extra = ""
            if "bitwise" in entry:
                extra = "" if entry["bitwise"] else "  OUTPUT DIFFERS"
            elif "off1" in entry:
                extra = f"  off1 {entry['off1']:.1e}, >1: {entry['more']}"
            print(f"  {label:16s} {entry['us']:7.1f} us ({entry['GB/s']:5.0f} GB/s){extra}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                               "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
