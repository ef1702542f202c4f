"""GPT-OSS hyper-parameters: a validated dataclass, the two shipped presets, and HF config.json parsing."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
_LAYER_TYPES = (SLIDING, FULL)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message names the field."""


def _alternating_layer_types(num_layers: int) -> list[str]:
    # GPT-OSS: even layers use the 128-token sliding window, odd layers full causal attention.
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]


@dataclass
class GptOssConfig:
    """Defaults are gpt-oss-120b; `GptOssConfig.preset("gpt-oss-20b")` gives the small one."""

    num_hidden_layers: int = 36
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    head_dim: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0  # YaRN factor
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    max_position_embeddings: int = 131072
    # dtype the checkpoint was saved in ("bfloat16" / "float32"); "auto" loading picks it.
    torch_dtype: str = "bfloat16"
    eos_token_ids: list[int] = field(default_factory=lambda: [200002, 200012])

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = _alternating_layer_types(self.num_hidden_layers)
        positive_ints = (
            "num_hidden_layers", "num_local_experts", "num_experts_per_tok", "vocab_size",
            "hidden_size", "intermediate_size", "head_dim", "num_attention_heads",
            "num_key_value_heads", "sliding_window", "rope_original_max_position",
            "max_position_embeddings",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "swiglu_limit", "swiglu_alpha", "rope_theta", "rope_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in _LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] is {kind!r}; expected one of {_LAYER_TYPES}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                f"({self.num_local_experts})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_beta_slow >= self.rope_beta_fast:
            raise ConfigError(
                f"rope_beta_slow ({self.rope_beta_slow}) must be below rope_beta_fast ({self.rope_beta_fast})"
            )
        if self.torch_dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"torch_dtype must be bfloat16, float16 or float32, got {self.torch_dtype!r}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_concentration(self) -> float:
        # YaRN attention scaling, applied to both cos and sin.
        return 0.1 * math.log(self.rope_scaling_factor) + 1.0 if self.rope_scaling_factor > 1 else 1.0

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def num_params(self) -> int:
        h, i, e, d = self.hidden_size, self.intermediate_size, self.num_local_experts, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2) + self.num_attention_heads
        moe = e * (h * 2 * i + 2 * i + i * h + h) + h * e + e
        return self.num_hidden_layers * (attn + moe + 2 * h) + 2 * self.vocab_size * h + h

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "GptOssConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return replace(PRESETS[name])

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "GptOssConfig":
        """Parse a transformers `config.json` for `model_type: gpt_oss`.

        Fields that change the computation and have no counterpart here are errors, so a checkpoint
        of a different architecture never loads silently."""
        raw = dict(raw)
        model_type = raw.pop("model_type", "gpt_oss")
        if model_type != "gpt_oss":
            raise ConfigError(f"model_type is {model_type!r}; only 'gpt_oss' is supported")
        kw: dict[str, Any] = {}
        renames = {
            "experts_per_token": "num_experts_per_tok",
            "num_experts": "num_local_experts",
            "dtype": "torch_dtype",
        }
        direct = {f.name for f in fields(cls)} - {"eos_token_ids"}
        rope = raw.pop("rope_parameters", None) or raw.pop("rope_scaling", None) or {}
        if "rope_theta" in raw:
            kw["rope_theta"] = raw.pop("rope_theta")
        _parse_rope(rope, kw)
        eos = raw.pop("eos_token_id", None)
        if isinstance(eos, int):
            kw["eos_token_ids"] = [eos]
        elif isinstance(eos, list) and eos:
            kw["eos_token_ids"] = list(eos)
        for key in ("attention_bias",):
            if key in raw and raw.pop(key) is not True:
                raise ConfigError(f"{key} must be true for GPT-OSS")
        if raw.pop("tie_word_embeddings", False):
            raise ConfigError("tie_word_embeddings must be false: GPT-OSS has a separate unembedding")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act is {raw['hidden_act']!r}; GPT-OSS uses its clamped SwiGLU")
        raw.pop("hidden_act", None)
        ignored = {  # bookkeeping and training-only fields that do not change inference
            "architectures", "transformers_version", "use_cache", "attention_dropout",
            "initializer_range", "output_router_logits", "router_aux_loss_coef", "bos_token_id",
            "pad_token_id", "quantization_config", "initial_context_length", "_name_or_path",
        }
        for key, value in raw.items():
            key = renames.get(key, key)
            if key in direct:
                kw[key] = value
            elif key not in ignored:
                raise ConfigError(f"unknown config field {key!r}")
        if "initial_context_length" in raw and "rope_original_max_position" not in kw:
            kw["rope_original_max_position"] = raw["initial_context_length"]
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "GptOssConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except TypeError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` for this configuration."""
        d = asdict(self)
        out = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": self.rope_theta,
                "factor": self.rope_scaling_factor,
                "original_max_position_embeddings": self.rope_original_max_position,
                "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow,
                "truncate": False,
            },
            "eos_token_id": self.eos_token_ids,
            "dtype": self.torch_dtype,
        }
        for key in ("rope_theta", "rope_scaling_factor", "rope_original_max_position", "rope_beta_fast",
                    "rope_beta_slow", "eos_token_ids", "torch_dtype"):
            d.pop(key)
        out.update(d)
        return out


def _parse_rope(rope: dict[str, Any], kw: dict[str, Any]) -> None:
    rope = dict(rope)
    kind = rope.pop("rope_type", rope.pop("type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_parameters.rope_type is {kind!r}; GPT-OSS uses 'yarn'")
    if rope.pop("truncate", False):
        raise ConfigError("rope_parameters.truncate must be false: GPT-OSS YaRN does not round its ramp")
    names = {
        "rope_theta": "rope_theta",
        "factor": "rope_scaling_factor",
        "original_max_position_embeddings": "rope_original_max_position",
        "beta_fast": "rope_beta_fast",
        "beta_slow": "rope_beta_slow",
    }
    for key, value in rope.items():
        if key in names:
            kw[names[key]] = value
        elif key in ("attention_factor", "mscale", "mscale_all_dim") and value in (None,):
            continue
        else:
            raise ConfigError(f"unknown rope_parameters field {key!r}")


PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-120b": GptOssConfig(),
    "gpt-oss-20b": GptOssConfig(num_hidden_layers=24, num_local_experts=32),
}
