"""system_fingerprint: what changes it (weights, shapes, device, numerics settings, version) and what does not
(capacity settings)."""

import dataclasses
import re

from engine.config import EngineConfig
from engine.fingerprint import NUMERICS_FIELDS, checkpoint_identity, device_name, system_fingerprint
from model.config import GptOssConfig

SHAPES = GptOssConfig(num_hidden_layers=2, num_local_experts=4, vocab_size=512, hidden_size=64,
                      intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def fingerprint(config=EngineConfig(), shapes=SHAPES, weights="random:tiny seed 0", device="cpu"):
    return system_fingerprint(config, shapes, weights, device, version="1.0")


def test_format_and_stability():
    a = fingerprint()
    assert re.fullmatch(r"fp_[0-9a-f]{12}", a)
    assert fingerprint() == a  # a fresh config of equal values: equal


def test_capacity_settings_leave_it_alone():
    base = fingerprint()
    for change in (dict(max_num_seqs=7), dict(max_num_batched_tokens=96), dict(gpu_memory_fraction=0.5),
                   dict(max_model_len=300), dict(num_full_pages=40, num_sliding_pages=8), dict(device="cuda:3"),
                   dict(enable_prefix_caching=False)):
        assert fingerprint(dataclasses.replace(EngineConfig(), **change)) == base, change


def test_numerics_weights_shapes_device_and_version_change_it():
    seen = {fingerprint()}
    for change in (dict(kv_cache_dtype="fp8_e4m3"), dict(seed=1), dict(tp_size=2), dict(moe_backend="torch"),
                   dict(speculative_ngram=True), dict(block_size=32)):
        assert set(change) <= set(NUMERICS_FIELDS)
        seen.add(fingerprint(dataclasses.replace(EngineConfig(), **change)))
    seen.add(fingerprint(weights="random:tiny seed 1"))
    seen.add(fingerprint(shapes=dataclasses.replace(SHAPES, num_hidden_layers=3, layer_types=[])))
    seen.add(fingerprint(device="NVIDIA H200"))
    seen.add(system_fingerprint(EngineConfig(), SHAPES, "random:tiny seed 0", "cpu", version="1.1"))
    assert len(seen) == 11  # each change gave a new one


def test_every_numerics_field_is_an_engine_setting():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(NUMERICS_FIELDS) <= names, set(NUMERICS_FIELDS) - names


def test_checkpoint_identity_follows_config_and_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 100)
    first = checkpoint_identity(tmp_path)
    assert checkpoint_identity(tmp_path) == first
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 101)
    second = checkpoint_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    third = checkpoint_identity(tmp_path)
    assert len({first, second, third}) == 3
    assert device_name("cpu") == "cpu"
