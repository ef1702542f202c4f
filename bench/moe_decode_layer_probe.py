"""Where the one-token MoE layer kernel's time goes (kernels/moe/moe_decode_layer_cuda.py), on the GPU.

    python -m bench.moe_decode_layer_probe [--experts 128] [--out bench/results/moe_decode_layer_probe_h200.json]

One 120b-shaped layer (random FP8 experts drawn directly in the converted layout, D = I = 2880): the kernel at each
ring depth and the split path (CUDA front + four launches) timed in one process as bench.moe times layers (a CUDA
graph over 4 tokens of different routings, L2 flushed before each replay); then one eager call with the kernel's
%globaltimer stamps: per trace point the CTAs' min / median / max in us after the earliest entry.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from bench.moe_common import graph_time_us
from kernels.moe import moe_decode_layer_cuda as fused
from kernels.moe.fp8_experts import Fp8Experts

DEV = torch.device("cuda")
D = I = 2880
TOP_K = 4


def random_fp8(shape) -> torch.Tensor:
    """Random e4m3 codes, no NaN (0x7f / 0xff): magnitudes 0..0x7d, either sign."""
    mag = torch.randint(0, 0x7E, shape, dtype=torch.uint8, device=DEV)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=DEV) << 7
    return (mag | sign).view(torch.float8_e4m3fn)


def make_layer(e: int) -> Fp8Experts:
    fp8 = Fp8Experts(e, 0, D, I, 1.702, 7.0, DEV)
    with torch.no_grad():
        for i in range(e):  # per expert: a few hundred MB of temporaries at most
            fp8.w13[i].copy_(random_fp8(fp8.w13.shape[1:]))
            fp8.w2[i].copy_(random_fp8(fp8.w2.shape[1:]))
        fp8.w13[..., D:] = 0
        fp8.w2[..., I:] = 0
        fp8.s13.copy_(torch.rand_like(fp8.s13) * 2e-4 + 1e-4)
        fp8.s2.copy_(torch.rand_like(fp8.s2) * 2e-4 + 1e-4)
        fp8.b13.normal_(0, 0.1)
        fp8.b2.normal_(0, 0.1)
    return fp8


def trace_once(fp8, x, w, b, stages: int, producer: str = "bulk", copy_only: bool = False) -> dict:
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    trace = torch.zeros(sms, len(fused.TRACE_POINTS), dtype=torch.int64, device=DEV)
    cache = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    cache.zero_()  # L2 flushed of the weights
    torch.cuda.synchronize()
    fused.decode_layer(x, w, b, TOP_K, fp8, fp8.layer_barrier, stages=stages, trace=trace, producer=producer,
                       copy_only=copy_only)
    torch.cuda.synchronize()
    t = trace.double()
    t0 = t[:, 0].min()
    out = {}
    for k, name in enumerate(fused.TRACE_POINTS):
        col = (t[:, k] - t0) / 1e3
        col = col[t[:, k] > 0]
        if col.numel():
            out[name] = [round(float(col.min()), 2), round(float(col.median()), 2), round(float(col.max()), 2)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--out", default="bench/results/moe_decode_layer_probe_h200.json")
    args = parser.parse_args()
    fp8 = make_layer(args.experts)
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(args.experts, D, device=DEV, generator=g) * D ** -0.5).bfloat16()
    b = (torch.randn(args.experts, device=DEV, generator=g) * 0.1).bfloat16()
    xs = [(torch.randn(1, D, device=DEV, dtype=torch.bfloat16, generator=g),) for _ in range(4)]
    deepest = fused._extension().plan_stages(DEV.index or 0, D, I, fp8.w13.shape[2], fp8.w2.shape[2], 0)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "experts": args.experts,
              "deepest_ring": int(deepest), "us": {}, "trace": {}}

    def split(x):
        fp8.cuda_front, fp8.fused_decode_layer = True, False
        return fp8.routed_forward(x, w, b, TOP_K)

    result["us"]["split"] = graph_time_us(split, xs)[0]
    def timed(stages: int, producer: str, copy_only: bool) -> float:
        return graph_time_us(lambda x: fused.decode_layer(x, w, b, TOP_K, fp8, fp8.layer_barrier, stages=stages,
                                                          producer=producer, copy_only=copy_only)[0], xs)[0]

    for producer in ("bulk", "cp_async"):
        for stages in range(2, deepest + 1):
            result["us"][f"layer_{producer}_s{stages}"] = timed(stages, producer, False)
    for producer in ("bulk", "bulk_tile", "cp_async"):  # the stream alone
        for stages in (2, deepest):
            result["us"][f"copy_{producer}_s{stages}"] = timed(stages, producer, True)
    result["us"]["split_again"] = graph_time_us(split, xs)[0]
    for producer in ("bulk", "cp_async"):
        for copy_only in (False, True):
            trace_once(fp8, xs[0][0], w, b, deepest, producer, copy_only)  # warm
            key = f"{'copy' if copy_only else 'layer'}_{producer}_s{deepest}"
            result["trace"][key] = trace_once(fp8, xs[1][0], w, b, deepest, producer, copy_only)
    mb = 4 * (fp8.w13[0].numel() + fp8.w2[0].numel()) / 1e6
    print(f"MoE layer at T = 1, {args.experts} experts, {mb:.1f} MB of expert weights per token; {result['device']}")
    for name, us in result["us"].items():
        print(f"  {name:<22} {us:7.1f} us  {mb / us:5.2f} TB/s")
    for key, points in result["trace"].items():
        print(f"  trace {key} (us after the first entry: min / median / max over CTAs)")
        for name, (lo, med, hi) in points.items():
            print(f"    {name:<18} {lo:7.2f} {med:7.2f} {hi:7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
