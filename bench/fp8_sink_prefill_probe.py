"""Probe: FlashInfer 0.5.3's FP8 Hopper single-prefill kernel (TMA loads) with gpt-oss's attention sinks, for the
full layers of whole-prompt prefill steps.

    python -m bench.fp8_sink_prefill_probe --out bench/results/fp8_sink_prefill_probe_h200.json     (on the H200)

The wheel's FP8 batch kernels are not usable: the ragged entry point is an empty stub, and the paged one gave
wrong results and a skipped-work speed at full causal and hung with a sliding window on the H200 (2026-12-02;
the hang is FlashInfer's issue #3578, fixed upstream in June 2026 by PR #3682). The single-prefill FP8 kernel is
the one FlashInfer's own test (`tests/attention/test_hopper_fp8_attention.py::test_single_prefill`) covers at head
dim 64, causal. This builds its sink twin: a variant deriving from `StandardFP8Attention` (q / k / v scales per head
folded into the softmax scale, P quantized by 448, P.V dequantized in the finalize) whose softmax is the sink
variant's `OnlineSoftmaxWithSink`, through `gen_customize_single_prefill_module(backend="fa3", fp8_enabled=True)`.
Then, 64 query / 8 KV heads of 64 (both models' shapes), full causal:
1. accuracy against kernels/attention/reference.sink_attention in fp32, on the dequantized FP8 inputs (what the
   kernel can at best compute) and on the bf16 inputs (what FP8 costs), beside the bf16 fa3 ragged kernel's own
   error on the bf16 inputs; prompts of 333, 1000 and 8192 tokens and 700 queries after a 600-token prefix;
2. speed at 2k-16k tokens: the FP8 kernel, the per-head quantization of q / k / v
   (kernels/attention/fp8_heads_triton), and FlashInfer's bf16 fa3 ragged sink kernel (what the engine runs for
   these layers), in one process; us and TFLOP/s (causal: 2 * T^2 * Hq * D FLOPs).
Exits non-zero if the FP8 output is not finite or is off its dequantized twin by more than 5%. Nothing in the
engine uses this yet.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from kernels.attention import flashinfer_ops
from kernels.attention.fp8_heads_triton import quantize_heads_fp8
from kernels.attention.reference import sink_attention

HQ, HKV, D = 64, 8, 64
SCALE = D ** -0.5
FP8 = torch.float8_e4m3fn
MASK_CAUSAL, LAYOUT_NHD = 1, 0


def fp8_sink_decl() -> str:
    """The variant: FlashInfer's FP8 attention with the sink softmax (log2 units, as the bf16 sink variant)."""
    from flashinfer.jit.attention.variants import attention_sink_fa3_decl

    softmax_with_sink = attention_sink_fa3_decl.split("struct AttentionSink")[0]
    return "#include <flashinfer/attention/hopper/variants.cuh>\n" + softmax_with_sink + r"""
struct FP8AttentionSink : StandardFP8Attention {
  float log_sink;
  template <typename MainloopParams, typename BlockCoord>
  __device__ FP8AttentionSink(const MainloopParams& params, const BlockCoord& block_coord)
      : StandardFP8Attention(params, block_coord) {
    auto [q_tile_idx, qo_head_idx, kv_head_idx, qo_indptr, kv_indptr, qo_len, kv_len, batch_idx] = block_coord;
    log_sink = params.additional_params.sink[qo_head_idx] * math::log2e;
  }
  template <int NUM_ROWS_PER_THREAD>
  __device__ auto GetAttentionUpdater() {
    return OnlineSoftmaxWithSink<NUM_ROWS_PER_THREAD>(sm_scale_with_qk_log2, log_sink);
  }
};
"""


def fp8_single_spec():
    from flashinfer.jit.attention import gen_customize_single_prefill_module

    return gen_customize_single_prefill_module(
        "fa3", "single_prefill_fp8_attention_sink_e4m3_bf16_d64", FP8, FP8, torch.bfloat16, D, D,
        ["sink", "scale_q", "scale_k", "scale_v"], ["float"] * 4, ["sm_scale"], ["double"], "FP8AttentionSink",
        fp8_sink_decl(), use_sliding_window=False, use_fp16_qk_reduction=False, pos_encoding_mode=0, fp8_enabled=True)


def run_fp8(module, q8, k8, v8, sq, sk, sv, sinks, out, tmp) -> torch.Tensor:
    """q8 [n, Hq, D], k8 / v8 [L, Hkv, D] e4m3 (L >= n: the queries are the last n positions), causal."""
    module.run(q8, k8, v8, tmp, out, None, MASK_CAUSAL, LAYOUT_NHD, -1, sinks, sq, sk, sv, SCALE)
    return out


