"""The FP8 decode experts after the front: one CUDA launch (fp8_decode_experts, per ring depth) against the three
launches (gate_up decode GEMM, SwiGLU + quantization, down decode GEMM), both followed by the same combine; and
how many of the one-launch kernel's 4-CTA clusters fit on the GPU at once.

    python -m bench.fused_experts_probe [--tokens 1,2,4,8] [--out bench/results/fused_experts_probe_h200.json]

20b shapes (32 experts, D = I = 2880). The front runs once per input outside the timing; each timed CUDA graph
replays the experts over 8 inputs whose routings differ (the weights of consecutive calls then come from HBM),
with PDL as in a decode step's graph; us per call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.moe_common import graph_time_us
from kernels.moe import decode_front_triton as front
from kernels.moe import fp8_decode_experts as fde
from kernels.moe import triton_grouped_gemm as tgg
from kernels.moe.fp8_experts import Fp8Experts

E, D, I, K = 32, 2880, 2880, 4  # noqa: E741


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--out", default="bench/results/fused_experts_probe_h200.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fp8 = Fp8Experts.from_dense(torch.randn(E, 2 * I, D, device=dev, generator=g, dtype=torch.bfloat16) * D ** -0.5,
                                torch.randn(E, 2 * I, device=dev, generator=g) * 0.1,
                                torch.randn(E, D, I, device=dev, generator=g, dtype=torch.bfloat16) * I ** -0.5,
                                torch.randn(E, D, device=dev, generator=g) * 0.1, 0, 1.702, 7.0)
    fp8.backend = "triton"
    rw = (torch.randn(E, D, device=dev, generator=g) * D ** -0.5).bfloat16()
    rb = (torch.randn(E, device=dev, generator=g) * 0.1).bfloat16()
    ext = fde._extension()
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        sets = []
        for _ in range(8):
            x = torch.randn(t, D, device=dev, dtype=torch.bfloat16, generator=g)
            sets.append((x, *front.decode_front(x, rw, rb, K, 0, E, fp8.w13.shape[2], front.new_ticket(dev))))

        def three(x, ids, weights, plan, a):
            return fp8._experts_gpu(x, ids, weights, plan, tgg.decode_splits(t), a, "triton")

        us, mode = graph_time_us(three, sets)
        row = {"tokens": t, "three_launches_us": us, "mode": mode}
        for stages in [int(v) for v in args.stages.split(",")]:
            fde.STAGES = stages

            def fused(x, ids, weights, plan, a):
                return fde.decode_experts(x, a, ids, weights, plan, fp8.w13, fp8.s13, fp8.b13, fp8.w2, fp8.s2, fp8.b2,
                                          0, 1.702, 7.0)

            got = fused(*sets[0])
            diff = float((got.float() - three(*sets[0]).float()).norm() / three(*sets[0]).float().norm())
            us_f, mode_f = graph_time_us(fused, sets)
            slots = max(1, min(t * K, E))
            clusters, per_sm = ext.occupancy(stages, t, fp8.w13.shape[2], fp8.w2.shape[2] // 128 * 4, slots)
            row[f"fused_s{stages}"] = dict(us=us_f, mode=mode_f, rel_diff=diff, max_active_clusters=clusters,
                                           ctas_per_sm=per_sm, clusters_launched=fp8.w2.shape[2] // 128 * slots)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"\nexperts after the front + combine, 20b, us per call ({torch.cuda.get_device_name()})")
    stages = [int(v) for v in args.stages.split(",")]
    print(f"{'T':>3} {'three':>8} " + " ".join(f"{'S=' + str(s):>22}" for s in stages))
    for r in rows:
        cells = [f"{r[f'fused_s{s}']['us']:8.1f} ({r[f'fused_s{s}']['max_active_clusters']}cl,"
                 f"{r[f'fused_s{s}']['ctas_per_sm']}/SM)" for s in stages]
        print(f"{r['tokens']:>3} {r['three_launches_us']:8.1f} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
