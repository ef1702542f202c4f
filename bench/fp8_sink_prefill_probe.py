"""Probe: FlashInfer 0.5.3's FP8 Hopper (fa3) prefill kernel with gpt-oss's attention sinks. Not yet run on a GPU.

    python -m bench.fp8_sink_prefill_probe --out bench/results/fp8_sink_prefill_probe_h200.json     (on the H200)

FlashInfer ships an FP8 fa3 prefill mainloop for paged K/V only and no FP8 sink variant (kernels/attention/NOTES.md,
"FP8 FA3 sink prefill in FlashInfer 0.5.3"). This builds one: a variant deriving from FlashInfer's
`StandardFP8Attention` (q / k / v scales per head folded into the softmax scale, P quantized by 448, P.V dequantized
in the finalize) whose softmax is the sink variant's `OnlineSoftmaxWithSink`, through
`gen_customize_batch_prefill_module(..., fp8_enabled=True)` (the paged wrapper's jit_args). Then:
1. accuracy: two sequences (300 and 1000 tokens, 16-token pages) at a window of 128 and full causal, 64 query / 8 KV
   heads of 64, against kernels/attention/reference.sink_attention in fp32 on the dequantized FP8 inputs (what the
   kernel can at best compute) and on the bf16 inputs (what FP8 costs);
2. speed: one 8k-token prompt, full causal, FP8 against FlashInfer's bf16 fa3 sink kernels (paged and ragged, the
   ragged one is what the engine runs for full layers), us and TFLOP/s (causal: 2 * T^2 * Hq * D FLOPs).
A bf16 output is asked for although the paged wrapper's `run` insists out.dtype == q.dtype (prefill.py:2083-2091):
that check is bypassed for these calls only. If the module does not compile, or the output is not bf16-correct,
the probe says so and exits non-zero; nothing in the engine uses it.
This file and kernels/attention/flashinfer_ops.py are the only ones that import flashinfer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from kernels.attention import flashinfer_ops
from kernels.attention.reference import sink_attention

HQ, HKV, D, PAGE = 64, 8, 64, 16
SCALE = D ** -0.5
FP8 = torch.float8_e4m3fn


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


def fp8_sink_wrapper(workspace: torch.Tensor):
    import flashinfer

    args = ["fp8_attention_sink_probe_swa", FP8, FP8, torch.bfloat16, torch.int32, D, D,
            ["sink", "scale_q", "scale_k", "scale_v"], ["float"] * 4, ["sm_scale"], ["double"], "FP8AttentionSink",
            fp8_sink_decl()]
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", backend="fa3", jit_args=args,
        jit_kwargs=dict(use_sliding_window=True, use_fp16_qk_reduction=False, pos_encoding_mode=0, fp8_enabled=True))


@contextlib.contextmanager
def bf16_out_allowed():
    import flashinfer.prefill as fp

    check = fp.check_shape_dtype_device
    fp.check_shape_dtype_device = lambda *a, **k: None
    try:
        yield
    finally:
        fp.check_shape_dtype_device = check


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H, D] -> (e4m3, fp32 scale per head = amax / 448)."""
    s = (x.float().abs().amax((0, 2)) / 448.0).clamp_min(1e-12)
    return (x.float() / s[None, :, None]).to(FP8), s


