"""The fused MoE decode front against the unfused launches it replaces, per call, on the GPU.

    python -m bench.decode_front_sweep --out bench/results/decode_front_h200.json

Each variant is captured 50 times in one CUDA graph and the replay timed (launch gaps included, as
in the decode step): unfused = router nn.Linear + topk_softmax + plan_masked + dispatch_quant;
fused = decode_front_triton.decode_front at several num_warps. Router shapes of 20b (32 experts) and
120b (128), hidden 2880, T = 1, 4, 16.
Timing: bench/moe_common.graph_us (triton do_bench median over graph replays); the committed
bench/results/decode_front_h200.json was timed with CUDA events, median of 5 replays, over the same graph.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.moe_common import graph_us
from kernels.moe import decode_front_triton as front
from kernels.moe import epilogues_triton as epi
from kernels.moe import routing_triton as rt
from kernels.moe.fp8_quant import padded

D, K = 2880, 4


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/decode_front.json")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for e in (32, 128):
        w = torch.randn(e, D, device=dev, dtype=torch.bfloat16) * D ** -0.5
        b = torch.randn(e, device=dev, dtype=torch.bfloat16) * 0.1
        ticket = front.new_ticket(dev)
        for t in (1, 4, 16):
            x = torch.randn(t, D, device=dev, dtype=torch.bfloat16)

            def unfused():
                ids, _ = rt.topk_softmax(F.linear(x, w, b), K)
                plan = rt.plan_masked(ids, 0, e, t)
                epi.dispatch_quant(x, plan.row_of_pair, K, epi.Fp8Rows.empty(e, t, padded(D), dev))

            row = {"experts": e, "tokens": t, "unfused_us": graph_us(unfused)}
            for nw in (2, 4, 8, 16):
                row[f"fused_w{nw}_us"] = graph_us(lambda: front.decode_front(x, w, b, K, 0, e, padded(D), ticket, nw))
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
