import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.loader import CheckpointError, load_model
from model.tiny import make_tiny
from tests.model.references import random_hf_model

SMALL = dict(dtype="float32", vocab_size=211, num_hidden_layers=2, seed=4)


def _rewrite(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_single_file_sharded_and_mxfp4_checkpoints_load_alike(tmp_path):
    make_tiny(tmp_path / "one", **SMALL)
    make_tiny(tmp_path / "three", shards=3, **SMALL)
    a = load_model(tmp_path / "one", progress=False)
    b = load_model(tmp_path / "three", progress=False)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    index = json.loads((tmp_path / "three" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    make_tiny(tmp_path, **{**SMALL, "dtype": "bfloat16"})
    assert load_model(tmp_path, progress=False).lm_head.weight.dtype == torch.bfloat16
    assert load_model(tmp_path, dtype="float32", progress=False).lm_head.weight.dtype == torch.float32


def test_missing_tensor_is_named(tmp_path):
    make_tiny(tmp_path, **SMALL)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.sinks"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.sinks is missing"):
        load_model(tmp_path, progress=False)


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    make_tiny(tmp_path, **SMALL)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"shared_expert\.weight in model\.safetensors"):
        load_model(tmp_path, progress=False)


def test_misshaped_tensor_is_named_with_its_file(tmp_path):
    make_tiny(tmp_path, shards=2, **SMALL)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    fname = index["weight_map"]["model.layers.0.mlp.router.weight"]
    tensors = load_file(tmp_path / fname)
    tensors["model.layers.0.mlp.router.weight"] = tensors["model.layers.0.mlp.router.weight"][:, :-1].contiguous()
    save_file(tensors, tmp_path / fname)
    with pytest.raises(CheckpointError, match=rf"router\.weight in {fname} has shape \[4, 63\]"):
        load_model(tmp_path, progress=False)


def test_missing_shard_file_is_named(tmp_path):
    make_tiny(tmp_path, shards=2, **SMALL)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path, progress=False)


def test_transformers_written_checkpoint_gives_transformers_greedy_tokens(tmp_path):
    hf = random_hf_model(0, num_hidden_layers=2, num_local_experts=3, num_experts_per_tok=2, vocab_size=300,
                         hidden_size=48, intermediate_size=40, head_dim=8, num_attention_heads=6, num_key_value_heads=2,
                         sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, progress=False)
    prompt = [5, 17, 250, 3, 99, 42, 7, 8]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist()
    tokens = list(prompt)
    for _ in range(20):
        tokens.append(int(ours.full_logits(tokens)[-1].argmax()))
    assert tokens == expected


def test_peak_memory_stays_near_the_weights(tmp_path):
    # ~100 MB of fp32 weights (a Harmony-sized vocabulary); the loader must not hold a second copy.
    make_tiny(tmp_path, dtype="float32", num_hidden_layers=2, seed=1)
    script = textwrap.dedent(f"""
        import torch, tqdm
        from model.loader import load_model
        def status(key):
            line = next(l for l in open("/proc/self/status") if l.startswith(key))
            return int(line.split()[1]) * 1024
        base = status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS, forgetting the import-time peak
        m = load_model({str(tmp_path)!r}, progress=False)
        peak = status("VmHWM:")
        weights = sum(p.numel() * p.element_size() for p in m.parameters())
        print(weights, peak - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    weights, grown = map(int, out.stdout.split())
    assert weights > 90e6
    assert grown <= 1.3 * weights, (grown, weights)
