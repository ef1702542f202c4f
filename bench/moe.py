"""The MoE layer of gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts) on one H200.

    python -m bench.moe [--quick] [--out bench/results/moe_h200.json] [--load-bench DIR]
    python -m bench.moe --warmup-shard I/N     # compile the kernels of every I-th case only, no timing

Variants, each checked against TorchExperts (bf16, same dequantized weights) before it is timed:
  fp8_dg     Fp8Experts, DeepGEMM grouped GEMMs only (masked layout for T <= 64, contiguous/psum above)
  fp8_dg_alt the other layout at T = 64 and 512 (how the threshold was chosen)
  fp8_tr     Fp8Experts, Triton only (the decode GEMM for T <= 64, the grouped GEMM above)
  fp8_routed (T <= 16) router + layer as the engine's decode step runs them: Fp8Experts.routed_forward, the
             fused decode front (router GEMV, top-k, plan, quantization in one launch; at T = 1 the front
             EngineConfig.decode_front="auto" picks: the CUDA cluster front for 120b's 128 experts) then fp8_tr's path
The engine runs fp8_tr's path at T <= 64 and fp8_dg's above (Fp8Experts.decode_kernel = "triton"), except that
contiguous GEMMs of at most 16 rows per expert take the segments GEMM (Fp8Experts.segments_max_rows; set to 0 here,
so fp8_dg / fp8_tr time DeepGEMM / the general Triton GEMM; bench/moe_segments.py compares the two).
  bf16       torch bf16: argsort dispatch + torch._grouped_mm (CUTLASS) x2 + index_add combine
Times: median of triton.testing.do_bench (L2 flushed before each call) over a CUDA graph of R
forwards on R different random routings (R = 4 for T <= 512), divided by R.
Also: the grouped GEMM alone at 512 tokens per expert (gate_up shape), the decode GEMMs alone
(T = 1, 8, 64: tile sweep of the decode kernel vs the general kernel and DeepGEMM), and the dense layers
(QKV, O, router, unembedding) in bf16 vs FP8 at T = 1, 64, 4096.

Bytes and FLOPs first (D = I = 2880, K padded to 2944):
  one expert, FP8:  gate_up 5760 x 2944 + down 2880 x 2944 = 25.44 MB (+ 6 kB of scales)
  one expert, bf16: (5760 x 2880 + 2880 x 2880) x 2        = 49.77 MB
  FLOPs per token-expert pair: 2 x (5760 + 2880) x 2880     = 49.8 MFLOP
  active experts at T tokens: E (1 - (1 - 4/E)^T): 120b T=1 4, T=8 28.7, T=64 111, T>=512 ~128
  120b decode T=1: 4 x 25.44 MB = 101.7 MB -> 23.7 us at the 4.3 TB/s copy ceiling (FLOPs negligible)
  120b T=64: 2.83 GB -> 657 us;  T=512: 3.26 GB -> 757 us (102 GFLOP: 80 us at 1.27 PFLOP/s)
  20b  T=64: all 32 experts, 814 MB -> 189 us;  T=4096: 815 GFLOP -> 642 us at 1.27 PFLOP/s
  T=16384: 3.26 TFLOP -> 2.57 ms (either model). The crossover (bytes time = FLOPs time) for the
  120b layer is near T = 4096; below it the layer should stream weights at close to 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from bench.moe_common import (BF16_EXPERT_BYTES, COPY_TBPS, DEV, FLOP_PER_PAIR, FP8_EXPERT_BYTES, FP8_PFLOPS, TOKENS,
                              TOP_K, D, I, MODELS, calc_diff, graph_time_us)
from bench.moe_gemm import bench_decode_gemm, bench_dense, bench_grouped_gemm
from kernels.moe import deep_gemm_ops
from kernels.moe import triton_grouped_gemm as tgg
from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
from kernels.moe.fp8_experts import Fp8Experts
from kernels.moe.fp8_quant import quantize_weight_blocks
from kernels.moe.reference import clamped_swiglu, route

class Layer:
    """One MoE layer: bf16 weights (the baseline) and the Fp8Experts made from them."""

    def __init__(self, num_experts: int, with_bf16: bool = True):
        g = torch.Generator(device=DEV).manual_seed(num_experts)
        self.e = num_experts
        if not with_bf16:  # a warm-up shard only compiles kernels: placeholder weights, little memory
            self.fp8 = Fp8Experts(num_experts, 0, D, I, 1.702, 7.0, DEV)
            return
        self.w13 = torch.randn(num_experts, 2 * I, D, device=DEV, dtype=torch.bfloat16, generator=g) * D ** -0.5
        self.w2 = torch.randn(num_experts, D, I, device=DEV, dtype=torch.bfloat16, generator=g) * I ** -0.5
        self.b13 = torch.randn(num_experts, 2 * I, device=DEV, generator=g) * 0.1
        self.b2 = torch.randn(num_experts, D, device=DEV, generator=g) * 0.1
        self.fp8 = Fp8Experts.from_dense(self.w13, self.b13, self.w2, self.b2, 0, 1.702, 7.0)
        # the reference and the bf16 baseline use the weights the FP8 layer computes with
        self.ref = self.fp8.dequantized(torch.bfloat16)
        self.w13, self.w2 = self.ref.gate_up_proj, self.ref.down_proj
        self.b13_bf, self.b2_bf = self.b13.bfloat16(), self.b2.bfloat16()

    def bf16_forward(self, x, ids, weights):
        """torch bf16 grouped-matmul MoE (no host sync): sort pairs by expert, two grouped GEMMs."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, dtype=torch.int32, device=DEV).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        token = order // k
        expert = flat[order]
        h = torch._grouped_mm(x[token], self.w13.transpose(1, 2), offs=offs) + self.b13_bf[expert]
        y = torch._grouped_mm(clamped_swiglu(h, 1.702, 7.0), self.w2.transpose(1, 2), offs=offs) + self.b2_bf[expert]
        out = torch.zeros(t, D, dtype=torch.float32, device=DEV)
        out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None])
        return out.bfloat16()


