"""Floors and prices for bench/e2e.py: bytes per decode step, FLOPs per prefill, roofline fractions,
$ per million tokens, throughput estimates, the printed table and the plots.

H200 ceilings (measured on the project's H200, 2026-11-29; ARCHITECTURE.md, kernels/*/NOTES.md):
copy 4.3 TB/s, bf16 GEMM ~790 TFLOP/s (cuBLAS peak; ~690 sustained), FP8 GEMM ~1,270 TFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass

COPY_BYTES_PER_S = 4.3e12
BF16_FLOPS = 790e12
FP8_FLOPS = 1270e12
DOLLARS_PER_GPU_HOUR = 3.00
KV_ELEMENTS_PER_TOKEN_LAYER = 8 * 64 * 2  # kv heads x head_dim x (K, V): 2 KiB in bf16, 1 KiB in fp8


@dataclass
class ModelShape:
    """What the floors need from a config, plus the measured weight bytes of the built model."""

    name: str
    layers: int
    full_layers: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    vocab: int
    window: int
    expert_bytes: float  # one expert, as stored (FP8 + scales + biases)
    dense_bytes_per_layer: float  # attention + router + norms
    embed_bytes: float  # one of embedding / unembedding
    kv_element_bytes: int = 2  # 1 with an fp8 KV cache

    @staticmethod
    def of(model, name: str, kv_element_bytes: int = 2) -> "ModelShape":
        c = model.config
        layer = model.model.layers[0]
        experts = layer.mlp.experts
        expert_bytes = sum(t.numel() * t.element_size() for t in experts.buffers()) or \
            sum(p.numel() * p.element_size() for p in experts.parameters())
        dense = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if ".experts." not in f".{n}")
        embed = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        return ModelShape(name, c.num_hidden_layers, sum(not c.is_sliding(i) for i in range(c.num_hidden_layers)),
                          c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.intermediate_size,
                          c.vocab_size, c.sliding_window, expert_bytes / c.num_local_experts, dense, embed,
                          kv_element_bytes)

    def active_experts(self, tokens: int) -> float:
        """Expected distinct experts per layer for `tokens` tokens under uniform routing."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    def kv_bytes(self, batch: int, ctx: int) -> float:
        sliding = self.layers - self.full_layers
        return batch * KV_ELEMENTS_PER_TOKEN_LAYER * self.kv_element_bytes * (self.full_layers * ctx + sliding * min(ctx, self.window))

    def decode_bytes(self, batch: int, ctx: int) -> dict[str, float]:
        """Bytes one decode step must read: experts hit, dense layers, unembedding, K/V."""
        return {
            "experts": self.layers * self.active_experts(batch) * self.expert_bytes,
            "dense": self.layers * self.dense_bytes_per_layer + self.embed_bytes,
            "kv": self.kv_bytes(batch, ctx),
        }

    def prefill_flops(self, tokens: int) -> dict[str, float]:
        """bf16 (attention projections, router, attention itself, one unembedding row) and FP8 (experts) FLOPs."""
        h, i = self.hidden, self.intermediate
        q, kv = 64 * 64, 8 * 64
        dense = 2 * tokens * (h * (q + 2 * kv) + q * h + h * self.experts) * self.layers
        sliding = self.layers - self.full_layers
        attn = 4 * 64 * 64 * (self.full_layers * tokens * (tokens + 1) / 2
                              + sliding * tokens * min(tokens, self.window))
        fp8 = 2 * tokens * self.top_k * (h * 2 * i + i * h) * self.layers
        return {"bf16": dense + attn + 2 * h * self.vocab, "fp8": fp8}


def decode_floor_s(shape: ModelShape, batch: int, ctx: int) -> float:
    return sum(shape.decode_bytes(batch, ctx).values()) / COPY_BYTES_PER_S


def prefill_floor_s(shape: ModelShape, tokens: int) -> float:
    flops = shape.prefill_flops(tokens)
    compute = flops["bf16"] / BF16_FLOPS + flops["fp8"] / FP8_FLOPS
    weights = shape.layers * (shape.active_experts(tokens) * shape.expert_bytes + shape.dense_bytes_per_layer)
    return max(compute, weights / COPY_BYTES_PER_S)


def dollars_per_million(tokens_per_s: float) -> float:
    return DOLLARS_PER_GPU_HOUR / 3600 / tokens_per_s * 1e6


def estimate_throughput(prefill_s_per_token: float, step_s: float, batch: int, out_len: int, in_len: int) -> dict:
    """Steady state of `batch` concurrent requests of in_len / out_len: every out_len decode steps the
    GPU also prefills `batch` prompts (at the measured prefill rate). Output tokens per second."""
    cycle = batch * in_len * prefill_s_per_token + out_len * step_s
    return {"output_tok_s": batch * out_len / cycle, "total_tok_s": batch * (in_len + out_len) / cycle,
            "batch": batch, "cycle_s": cycle}


