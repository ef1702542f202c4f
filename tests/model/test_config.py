import json

import pytest

from model.config import ConfigError, GptOssConfig


def test_presets_match_the_published_models():
    small, big = GptOssConfig.preset("gpt-oss-20b"), GptOssConfig.preset("gpt-oss-120b")
    assert (small.num_hidden_layers, small.num_local_experts) == (24, 32)
    assert (big.num_hidden_layers, big.num_local_experts) == (36, 128)
    for c in (small, big):
        assert (c.hidden_size, c.intermediate_size, c.head_dim) == (2880, 2880, 64)
        assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (64, 8, 201088)
        assert c.layer_types[:2] == ["sliding_attention", "full_attention"] and c.sliding_window == 128
        assert c.num_experts_per_tok == 4 and c.rope_scaling_factor == 32 and c.rope_theta == 150000
    # ~21B and ~117B parameters, as published
    assert 20e9 < small.num_params() < 22e9
    assert 115e9 < big.num_params() < 118e9


def test_hf_config_roundtrip_and_aliases():
    c = GptOssConfig.preset("gpt-oss-20b")
    assert GptOssConfig.from_hf_dict(c.to_hf_dict()) == c
    raw = c.to_hf_dict()
    raw["rope_scaling"] = raw.pop("rope_parameters")  # transformers 4.x spelling
    raw["experts_per_token"] = raw.pop("num_experts_per_tok")
    raw["rope_scaling"]["factor"] = 16.0
    parsed = GptOssConfig.from_hf_dict(raw)
    assert parsed.num_experts_per_tok == 4 and parsed.rope_scaling_factor == 16.0


@pytest.mark.parametrize("patch, field", [
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked"] * 12}, "layer_types[1]"),
    ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ({"num_experts_per_tok": 64}, "num_experts_per_tok"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"model_type": "llama"}, "model_type"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"head_dim": "64"}, "head_dim"),
])
def test_bad_fields_are_named(patch, field):
    raw = GptOssConfig.preset("gpt-oss-20b").to_hf_dict()
    raw.update(patch)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        GptOssConfig.from_hf_dict(raw)


def test_bad_rope_fields_are_named(tmp_path):
    raw = GptOssConfig.preset("gpt-oss-20b").to_hf_dict()
    raw["rope_parameters"]["rope_type"] = "linear"
    with pytest.raises(ConfigError, match="rope_type"):
        GptOssConfig.from_hf_dict(raw)
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "low_freq_factor": 1.0}
    with pytest.raises(ConfigError, match="low_freq_factor"):
        GptOssConfig.from_hf_dict(raw)
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        GptOssConfig.from_json(path)
    path.write_text(json.dumps({"num_hidden_layers": -3}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        GptOssConfig.from_json(path)