def page_lists(lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = [-(-n // PAGE) for n in lens]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, pages)], dtype=torch.int32)
    return qo_indptr, kv_indptr, torch.arange(int(kv_indptr[-1]), dtype=torch.int32, device=device), last


def plan(wrapper, lens, window_left: int, dtype, device) -> None:
    qo, kv, idx, last = page_lists(lens, device)
    wrapper.plan(qo, kv, idx, last, HQ, HKV, D, PAGE, causal=True, sm_scale=SCALE, window_left=window_left,
                 q_data_type=dtype, kv_data_type=dtype)


def case(lens: list[int], device, gen) -> dict:
    """bf16 q [T, Hq, D] and paged k / v [pages, PAGE, Hkv, D] with each sequence's keys = its queries' span."""
    pages = sum(-(-n // PAGE) for n in lens)
    q = torch.randn(sum(lens), HQ, D, device=device, generator=gen).bfloat16()
    k = torch.randn(pages * PAGE, HKV, D, device=device, generator=gen).bfloat16()
    v = torch.randn(pages * PAGE, HKV, D, device=device, generator=gen).bfloat16()
    sinks = torch.randn(HQ, device=device, generator=gen) * 2
    return dict(lens=lens, q=q, k=k, v=v, sinks=sinks)


def reference(c: dict, q, k, v, window: int | None) -> torch.Tensor:
    out, q0, p0 = [], 0, 0
    for n in c["lens"]:
        out.append(sink_attention(q[q0:q0 + n].float(), k[p0:p0 + n].float(), v[p0:p0 + n].float(), c["sinks"], SCALE,
                                  window))
        q0, p0 = q0 + n, p0 + -(-n // PAGE) * PAGE
    return torch.cat(out)


def run_fp8(wrapper, c: dict, quantized: dict, out: torch.Tensor) -> torch.Tensor:
    (q8, sq), (k8, sk), (v8, sv) = quantized["q"], quantized["k"], quantized["v"]
    with bf16_out_allowed():
        return wrapper.run(q8, (k8.view(-1, PAGE, HKV, D), v8.view(-1, PAGE, HKV, D)), c["sinks"], sq, sk, sv, SCALE,
                           out=out)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/fp8_sink_prefill_probe.json")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--windows", default="128,full", help="accuracy cases: sliding windows and/or 'full' (causal); the "
                   "first H200 run (2026-12-02) hung in its window-128 call")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    workspace = flashinfer_ops.new_workspace(dev)
    t0 = time.perf_counter()
    fp8 = fp8_sink_wrapper(workspace)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
              "build_s": time.perf_counter() - t0, "accuracy": [], "speed": {}}
    print(f"FP8 sink module built in {result['build_s']:.0f} s", flush=True)

    c = case([300, 1000], dev, gen)
    quantized = {name: quantize_per_head(c[name]) for name in ("q", "k", "v")}
    deq = {name: t.float() * s[None, :, None] for name, (t, s) in quantized.items()}
    for window in [None if w == "full" else int(w) for w in args.windows.split(",")]:
        plan(fp8, c["lens"], window - 1 if window else -1, FP8, dev)
        got = run_fp8(fp8, c, quantized, torch.empty_like(c["q"]))
        row = {"window": window, "rel_vs_dequantized_twin": rel(got, reference(c, deq["q"], deq["k"], deq["v"], window)),
               "rel_vs_bf16_twin": rel(got, reference(c, c["q"], c["k"], c["v"], window)),
               "finite": bool(torch.isfinite(got).all())}
        result["accuracy"].append(row)
        print(row, flush=True)

    t = args.tokens
    c = case([t], dev, gen)
    quantized = {name: quantize_per_head(c[name]) for name in ("q", "k", "v")}
    out = torch.empty_like(c["q"])
    plan(fp8, [t], -1, FP8, dev)
    flops = 2.0 * t * t * HQ * D
    us = do_bench(lambda: run_fp8(fp8, c, quantized, out), warmup=5, rep=100, return_mode="median") * 1e3
    result["speed"]["fp8_paged"] = {"us": us, "tflops": flops / us / 1e6}
    bf16 = flashinfer_ops.sink_prefill_wrapper(workspace, -1, "fa3", D)
    qo, kv, idx, last = page_lists([t], dev)
    flashinfer_ops.plan_sink_prefill(bf16, qo, kv, idx, last, HQ, HKV, D, PAGE, -1, SCALE)
    kp, vp = c["k"].view(-1, PAGE, HKV, D), c["v"].view(-1, PAGE, HKV, D)
    us = do_bench(lambda: flashinfer_ops.run_sink_prefill(bf16, c["q"], kp, vp, c["sinks"], SCALE, out=out),
                  warmup=5, rep=100, return_mode="median") * 1e3
    result["speed"]["bf16_paged"] = {"us": us, "tflops": flops / us / 1e6}
    ragged = flashinfer_ops.sink_prefill_ragged_wrapper(workspace, -1, "fa3", D)
    flashinfer_ops.plan_sink_prefill_ragged(ragged, qo, qo, HQ, HKV, D, -1, SCALE)
    us = do_bench(lambda: flashinfer_ops.run_sink_prefill_ragged(ragged, c["q"], c["k"][:t], c["v"][:t], c["sinks"],
                                                                 SCALE, out=out),
                  warmup=5, rep=100, return_mode="median") * 1e3
    result["speed"]["bf16_ragged"] = {"us": us, "tflops": flops / us / 1e6}

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{t}-token prompt, full causal, 64 / 8 heads of 64:")
    for name, r in result["speed"].items():
        print(f"  {name:12s} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s")
    ok = all(r["finite"] and r["rel_vs_dequantized_twin"] < 0.05 for r in result["accuracy"])
    print("accuracy", "ok" if ok else "NOT ok", [(r["window"], round(r["rel_vs_dequantized_twin"], 4),
                                                round(r["rel_vs_bf16_twin"], 4)) for r in result["accuracy"]])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