def inputs(t: int, e: int, rot: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    sets = []
    for _ in range(rot):
        x = torch.randn(t, D, device=DEV, dtype=torch.bfloat16, generator=g)
        ids, w = route(torch.randn(t, e, device=DEV, generator=g), TOP_K)
        sets.append((x, ids, w))
    return sets


def layer_cases(quick: bool, tokens: list[int] | None = None):
    tokens = tokens or ([1, 64, 4096] if quick else TOKENS)
    for model, e in MODELS.items():
        for t in tokens:
            yield model, e, t


def variants_for(t: int) -> list[tuple[str, str, int, bool]]:
    """(name, backend, masked_max_tokens, use_psum)."""
    out = []
    if deep_gemm_ops.available():
        out.append(("fp8_dg", "deep_gemm", 64, True))
        if t in (64, 512):
            out.append(("fp8_dg_alt", "deep_gemm", 0 if t <= 64 else 10 ** 9, True))
        if t > 64:  # contiguous layout with per-row m_indices instead of psum
            out.append(("fp8_dg_mi", "deep_gemm", 64, False))
    out.append(("fp8_tr", "triton", 64, True))
    out.append(("bf16", "bf16", 0, True))
    return out


def bench_layers(quick: bool, shard: tuple[int, int] | None, tokens: list[int] | None = None) -> list[dict]:
    rows, layers = [], {}
    for index, (model, e, t) in enumerate(layer_cases(quick, tokens)):
        if shard and index % shard[1] != shard[0]:
            continue
        if e not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[e] = Layer(e, with_bf16=shard is None)
        layer = layers[e]
        rot = 4 if t <= 512 else 1
        sets = inputs(t, e, rot, seed=t)
        active = int(torch.unique(torch.cat([s[1].reshape(-1) for s in sets])).numel())
        distinct = sum(int(torch.unique(s[1]).numel()) for s in sets) / rot
        for name, backend, masked_max, use_psum in variants_for(t):
            if shard and backend == "bf16":
                continue
            if backend == "bf16":
                fn = layer.bf16_forward
            else:
                layer.fp8.backend, layer.fp8.masked_max_tokens, layer.fp8.use_psum = backend, masked_max, use_psum
                layer.fp8.decode_kernel = "deep_gemm" if backend == "deep_gemm" else "triton"
                layer.fp8.segments_max_rows = 0
                fn = layer.fp8
            try:
                out = fn(*sets[0])
            except RuntimeError as exc:  # report and go on: one broken case must not cost the run
                print(f"{model:>5} T={t:<6} {name:<10} FAILED {str(exc).splitlines()[0][:160]}", flush=True)
                rows.append(dict(model=model, experts=e, tokens=t, variant=name, error=str(exc)[:300]))
                continue
            if shard:
                continue  # compiled: that is all a warm-up shard is for
            diff = calc_diff(out, layer.ref(*sets[0]))
            us, mode = graph_time_us(fn, sets)
            extra = {"experts_touched_by_rotation": active}
            if name in ("fp8_dg", "fp8_tr") and model == "120b" and t in (1, 64, 4096):
                try:
                    extra["stages_us"] = stage_breakdown(layer, *sets[0], backend)
                    print(f"  stages {extra['stages_us']}", flush=True)
                except RuntimeError as exc:
                    print(f"  stage breakdown failed: {str(exc).splitlines()[0][:160]}")
            rows.append(layer_row(model, e, t, name, us, mode, diff, distinct,
                                  BF16_EXPERT_BYTES if backend == "bf16" else FP8_EXPERT_BYTES, **extra))
        if not shard and t <= ROUTED_MAX_TOKENS:
            rows.append(bench_routed(model, layer, t))
    return rows


ROUTED_MAX_TOKENS = 16


def bench_routed(model: str, layer: Layer, t: int) -> dict:
    """The layer as the engine's decode step runs it (`Fp8Experts.routed_forward`): router GEMV, routing,
    plan and quantization in the fused front, then the Triton decode GEMMs, in a CUDA graph (PDL on) over
    4 inputs whose routings differ. Bytes counted: the experts each input routes to (the router's 0.7 MB
    left out)."""
    g = torch.Generator(device=DEV).manual_seed(1000 + t)
    rw = (torch.randn(layer.e, D, device=DEV, generator=g) * D ** -0.5).bfloat16()
    rb = (torch.randn(layer.e, device=DEV, generator=g) * 0.1).bfloat16()
    xs = [(torch.randn(t, D, device=DEV, dtype=torch.bfloat16, generator=g),) for _ in range(4)]
    layer.fp8.backend, layer.fp8.masked_max_tokens, layer.fp8.use_psum, layer.fp8.decode_kernel = "triton", 64, True, "triton"
    from kernels.moe import decode_front_cuda

    layer.fp8.cuda_front = decode_front_cuda.wanted("auto", layer.e, DEV, "fp8")

    def fn(x):
        return layer.fp8.routed_forward(x, rw, rb, TOP_K)

    routed = [route(torch.nn.functional.linear(x, rw, rb), TOP_K) for (x,) in xs]
    diff = calc_diff(fn(xs[0][0]), layer.ref(xs[0][0], *routed[0]))
    us, mode = graph_time_us(fn, xs)
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in routed) / len(routed)
    return layer_row(model, layer.e, t, "fp8_routed", us, mode, diff, distinct, FP8_EXPERT_BYTES,
                     front="cuda" if layer.fp8.cuda_front and t == 1 else "triton")