def print_table(results: dict) -> None:
    """Short summary: prefill, decode at batch 1 / best, throughput, HF, by model."""
    for model, r in results.get("models", {}).items():
        print(f"\n== {model} (random weights, real shapes; build {r.get('build_s', 0):.0f} s, "
              f"graph capture {r.get('capture_s_total', 0):.1f} s)")
        for p in r.get("prefill", []):
            rested = f" ({p['ttft_after_rest_ms']:.2f} after a rest)" if "ttft_after_rest_ms" in p else ""
            print(f"prefill {p['tokens']:>6} tok: TTFT {p['ttft_ms']:8.2f} ms{rested}  ${p['usd_per_m_input']:.4f}/M in  "
                  f"{100 * p['roofline_fraction']:.0f}% of roofline")
        for d in r.get("decode", []):
            if "step_ms" not in d:
                print(f"decode ctx {d['ctx']:>6} b {d['batch']:>4}: {d.get('skipped', 'not measured')}")
                continue
            print(f"decode ctx {d['ctx']:>6} b {d['batch']:>4}: {d['tok_s_user']:8.1f} tok/s/user "
                  f"{d['tok_s_gpu']:9.0f} tok/s/GPU  ${d['usd_per_m_output']:.3f}/M out  "
                  f"{100 * d['roofline_fraction']:.0f}% of copy floor")
        for t in r.get("throughput", []):
            print(f"throughput {t['scenario']}: {t['output_tok_s']:.0f} output tok/s/GPU at batch {t['batch']} "
                  f"({t['method']})")
        for e in r.get("engine_runs", []):
            if "tpot_ms" in e:
                print(f"engine run {e['scenario']}: TTFT {e['ttft_ms']:.1f} ms for {e['in_len']} tokens, "
                      f"{e['tok_s_user']:.0f} tok/s ({e['tpot_ms']:.3f} ms per output token, host work included; "
                      f"lookahead {e.get('async_decode')})")
                continue
            if "output_tok_s" not in e:
                print(f"engine run {e['scenario']}: {e.get('skipped') or e.get('error')}")
                continue
            print(f"engine run {e['scenario']}: {e['output_tok_s']:.0f} output tok/s/GPU measured, {e['requests']} "
                  f"requests in {e['wall_s']:.1f} s, KV {e['kv_cache_dtype']} (estimate {e['estimate_output_tok_s']:.0f})")
    hf = results.get("hf_baseline")
    if hf:
        for p in hf.get("points", []):
            print(f"HF transformers {hf.get('model')}: {p}")


def plot(results: dict, folder, stem: str) -> list[str]:
    """Prefill TTFT vs input length; decode tok/s per user vs tok/s per GPU; $/M output vs batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, r in results.get("models", {}).items():
        pts = sorted((p for p in r.get("prefill", []) if "ttft_ms" in p), key=lambda p: p["tokens"])  # run order differs
        if pts:
            line, = ax.plot([p["tokens"] for p in pts], [p["ttft_ms"] for p in pts], "o-", label=f"{model}, back to back")
            rested = [p for p in pts if "ttft_after_rest_ms" in p]
            if rested:
                ax.plot([p["tokens"] for p in rested], [p["ttft_after_rest_ms"] for p in rested], "s--",
                        color=line.get_color(), label=f"{model}, after a rest")
    for p in (results.get("hf_baseline") or {}).get("prefill", []):
        ax.plot([p["tokens"]], [p["ttft_ms"]], "kx")
    ax.set(xscale="log", yscale="log", xlabel="input tokens (batch 1)", ylabel="TTFT ms", title="Prefill on one H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{folder}/{stem}_prefill.png", dpi=120)
    written.append(f"{folder}/{stem}_prefill.png")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for model, r in results.get("models", {}).items():
        for ctx in sorted({d["ctx"] for d in r.get("decode", []) if "step_ms" in d}):
            pts = [d for d in r["decode"] if d["ctx"] == ctx and "step_ms" in d]
            a1.plot([d["tok_s_gpu"] for d in pts], [d["tok_s_user"] for d in pts], "o-", label=f"{model} ctx {ctx}")
            a2.plot([d["batch"] for d in pts], [d["usd_per_m_output"] for d in pts], "o-", label=f"{model} ctx {ctx}")
    a1.set(xscale="log", xlabel="output tok/s per GPU", ylabel="tok/s per user", title="Decode (CUDA graphs)")
    a2.set(xscale="log", yscale="log", xlabel="batch", ylabel="$ / M output tokens", title="$3.00 per H200-hour")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{folder}/{stem}_decode.png", dpi=120)
    written.append(f"{folder}/{stem}_decode.png")
    plt.close("all")
    return written
