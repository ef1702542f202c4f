"""OpenAI's `system_fingerprint` for an engine: a short name of the backend configuration that produced a completion.

OpenAI documents it as the way to tell, together with `seed`, when a change on the server may change outputs. Here it
is a hash of what decides the numbers an engine computes:
- this package's version (the kernels and the model code);
- the weights: a checkpoint's folder name, its config.json and the sizes of its weight files (no weight is read),
  or `random:<shape>` and the seed it was drawn with;
- the model's shapes (GptOssConfig);
- the device: the GPU's model name (an H100 and an H200 pick different kernel tiles), or "cpu";
- the engine settings that change kernels, dtypes or sampling (NUMERICS_FIELDS): not capacity settings such as
  the batch size or the memory fraction, so replicas of one deployment on like GPUs share one fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

# EngineConfig fields that change what a request computes (dtypes, kernel choices, parallel layout, seeds,
# speculative decoding), as opposed to how many requests run at once.
NUMERICS_FIELDS = ("block_size", "dtype", "kv_cache_dtype", "lm_head_dtype", "dense_dtype", "mxfp4_decode_max_tokens",
                   "decode_front", "moe_segments_max_rows", "seed", "attention_backend", "moe_backend", "tp_size",
                   "ep_size", "all_reduce", "speculative_tokens", "speculative_ngram", "jump_forward_tokens")

PACKAGE = "gptoss-serve"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # run from a checkout on PYTHONPATH (the device scripts)
        return "source"


def checkpoint_identity(folder: str | Path) -> str:
    """A checkpoint folder's name, config.json digest and weight-file sizes: changes when the weights are replaced,
    without reading them."""
    folder = Path(folder)
    config = folder / "config.json"
    digest = hashlib.blake2b(config.read_bytes(), digest_size=8).hexdigest() if config.is_file() else "-"
    sizes = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors"))
    return json.dumps([folder.name, digest, sizes])


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return device
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def engine_fingerprint(engine, weights: str) -> str:
    """system_fingerprint of a running LLMEngine: its own EngineConfig, model shapes and device."""
    return system_fingerprint(engine.config, engine.model.config, weights, device_name(engine.config.device))


def system_fingerprint(engine_config, model_config, weights: str, device: str, version: str | None = None) -> str:
    """`fp_` and 12 hex digits. engine_config: EngineConfig; model_config: GptOssConfig; weights: checkpoint_identity()
    or a name of random weights; device: "cpu" or the GPU's name (device_name)."""
    described = {"version": version or package_version(), "weights": weights, "model": asdict(model_config),
                 "device": device, "engine": {f: getattr(engine_config, f) for f in NUMERICS_FIELDS}}
    text = json.dumps(described, sort_keys=True, default=str)
    return "fp_" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