def layer_row(model: str, e: int, t: int, variant: str, us: float, mode: str, diff: float, distinct: float,
              expert_bytes: float, **extra) -> dict:
    """One timed layer: TFLOP/s, expert-weight GB/s (distinct experts x expert_bytes) and the FP8 floor
    (max of the FP8 weight bytes at the copy ceiling and the FLOPs at the FP8 peak); printed and returned."""
    pairs = t * TOP_K
    floor = max(distinct * FP8_EXPERT_BYTES / (COPY_TBPS * 1e12), pairs * FLOP_PER_PAIR / (FP8_PFLOPS * 1e15)) * 1e6
    row = dict(model=model, experts=e, tokens=t, variant=variant, us=us, mode=mode, diff_vs_bf16_ref=diff,
               tflops=pairs * FLOP_PER_PAIR / us / 1e6, weight_gbps=distinct * expert_bytes / us / 1e3,
               active_experts=distinct, fp8_floor_us=floor, **extra)
    print(f"{model:>5} T={t:<6} {variant:<10} {us:9.1f} us  {row['tflops']:7.1f} TFLOP/s  "
          f"{row['weight_gbps']:7.0f} GB/s  floor {floor:8.1f} us  diff {diff:.1e}  [{mode}]", flush=True)
    return row


def write_mxfp4_layers(folder: Path, layers: int, experts: int) -> None:
    """A checkpoint holding only what expert loading reads: random MXFP4 experts of the real shapes."""
    from safetensors.torch import save_file

    from model.tiny import tiny_config

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(num_hidden_layers=layers, num_local_experts=experts, hidden_size=D, intermediate_size=I,
                         vocab_size=1024, head_dim=64, num_attention_heads=64, num_key_value_heads=8)
    g = torch.Generator(device=DEV).manual_seed(1)
    tensors = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts."
        for name, out, inp in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
            tensors[p + name + "_blocks"] = torch.randint(0, 256, (experts, out, inp // 32, 16), device=DEV,
                                                          dtype=torch.uint8, generator=g).cpu()
            tensors[p + name + "_scales"] = torch.randint(118, 124, (experts, out, inp // 32), device=DEV,
                                                          dtype=torch.uint8, generator=g).cpu()
            tensors[p + name + "_bias"] = torch.randn(experts, out, device=DEV, generator=g).bfloat16().cpu()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))