def reference_by_head(q, k, v, sinks) -> torch.Tensor:
    """sink_attention in fp32, one KV head group at a time (an 8k x 8k score matrix per group)."""
    g = HQ // HKV
    return torch.cat([sink_attention(q[:, h * g:(h + 1) * g].float(), k[:, h:h + 1].float(), v[:, h:h + 1].float(),
                                     sinks[h * g:(h + 1) * g], SCALE, None) for h in range(HKV)], dim=1)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def bf16_ragged(workspace):
    wrapper = flashinfer_ops.sink_prefill_ragged_wrapper(workspace, -1, "fa3", D)
    return wrapper


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/fp8_sink_prefill_probe.json")
    p.add_argument("--tokens", default="2048,4096,8192,16384")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    module = fp8_single_spec().build_and_load()
    workspace = flashinfer_ops.new_workspace(dev)
    ragged = bf16_ragged(workspace)
    tmp = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
              "build_s": time.perf_counter() - t0, "accuracy": [], "speed": []}
    print(f"modules built / loaded in {result['build_s']:.0f} s", flush=True)

    def inputs(n, kv):
        q = torch.randn(n, HQ, D, device=dev, generator=gen).bfloat16()
        k = torch.randn(kv, HKV, D, device=dev, generator=gen).bfloat16()
        v = torch.randn(kv, HKV, D, device=dev, generator=gen).bfloat16()
        return q, k, v, torch.randn(HQ, device=dev, generator=gen) * 2

    for n, kv in [(333, 333), (1000, 1000), (700, 1300), (8192, 8192)]:
        q, k, v, sinks = inputs(n, kv)
        (q8, sq), (k8, sk), (v8, sv) = quantize_heads_fp8(q), quantize_heads_fp8(k), quantize_heads_fp8(v)
        got = run_fp8(module, q8, k8, v8, sq, sk, sv, sinks, torch.empty_like(q), tmp)
        deq = [t.float() * s[None, :, None] for t, s in ((q8, sq), (k8, sk), (v8, sv))]
        want_bf16 = reference_by_head(q, k, v, sinks)
        row = {"queries": n, "keys": kv, "finite": bool(torch.isfinite(got).all()),
               "fp8_vs_dequantized_twin": rel(got, reference_by_head(*deq, sinks)),
               "fp8_vs_bf16_twin": rel(got, want_bf16)}
        if n == kv:
            qo = torch.tensor([0, n], dtype=torch.int32)
            flashinfer_ops.plan_sink_prefill_ragged(ragged, qo, qo, HQ, HKV, D, -1, SCALE)
            row["bf16_kernel_vs_bf16_twin"] = rel(
                flashinfer_ops.run_sink_prefill_ragged(ragged, q, k, v, sinks, SCALE, out=torch.empty_like(q)),
                want_bf16)
        result["accuracy"].append(row)
        print(row, flush=True)

    for t in [int(x) for x in args.tokens.split(",")]:
        q, k, v, sinks = inputs(t, t)
        (q8, sq), (k8, sk), (v8, sv) = quantize_heads_fp8(q), quantize_heads_fp8(k), quantize_heads_fp8(v)
        out = torch.empty_like(q)
        flops = 2.0 * t * t * HQ * D
        fp8_us = do_bench(lambda: run_fp8(module, q8, k8, v8, sq, sk, sv, sinks, out, tmp), warmup=5, rep=100,
                          return_mode="median") * 1e3
        quant_us = do_bench(lambda: (quantize_heads_fp8(q, q8, sq), quantize_heads_fp8(k, k8, sk),
                                     quantize_heads_fp8(v, v8, sv)), warmup=5, rep=100, return_mode="median") * 1e3
        qo = torch.tensor([0, t], dtype=torch.int32)
        flashinfer_ops.plan_sink_prefill_ragged(ragged, qo, qo, HQ, HKV, D, -1, SCALE)
        bf16_us = do_bench(lambda: flashinfer_ops.run_sink_prefill_ragged(ragged, q, k, v, sinks, SCALE, out=out),
                           warmup=5, rep=100, return_mode="median") * 1e3
        row = {"tokens": t, "fp8_us": fp8_us, "fp8_tflops": flops / fp8_us / 1e6, "quantize_us": quant_us,
               "bf16_ragged_us": bf16_us, "bf16_tflops": flops / bf16_us / 1e6,
               "speedup_with_quantize": bf16_us / (fp8_us + quant_us)}
        result["speed"].append(row)
        print(row, flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\nfull causal, 64 / 8 heads of 64        us            TFLOP/s")
    print(f"{'tokens':>7s} {'fp8':>9s} {'quant':>7s} {'bf16':>9s} {'fp8':>7s} {'bf16':>7s}  bf16 / (fp8 + quant)")
    for r in result["speed"]:
        print(f"{r['tokens']:7d} {r['fp8_us']:9.1f} {r['quantize_us']:7.1f} {r['bf16_ragged_us']:9.1f} "
              f"{r['fp8_tflops']:7.1f} {r['bf16_tflops']:7.1f}  {r['speedup_with_quantize']:.2f}x")
    ok = all(r["finite"] and r["fp8_vs_dequantized_twin"] < 0.05 for r in result["accuracy"])
    print("accuracy", "ok" if ok else "NOT ok", [(r["queries"], r["keys"], round(r["fp8_vs_dequantized_twin"], 4),
                                                round(r["fp8_vs_bf16_twin"], 4), r.get("bf16_kernel_vs_bf16_twin"))
                                               for r in result["accuracy"]])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
