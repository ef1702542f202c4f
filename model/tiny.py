"""Small random GPT-OSS checkpoints in the HF layout: the embedded default model and the test fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.config import GptOssConfig
from model.mxfp4 import quantize_mxfp4

# The embedded demo model: Harmony-sized vocabulary (so rendered prompts and stop tokens are valid
# ids), everything else tiny.
TINY_DEFAULTS = dict(
    num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=201088,
    hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=128,
)


def tiny_config(**overrides) -> GptOssConfig:
    return GptOssConfig(**{**TINY_DEFAULTS, **overrides})


def shapes_by_name(name: str) -> GptOssConfig:
    """"tiny" (tiny_config) or a preset's name ("gpt-oss-20b", "gpt-oss-120b"): what benchmarks build from."""
    return tiny_config() if name == "tiny" else GptOssConfig.preset(name)


def random_weights(config: GptOssConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-layout tensors (dense experts stored [E, in, out]) drawn from a seeded generator, in fp32."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    c = config
    h, i, e, d = c.hidden_size, c.intermediate_size, c.num_local_experts, c.head_dim
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(c.vocab_size, h, std=1.0),
        "model.norm.weight": 1 + randn(h, std=0.1),
        "lm_head.weight": randn(c.vocab_size, h, std=h ** -0.5),
    }
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = 1 + randn(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + randn(h, std=0.1)
        for name, heads in (("q", c.num_attention_heads), ("k", c.num_key_value_heads), ("v", c.num_key_value_heads)):
            w[p + f"self_attn.{name}_proj.weight"] = randn(heads * d, h, std=h ** -0.5)
            w[p + f"self_attn.{name}_proj.bias"] = randn(heads * d, std=0.1)
        w[p + "self_attn.o_proj.weight"] = randn(h, c.num_attention_heads * d, std=(c.num_attention_heads * d) ** -0.5)
        w[p + "self_attn.o_proj.bias"] = randn(h, std=0.1)
        w[p + "self_attn.sinks"] = randn(c.num_attention_heads, std=1.0)
        w[p + "mlp.router.weight"] = randn(e, h, std=h ** -0.5)
        w[p + "mlp.router.bias"] = randn(e, std=0.1)
        w[p + "mlp.experts.gate_up_proj"] = randn(e, h, 2 * i, std=h ** -0.5)
        w[p + "mlp.experts.gate_up_proj_bias"] = randn(e, 2 * i, std=0.1)
        w[p + "mlp.experts.down_proj"] = randn(e, i, h, std=i ** -0.5)
        w[p + "mlp.experts.down_proj_bias"] = randn(e, h, std=0.1)
    return w


def to_mxfp4_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace dense expert weights [E, in, out] by MXFP4 `_blocks` [E, out, in/32, 16] and `_scales`."""
    out = {}
    for name, t in weights.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = t
    return out


def make_tiny(folder: str | Path, *, mxfp4: bool = False, seed: int = 0, dtype: str = "bfloat16",
              shards: int = 1, **overrides) -> GptOssConfig:
    """Write a deterministic random checkpoint; returns its config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if mxfp4 and (overrides.get("hidden_size", TINY_DEFAULTS["hidden_size"]) % 32
                  or overrides.get("intermediate_size", TINY_DEFAULTS["intermediate_size"]) % 32):
        raise ValueError("MXFP4 experts need hidden_size and intermediate_size to be multiples of 32")
    config = tiny_config(torch_dtype=dtype, **overrides)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    weights = random_weights(config, seed)
    if mxfp4:
        weights = to_mxfp4_layout(weights)
    weights = {k: (v if v.dtype == torch.uint8 else v.to(torch_dtype)).contiguous() for k, v in weights.items()}
    _write(folder, weights, shards)
    hf = config.to_hf_dict()
    if mxfp4:  # as in the published checkpoints
        hf["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        }
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_ids}, indent=2))
    return config


def _write(folder: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    names = sorted(weights)
    if shards <= 1:
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