def probe_deep_gemm() -> int:
    """Is this deep_gemm build usable? Small dense / masked / contiguous FP8 GEMMs against the
    dequantized reference. Exit code 0: usable, 1: not."""
    from kernels.moe.routing_triton import plan_contiguous

    if not deep_gemm_ops.available():
        print(f"probe: {deep_gemm_ops.why_unavailable()}")
        return 1
    e, n, k = 4, 256, 384
    w, ws = quantize_weight_blocks(torch.randn(e, n, k, device=DEV) * 0.05)
    ids = torch.arange(e, device=DEV).repeat_interleave(torch.tensor([5, 0, 130, 64], device=DEV))[:, None]
    plan = plan_contiguous(ids, 0, e, 128)
    x = torch.randn(ids.shape[0], k, device=DEV, dtype=torch.bfloat16)
    a, am = Fp8Rows.empty(1, plan.num_rows, k, DEV), Fp8Rows.empty(e, 256, k, DEV)
    for rows in (a, am):  # no garbage in rows no pair maps to: the dense check reads them all
        rows.data.zero_(), rows.scale_storage.fill_(1.0)
    dispatch_quant(x, plan.row_of_pair, 1, a)
    dispatch_quant(x, (ids[:, 0] * 256 + plan.row_of_pair - plan.psum[ids[:, 0]] + plan.counts[ids[:, 0]]).int(), 1, am)
    rows_ok = plan.m_indices >= 0
    want = ref_grouped(a, w, ws, plan.m_indices.long())
    masked_rows = torch.cat([torch.arange(c, device=DEV) + x_ * 256 for x_, c in enumerate([5, 0, 130, 64])])
    checks = {}
    out = torch.zeros(plan.num_rows, n, device=DEV, dtype=torch.bfloat16)
    try:
        deep_gemm_ops.gemm(a, w[2].contiguous(), ws[2].contiguous(), out)
        dense_want = ref_grouped(a, w, ws, torch.full_like(plan.m_indices, 2).long())
        checks["dense"] = calc_diff(out, dense_want)
        out.zero_()
        deep_gemm_ops.grouped_gemm_contiguous(a, w, ws, out, psum=plan.psum)
        checks["psum"] = calc_diff(out[rows_ok], want[rows_ok])
        out.zero_()
        deep_gemm_ops.grouped_gemm_contiguous(a, w, ws, out, m_indices=plan.m_indices)
        checks["m_indices"] = calc_diff(out[rows_ok], want[rows_ok])
        outm = torch.zeros(e * 256, n, device=DEV, dtype=torch.bfloat16)
        deep_gemm_ops.grouped_gemm_masked(am, w, ws, outm, plan.counts, 50)
        checks["masked"] = calc_diff(outm[masked_rows], want[rows_ok])
    except RuntimeError as exc:
        checks["error"] = str(exc).splitlines()[0][:200]
    good = "error" not in checks and all(v < 1e-4 for v in checks.values())
    print(f"probe deep_gemm {deep_gemm_ops._module().__version__}: {checks} -> {'OK' if good else 'FAIL'}")
    return 0 if good else 1


