"""The GEMMs of the MoE layer alone, for bench/moe.py: the gate_up grouped GEMM at 512 tokens per
expert (DeepGEMM layouts vs Triton vs torch bf16), the decode GEMMs at T = 1, 8, 64 (the decode
kernel's tile/split sweep vs the general kernel and DeepGEMM masked), and the dense layers (bf16 vs
FP8). Each function returns JSON rows and prints one line per case."""

from __future__ import annotations

import torch

from bench.moe_common import D, DEV, I, MODELS, TOP_K, calc_diff, graph_time_us, median_us
from kernels.moe import deep_gemm_ops
from kernels.moe.epilogues_triton import Fp8Rows, dispatch_quant
from kernels.moe.fp8_quant import padded, quantize_weight_blocks
from kernels.moe.reference import route


def bench_grouped_gemm(shard) -> list[dict]:
    """gate_up GEMM alone, 32 experts x 512 tokens: DeepGEMM (m_indices, psum, masked), Triton,
    dense DeepGEMM FP8 on the same total M (the ceiling), torch bf16 _grouped_mm."""
    from kernels.moe import triton_grouped_gemm
    from kernels.moe.routing_triton import plan_contiguous

    e, per, n, kp = 32, 512, 2 * I, padded(D)
    if shard and shard[0] != shard[1] - 1:
        return []
    w, ws = quantize_weight_blocks(torch.randn(e, n, D, device=DEV) * D ** -0.5)
    ids = torch.arange(e, device=DEV).repeat_interleave(per)[:, None]
    plan = plan_contiguous(ids, 0, e, 128)
    x = torch.randn(e * per, D, device=DEV, dtype=torch.bfloat16)
    a = Fp8Rows.empty(1, plan.num_rows, kp, DEV)  # rows past 16384: the no-sync bound's unused tail
    dispatch_quant(x, plan.row_of_pair, 1, a)
    dense_a = dispatch_quant(x, torch.arange(e * per, device=DEV, dtype=torch.int32), 1, Fp8Rows.empty(1, e * per, kp, DEV))
    am = Fp8Rows(a.data[: e * per], torch.empty(e, kp // 128, per, device=DEV), per)
    am.scale_storage.copy_(a.scale_storage[0, :, : e * per].reshape(kp // 128, e, per).transpose(0, 1))
    out = torch.empty(plan.num_rows, n, device=DEV, dtype=torch.bfloat16)
    counts = torch.full((e,), per, dtype=torch.int32, device=DEV)
    cases = {"triton_contiguous": lambda: triton_grouped_gemm.grouped_gemm(a, w, ws, out, plan.m_indices, False)}
    for stages, warps in ((3, 8), (4, 4), (5, 8)):  # the Triton fallback's tile config, measured here
        cfg = dict(num_stages=stages, num_warps=warps)
        cases[f"triton_contiguous_s{stages}w{warps}"] = (
            lambda cfg=cfg: triton_grouped_gemm.grouped_gemm(a, w, ws, out, plan.m_indices, False, cfg))
    if deep_gemm_ops.available():
        cases["dg_contiguous_m_indices"] = lambda: deep_gemm_ops.grouped_gemm_contiguous(a, w, ws, out, m_indices=plan.m_indices)
        cases["dg_contiguous_psum"] = lambda: deep_gemm_ops.grouped_gemm_contiguous(a, w, ws, out, psum=plan.psum)
        cases["dg_masked"] = lambda: deep_gemm_ops.grouped_gemm_masked(am, w, ws, out[: e * per], counts, per)
        wd, wds = w[0].contiguous(), ws[0].contiguous()
        cases["dg_dense_same_mnk"] = lambda: deep_gemm_ops.gemm(dense_a, wd, wds, out[: e * per])
    wb = torch.randn(e, n, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    xb = torch.randn(e * per, D, device=DEV, dtype=torch.bfloat16)
    offs = torch.arange(1, e + 1, device=DEV, dtype=torch.int32) * per
    cases["bf16_torch_grouped_mm"] = lambda: torch._grouped_mm(xb, wb, offs=offs)
    rows = []
    for name, fn in cases.items():
        try:
            fn()
        except RuntimeError as exc:  # report and go on: one broken case must not cost the run
            print(f"gate_up GEMM {name}: FAILED {str(exc).splitlines()[0][:160]}", flush=True)
            rows.append(dict(case=name, error=str(exc)[:300]))
            continue
        if shard:
            continue
        us = median_us(fn)
        k = D if name.startswith("bf16") else kp
        rows.append(dict(case=name, us=us, tflops=2 * e * per * n * k / us / 1e6,
                         useful_tflops=2 * e * per * n * D / us / 1e6))
        print(f"gate_up GEMM 32x512: {name:<24} {us:8.1f} us {rows[-1]['tflops']:7.0f} TFLOP/s "
              f"(useful K=2880: {rows[-1]['useful_tflops']:.0f})", flush=True)
    return rows


DECODE_SWEEP = [dict(BLOCK_N=bn, num_warps=4 if bn < 128 else 8, num_stages=3, splits=sk)
                for bn in (32, 64, 128) for sk in (1, 2, 4, 8)]


def bench_decode_gemm(shard) -> list[dict]:
    """The decode grouped GEMMs alone (masked layout, T = 1, 8, 64; gate_up and down shapes; 20b and
    120b expert counts): the decode kernel's tile configs, the general Triton kernel, DeepGEMM masked.
    GB/s = bytes of the active experts' FP8 weights / time (L2 flushed before each call)."""
    from kernels.moe import triton_grouped_gemm as tgg
    from kernels.moe.routing_triton import plan_masked

    rows = []
    for model, e in MODELS.items():
        weights = {n: quantize_weight_blocks(torch.randn(e, n, D, device=DEV, dtype=torch.bfloat16) * D ** -0.5)
                   for n in (2 * I, D)}
        for t in (1, 8, 64):
            if shard and (t // 8) % shard[1] != shard[0]:
                continue
            ids = route(torch.randn(t, e, device=DEV), TOP_K)[0]
            plan = plan_masked(ids, 0, e, t)  # groups of T rows, as Fp8Experts uses with this kernel
            active = int(plan.num_active.item())
            a = Fp8Rows.empty(e, plan.rows_per_group, padded(D), DEV)
            a.data.copy_((torch.randn(a.data.shape, device=DEV) * 30).to(a.data.dtype))
            a.scale_storage.fill_(0.01)
            for n, (w, ws) in weights.items():
                out = torch.empty(a.data.shape[0], n, device=DEV, dtype=torch.bfloat16)
                parts = {sk: torch.empty(sk, a.data.shape[0], n, device=DEV) for sk in (2, 4, 8)}
                cases = {}
                for c in DECODE_SWEEP:
                    if t > 8 and c["splits"] > 2:
                        continue
                    cfg = {key: v for key, v in c.items() if key != "splits"}
                    dst = out if c["splits"] == 1 else parts[c["splits"]]
                    cases[f"decode_n{c['BLOCK_N']}_k{c['splits']}"] = (
                        lambda cfg=cfg, dst=dst: tgg.grouped_gemm_decode(a, w, ws, dst, plan.counts, plan.active,
                                                                         plan.num_active, t, cfg))
                am = Fp8Rows.empty(e, 128, padded(D), DEV)  # the general kernel and DeepGEMM: 128-row groups
                outm = torch.empty(e * 128, n, device=DEV, dtype=torch.bfloat16)
                cases["general_masked"] = lambda: tgg.grouped_gemm(am, w, ws, outm, plan.counts, True, expected_m=t)
                if deep_gemm_ops.available():
                    cases["dg_masked"] = lambda: deep_gemm_ops.grouped_gemm_masked(am, w, ws, outm, plan.counts,
                                                                                   max(1, t * TOP_K // e))
                for name, fn in cases.items():
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 (a config that fails to compile is reported, not fatal)
                        print(f"decode GEMM {model} T={t} N={n} {name}: FAILED {str(exc).splitlines()[0][:160]}", flush=True)
                        rows.append(dict(model=model, tokens=t, n=n, case=name, error=str(exc)[:300]))
                        continue
                    if shard:
                        continue
                    us = median_us(fn)
                    gbps = active * n * padded(D) / us / 1e3
                    rows.append(dict(model=model, tokens=t, n=n, case=name, us=us, weight_gbps=gbps, active_experts=active))
                    print(f"decode GEMM {model:>4} T={t:<3} N={n} {name:<22} {us:7.1f} us {gbps:6.0f} GB/s", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


DENSE = {"qkv": (5120, 2880), "o": (2880, 4096), "router_120b": (128, 2880), "router_20b": (32, 2880),
         "unembedding": (201088, 2880)}


def bench_dense(shard) -> list[dict]:
    """bf16 F.linear vs FP8 (per-token-per-128 activation quant + DeepGEMM 1x128/128x128 GEMM, and
    torch._scaled_mm rowwise) on the real shapes; 8 weight copies rotated except the unembedding."""
    rows = []
    use_dg = deep_gemm_ops.available()
    for index, (name, (n, k)) in enumerate(DENSE.items()):
        if shard and index % shard[1] != shard[0]:
            continue
        copies = 1 if name == "unembedding" else 8
        wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        wq = [quantize_weight_blocks(w[None].float())[0:2] for w in wb]
        wq = [(q[0], s[0]) for q, s in wq]
        w_rowwise = [(w.float().abs().amax(1, keepdim=True).clamp(min=1e-4) / 448) for w in wb]
        w_row_q = [(w.float() / s).to(torch.float8_e4m3fn) for w, s in zip(wb, w_rowwise)]
        for t in (1, 64, 1024, 4096, 8192):
            x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
            a = Fp8Rows.empty(1, t, padded(k), DEV)
            ident = torch.arange(t, device=DEV, dtype=torch.int32)
            out = torch.empty(t, n, device=DEV, dtype=torch.bfloat16)
            xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-4) / 448
            xq = (x.float() / xs).to(torch.float8_e4m3fn)
            fns = {
                "bf16": lambda: [torch.nn.functional.linear(x, w) for w in wb],
                "fp8_act_quant": lambda: [dispatch_quant(x, ident, 1, a) for _ in wb],
                "fp8_dg_gemm": lambda: [deep_gemm_ops.gemm(a, q, s, out) for q, s in wq],
                "fp8_scaled_mm_rowwise": lambda: [torch._scaled_mm(xq, q.t(), xs, s.t(), out_dtype=torch.bfloat16)
                                                  for q, s in zip(w_row_q, w_rowwise)],
            }
            bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) * 0.1
            if use_dg and name in ("qkv", "o") and t >= 1024:  # prefill-sized bf16: cuBLAS against DeepGEMM's
                fns["bf16_bias"] = lambda: [torch.nn.functional.linear(x, w, bias) for w in wb]
                fns["bf16_dg_gemm"] = lambda: [deep_gemm_ops.bf16_gemm(x, w, out) for w in wb]
                fns["bf16_dg_gemm_bias"] = lambda: [deep_gemm_ops.bf16_gemm(x, w, out).add_(bias) for w in wb]
                got = deep_gemm_ops.bf16_gemm(x, wb[0], out).float()
                want = torch.nn.functional.linear(x, wb[0]).float()
                print(f"dense {name:<12} T={t:<5} DeepGEMM bf16 vs cuBLAS: diff {calc_diff(got, want):.1e}, "
                      f"max |d| {(got - want).abs().max().item():.2e} (max |y| {want.abs().max().item():.2e})")
            fns["fp8_act_quant"]()
            # FP8 error of the whole dense layer (weights and activations), rowwise torch FP8
            ref = torch.nn.functional.linear(x, wb[0])
            try:
                diff = calc_diff(torch._scaled_mm(xq, w_row_q[0].t(), xs, w_rowwise[0].t(), out_dtype=torch.bfloat16), ref)
            except RuntimeError:
                diff = float("nan")
            if not use_dg:
                del fns["fp8_dg_gemm"]
            for variant, fn in fns.items():
                try:
                    fn()
                except RuntimeError as exc:
                    print(f"dense {name} T={t} {variant}: failed ({str(exc).splitlines()[0][:100]})")
                    continue
                if shard:
                    continue
                us = graph_time_us(lambda *_: fn(), [()])[0] / copies
                rows.append(dict(layer=name, n=n, k=k, tokens=t, variant=variant, us=us,
                                 weight_gbps=n * k * (2 if variant == "bf16" else 1) / us / 1e3,
                                 tflops=2 * t * n * k / us / 1e6, fp8_diff=diff))
                print(f"dense {name:<12} T={t:<5} {variant:<22} {us:8.1f} us  {rows[-1]['weight_gbps']:6.0f} GB/s "
                      f"{rows[-1]['tflops']:6.0f} TFLOP/s", flush=True)
            if not shard:
                print(f"dense {name:<12} T={t:<5} fp8 (weights+activations) vs bf16: diff {diff:.1e}")
    return rows
