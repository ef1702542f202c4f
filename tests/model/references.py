"""Build the two reference implementations from one of our models' weights."""

from __future__ import annotations

import torch


def openai_reference(model, ref_module):
    """OpenAI's `gpt_oss.torch.model.Transformer` holding exactly our (fp32) weights."""
    c = model.config
    rc = ref_module.ModelConfig(
        num_hidden_layers=c.num_hidden_layers, num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, swiglu_limit=c.swiglu_limit, head_dim=c.head_dim,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        sliding_window=c.sliding_window, initial_context_length=c.rope_original_max_position,
        rope_theta=c.rope_theta, rope_scaling_factor=c.rope_scaling_factor,
        rope_ntk_alpha=c.rope_beta_slow, rope_ntk_beta=c.rope_beta_fast,
    )
    ref = ref_module.Transformer(rc, device=torch.device("cpu")).float()
    sd = {
        "embedding.weight": model.model.embed_tokens.weight,
        "norm.scale": model.model.norm.weight,
        "unembedding.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.model.layers):
        p, attn, mlp = f"block.{i}.", layer.self_attn, layer.mlp
        sd |= {
            p + "attn.norm.scale": layer.input_layernorm.weight,
            p + "attn.qkv.weight": attn.qkv_proj.weight, p + "attn.qkv.bias": attn.qkv_proj.bias,
            p + "attn.sinks": attn.sinks,
            p + "attn.out.weight": attn.o_proj.weight, p + "attn.out.bias": attn.o_proj.bias,
            p + "mlp.norm.scale": layer.post_attention_layernorm.weight,
            p + "mlp.gate.weight": mlp.router.weight, p + "mlp.gate.bias": mlp.router.bias,
            p + "mlp.mlp1_weight": mlp.experts.gate_up_proj, p + "mlp.mlp1_bias": mlp.experts.gate_up_proj_bias,
            p + "mlp.mlp2_weight": mlp.experts.down_proj, p + "mlp.mlp2_bias": mlp.experts.down_proj_bias,
        }
    ref.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return ref.eval()


def hf_reference(folder):
    """transformers' GptOssForCausalLM (eager attention, fp32) loaded from the same checkpoint folder."""
    from transformers import GptOssForCausalLM

    return GptOssForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def random_hf_model(seed: int, **config):
    """A transformers GptOssForCausalLM with random weights; sinks and biases (initialised near zero by
    transformers) are redrawn so that they matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    hf = GptOssForCausalLM(GptOssConfig(**config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0, 0.5)
    return hf
