"""Same-run baseline for bench/e2e.py: HF transformers GptOssForCausalLM, bf16, random weights, 20b shapes.

Eager attention (HF's path that supports the sinks), its default MoE implementation, DynamicCache,
no CUDA graphs: what `transformers` gives out of the box on the same GPU. Points: prefill TTFT at
batch 1 (1k, 2k, 4k, 8k while memory allows) and batch-1 decode at context 1024.
"""

from __future__ import annotations

import time

import torch


def _hf_model(device: torch.device, tiny: bool):
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM as HFModel

    if tiny:
        cfg = HFConfig(num_hidden_layers=4, num_local_experts=8, vocab_size=2048, hidden_size=256,
                       intermediate_size=256, num_attention_heads=16, num_key_value_heads=2, head_dim=64)
    else:  # gpt-oss-20b
        cfg = HFConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4)
    cfg._attn_implementation = "eager"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = HFModel(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, cfg


def _seconds(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


@torch.inference_mode()
def hf_baseline(device: torch.device, budget_s: float, tiny: bool = False) -> dict:
    import transformers

    start = time.perf_counter()
    result = {"model": "gpt-oss-20b" if not tiny else "tiny", "transformers": transformers.__version__,
              "attention": "eager", "dtype": "bfloat16" if device.type == "cuda" else "float32",
              "prefill": [], "decode": [], "points": []}
    t0 = time.perf_counter()
    model, cfg = _hf_model(device, tiny)
    result["build_s"] = time.perf_counter() - t0
    result["experts_implementation"] = str(getattr(cfg, "_experts_implementation", "default"))
    lens = [64, 128] if tiny else [1024, 2048, 4096, 8192]
    for n in lens:
        if time.perf_counter() - start > budget_s * 0.6:
            result["points"].append(f"prefill {n}: skipped by the time guard")
            break
        ids = torch.randint(0, cfg.vocab_size, (1, n), device=device)
        try:
            _seconds(lambda: model(ids, use_cache=False, logits_to_keep=1), device)  # warm-up
            s = min(_seconds(lambda: model(ids, use_cache=False, logits_to_keep=1), device) for _ in range(2))
        except torch.OutOfMemoryError:
            result["points"].append(f"prefill {n}: out of memory")
            torch.cuda.empty_cache()
            break
        result["prefill"].append({"tokens": n, "ttft_ms": s * 1e3})
        result["points"].append(f"prefill {n}: {s * 1e3:.1f} ms")
    ctx = 64 if tiny else 1024
    if time.perf_counter() - start < budget_s * 0.8:
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=device)
        out = model(ids, use_cache=True, logits_to_keep=1)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = 8

        def decode():
            nonlocal past, nxt
            for _ in range(steps):
                o = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)

        decode()  # warm-up
        s = _seconds(decode, device) / steps
        result["decode"].append({"batch": 1, "ctx": ctx, "step_ms": s * 1e3, "tok_s_user": 1 / s})
        result["points"].append(f"decode b=1 ctx {ctx}: {1 / s:.1f} tok/s")
    model = None  # free the weights before the caller goes on
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result