def ref_grouped(a: Fp8Rows, w, ws, expert_of_row):
    from kernels.moe.fp8_reference import grouped_gemm

    return grouped_gemm(a.data, a.scales_rows(), w, ws, expert_of_row)


def stage_breakdown(layer: Layer, x, ids, weights, backend: str) -> dict:
    """Microseconds of each stage of one Fp8Experts forward (each timed alone, in a CUDA graph)."""
    from kernels.moe import epilogues_triton as epi

    m = layer.fp8
    m.backend = backend
    t, k = ids.shape
    plan, splits = m.plan_step(ids, backend)  # the layout Fp8Experts' forward uses for this T
    a = epi.Fp8Rows.empty(plan.num_groups, plan.rows_per_group, m.w13.shape[2], DEV)
    a2 = epi.Fp8Rows.empty(plan.num_groups, plan.rows_per_group, m.w2.shape[2], DEV)
    h, y = m.gemm_output(plan, splits, m.w13.shape[1]), m.gemm_output(plan, splits, D)
    out = torch.empty(t, D, dtype=torch.bfloat16, device=DEV)
    stages = {
        "plan": lambda: m.plan_step(ids, backend),
        "dispatch_quant": lambda: epi.dispatch_quant(x, plan.row_of_pair, k, a),
        "gemm_gate_up": lambda: m._gemm(backend, a, m.w13, m.s13, h, plan, t, m.hidden),
        "swiglu_quant": lambda: epi.swiglu_quant(h, plan.row_of_pair, ids, m.b13, 0, 1.702, 7.0, a2),
        "gemm_down": lambda: m._gemm(backend, a2, m.w2, m.s2, y, plan, t, m.intermediate),
        "combine": lambda: epi.combine(y, plan.row_of_pair, ids, weights, m.b2, 0, out),
    }
    result = {}
    for name, fn in stages.items():
        result[name] = graph_time_us(lambda *_: fn(), [()])[0]
    return result


