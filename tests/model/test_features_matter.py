"""The sinks, the sliding window and YaRN each change the output: none of them is dead code."""

import copy

import torch

from model.config import GptOssConfig
from model.gpt_oss import GptOssForCausalLM
from model.loader import load_model
from model.tiny import make_tiny


def _model(tmp_path):
    make_tiny(tmp_path, dtype="float32", num_hidden_layers=2, vocab_size=300, sliding_window=4, seed=3)
    return load_model(tmp_path, progress=False)


def _rebuilt(model, **config_changes) -> GptOssForCausalLM:
    config = copy.deepcopy(model.config)
    for k, v in config_changes.items():
        setattr(config, k, v)
    other = GptOssForCausalLM(config, dtype=torch.float32)
    other.load_state_dict(model.state_dict())
    return other


def test_sinks_window_and_yarn_each_matter(tmp_path):
    model = _model(tmp_path)
    ids = list(range(1, 40))
    base = model.full_logits(ids)

    no_sinks = copy.deepcopy(model)
    for layer in no_sinks.model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    assert (no_sinks.full_logits(ids) - base).abs().max() > 1e-2

    wide_window = _rebuilt(model, sliding_window=1000)
    diff = (wide_window.full_logits(ids) - base).abs().amax(-1)
    assert diff[:4].max() < 1e-5  # positions that fit in the window are unaffected...
    assert diff[4:].max() > 1e-2  # ...later ones change

    plain_rope = _rebuilt(model, rope_scaling_factor=1.0)
    assert (plain_rope.full_logits(ids) - base).abs().max() > 1e-2
    # the YaRN concentration scales cos and sin: 0.1 ln(32) + 1
    assert abs(GptOssConfig().rope_concentration - 1.3465735902799727) < 1e-12