def bench_load(folder: Path) -> dict:
    """Expert load time, 2 layers x 32 experts (20b shapes): MXFP4 converted on the GPU at load vs
    the pre-converted FP8 checkpoint. Files were just written, so both read from the page cache."""
    from model.convert import convert_checkpoint, load_fp8_experts

    src, dst = folder / "mxfp4", folder / "fp8"
    write_mxfp4_layers(src, 2, 32)
    stats = convert_checkpoint(src, dst, "cuda", progress=False)
    timings = {}
    for name, path in (("mxfp4_convert_at_load", src), ("preconverted_fp8", dst),
                       ("mxfp4_convert_at_load_again", src), ("preconverted_fp8_again", dst)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        experts = load_fp8_experts(path, device="cuda")
        torch.cuda.synchronize()
        timings[name] = time.perf_counter() - start
        del experts
    sizes = {p.name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (src, dst)}
    print(f"load 2 layers x 32 experts: {timings} (files {sizes}; offline convert {stats['seconds']:.1f} s)")
    return dict(seconds=timings, file_bytes=sizes, offline_convert_seconds=stats["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 1, 64, 4096 only")
    parser.add_argument("--tokens", default=None, help="comma list of T for the layer section (overrides --quick)")
    parser.add_argument("--out", default="bench/results/moe_h200.json")
    parser.add_argument("--warmup-shard", default=None, help="I/N: compile the I-th of N case groups, no timing")
    parser.add_argument("--load-bench", default=None, help="folder for the checkpoint load-time comparison")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: layers,gemm,decode,dense")
    parser.add_argument("--probe", action="store_true", help="only check that deep_gemm works here (exit 0/1)")
    parser.add_argument("--decode-splits", default="", help="T:S,...: the decode GEMM's K splits S at T tokens "
                        "(triton_grouped_gemm.SPLITS_BY_TOKENS; default its rule)")
    args = parser.parse_args()
    if args.probe:
        raise SystemExit(probe_deep_gemm())
    tgg.SPLITS_BY_TOKENS = {int(t): int(n) for t, n in (kv.split(":") for kv in args.decode_splits.split(",") if kv)}
    shard = tuple(int(v) for v in args.warmup_shard.split("/")) if args.warmup_shard else None
    skip = set(filter(None, args.skip.split(",")))
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "deep_gemm": deep_gemm_ops.available() or deep_gemm_ops.why_unavailable(),
              "torch": torch.__version__, "decode_splits": tgg.SPLITS_BY_TOKENS or "default"}
    result["grouped_gemm"] = [] if "gemm" in skip else bench_grouped_gemm(shard)
    result["decode_gemm"] = [] if "decode" in skip else bench_decode_gemm(shard)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    result["layers"] = [] if "layers" in skip else bench_layers(args.quick, shard, tokens)
    result["dense"] = [] if "dense" in skip else bench_dense(shard)
    if args.load_bench and not shard:
        result["load"] = bench_load(Path(args.load_bench))
    if shard:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result: dict) -> None:
    print(f"\nMoE layer, {result['device']}, {result['date']} (us per layer; weight GB/s; floor = max(bytes/4.3 TB/s, FLOPs/1.27 PF/s))")
    names = ("fp8_dg", "fp8_dg_alt", "fp8_dg_mi", "fp8_tr", "bf16")
    print(f"{'model':>5} {'T':>6} " + " ".join(f"{v:>17}" for v in names) + f" {'floor':>8}")
    keyed = {(r["model"], r["tokens"], r["variant"]): r for r in result["layers"] if "us" in r}
    for model, _, t in sorted({(r["model"], r["experts"], r["tokens"]) for r in result["layers"]}, key=lambda c: (c[1], c[2])):
        cells = []
        for v in names:
            r = keyed.get((model, t, v))
            cells.append(f"{r['us']:8.1f}/{r['weight_gbps']:6.0f}GB" if r else f"{'-':>17}")
        floor = next((r["fp8_floor_us"] for r in result["layers"] if r["model"] == model and r["tokens"] == t
                      and "us" in r), float("nan"))
        print(f"{model:>5} {t:>6} " + " ".join(f"{c:>17}" for c in cells) + f" {floor:8.1f}")
    for r in result["grouped_gemm"]:
        if "us" in r:
            print(f"gate_up 32x512 {r['case']:<24} {r['us']:8.1f} us {r['tflops']:6.0f} TFLOP/s")
    best = {}
    for r in result.get("decode_gemm", []):
        key = (r["model"], r["tokens"], r["n"])
        if "us" in r and r["case"].startswith("decode") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    keyed = {(r["model"], r["tokens"], r["n"], r["case"]): r for r in result.get("decode_gemm", []) if "us" in r}
    for key, r in best.items():
        default = keyed.get(key + ("decode_n64_k4" if key[1] <= 4 else "decode_n64_k1",))
        others = " ".join(f"{c} {keyed[key + (c,)]['us']:.1f}" for c in ("general_masked", "dg_masked") if key + (c,) in keyed)
        print(f"decode GEMM {key[0]:>4} T={key[1]:<3} N={key[2]}: best {r['case']} {r['us']:.1f} us ({r['weight_gbps']:.0f} GB/s); "
              f"default {default['us'] if default else float('nan'):.1f}; {others}")


if __name__ == "__main__":
    main()
