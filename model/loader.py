"""Loading HF-layout GPT-OSS checkpoints (safetensors, one file or sharded) into `GptOssForCausalLM`.

One table, `_SOURCES`, says where each of our parameters comes from. Each rank reads only the slices
it owns (rows or columns of a tensor, a range of experts) through safetensors' lazy slices, and one
tensor at a time, so the peak memory stays close to the final weights.

Expert weights come as MXFP4 (`*_blocks`, `*_scales`, [E, out, in/32, 16]) or dequantized; in the
dequantized HF layout they are stored [E, in, out] and are transposed to our [E, out, in].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kernels.moe.fp8_experts import Fp8Experts
from model.config import GptOssConfig
from model.gpt_oss import GptOssForCausalLM
from model.mxfp4 import dequantize_mxfp4
from model.safetensors_io import TensorInfo, read_header, read_tensor
from model.parallel import SINGLE, Parallel


class CheckpointError(ValueError):
    """A tensor is missing, unexpected or mis-shaped; the message names the tensor and the file."""


class Checkpoint:
    """Access to the tensors of a safetensors folder, read one tensor (or one row range) at a time."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"checkpoint folder {self.folder} does not exist")
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted({self.folder / f for f in json.loads(index.read_text())["weight_map"].values()})
            for path in files:
                if not path.exists():
                    raise CheckpointError(f"{index.name} names {path.name}, which is missing")
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors file in {self.folder}")
        self.info: dict[str, TensorInfo] = {}
        for path in files:
            for name, info in read_header(path).items():
                if name in self.info:
                    raise CheckpointError(f"tensor {name} appears in both {self.info[name].path.name} and {path.name}")
                self.info[name] = info
        self.bytes_read = 0  # what this rank read, to check that it reads only its shards

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def names(self) -> set[str]:
        return set(self.info)

    def shape(self, name: str) -> list[int]:
        return list(self.info[name].shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor or a row/column range of it, reading only those bytes (into `out` when it fits)."""
        if name not in self.info:
            raise CheckpointError(f"tensor {name} is missing from checkpoint {self.folder}")
        t = read_tensor(self.info[name], rows, cols, out)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def where(self, name: str) -> str:
        return self.info[name].path.name if name in self.info else "(no file)"


@dataclass(frozen=True)
class _Shards:
    """The index ranges one rank owns."""

    q_rows: slice  # rows of q_proj (heads * head_dim)
    kv_rows: slice
    heads: slice
    vocab: slice
    experts: slice

    @staticmethod
    def of(config: GptOssConfig, p: Parallel) -> "_Shards":
        def part(total: int, size: int, rank: int) -> slice:
            n = total // size
            return slice(rank * n, (rank + 1) * n)

        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        heads = part(hq, p.tp_size, p.tp_rank)
        kv = part(hkv, p.tp_size, p.tp_rank)
        return _Shards(
            q_rows=slice(heads.start * d, heads.stop * d),
            kv_rows=slice(kv.start * d, kv.stop * d),
            heads=heads,
            vocab=part(config.vocab_size, p.tp_size, p.tp_rank),
            experts=part(config.num_local_experts, p.ep_size, p.ep_rank),
        )


# A reader returns the parameter's value; plain reads go straight into the parameter's memory
# (`param`) when dtype and shape agree, so the loader holds no second copy of big tensors.
Reader = Callable[[Checkpoint, str, _Shards, torch.Tensor], torch.Tensor]


def _rows(suffix: str, shard: str) -> Reader:
    return lambda ck, prefix, sh, param: ck.read(prefix + suffix, rows=getattr(sh, shard), out=param.data)


def _cols(suffix: str, shard: str) -> Reader:
    return lambda ck, prefix, sh, param: ck.read(prefix + suffix, cols=getattr(sh, shard), out=param.data)


def _whole(suffix: str) -> Reader:
    return lambda ck, prefix, sh, param: ck.read(prefix + suffix, out=param.data)


def _qkv(kind: str) -> Reader:
    def read(ck, prefix, sh, param):
        parts = [ck.read(f"{prefix}self_attn.{p}_proj.{kind}", rows=rows)
                 for p, rows in (("q", sh.q_rows), ("k", sh.kv_rows), ("v", sh.kv_rows))]
        return torch.cat([t.to(parts[0].dtype) for t in parts], dim=0)
    return read


def _experts(name: str) -> Reader:
    """An expert weight [E_local, out, in] from MXFP4 blocks/scales or from a dense [E, in, out]."""
    def read(ck, prefix, sh, param):
        base = f"{prefix}mlp.experts.{name}"
        if base + "_blocks" in ck:
            blocks = ck.read(base + "_blocks", rows=sh.experts)
            scales = ck.read(base + "_scales", rows=sh.experts)
            return dequantize_mxfp4(blocks, scales, param.dtype)
        return ck.read(base, rows=sh.experts).transpose(1, 2)
    return read


def _expert_names(name: str) -> Callable[[Checkpoint, str], list[str]]:
    def names(ck, prefix):
        base = f"{prefix}mlp.experts.{name}"
        return [base + "_blocks", base + "_scales"] if base + "_blocks" in ck else [base]
    return names


# our parameter (suffix after "model.layers.N." or a full name) -> how to read it
_LAYER_SOURCES: dict[str, tuple[Reader, Callable[[Checkpoint, str], list[str]]]] = {}


def _src(ours: str, reader: Reader, *theirs: str) -> None:
    _LAYER_SOURCES[ours] = (reader, lambda ck, prefix, names=theirs: [prefix + n for n in names])


_src("input_layernorm.weight", _whole("input_layernorm.weight"), "input_layernorm.weight")
_src("post_attention_layernorm.weight", _whole("post_attention_layernorm.weight"), "post_attention_layernorm.weight")
_src("self_attn.qkv_proj.weight", _qkv("weight"), *(f"self_attn.{p}_proj.weight" for p in "qkv"))
_src("self_attn.qkv_proj.bias", _qkv("bias"), *(f"self_attn.{p}_proj.bias" for p in "qkv"))
_src("self_attn.o_proj.weight", _cols("self_attn.o_proj.weight", "q_rows"), "self_attn.o_proj.weight")
_src("self_attn.o_proj.bias", _whole("self_attn.o_proj.bias"), "self_attn.o_proj.bias")
_src("self_attn.sinks", _rows("self_attn.sinks", "heads"), "self_attn.sinks")
_src("mlp.router.weight", _whole("mlp.router.weight"), "mlp.router.weight")
_src("mlp.router.bias", _whole("mlp.router.bias"), "mlp.router.bias")
_src("mlp.experts.gate_up_proj_bias", _rows("mlp.experts.gate_up_proj_bias", "experts"), "mlp.experts.gate_up_proj_bias")
_src("mlp.experts.down_proj_bias", _rows("mlp.experts.down_proj_bias", "experts"), "mlp.experts.down_proj_bias")
_LAYER_SOURCES["mlp.experts.gate_up_proj"] = (_experts("gate_up_proj"), _expert_names("gate_up_proj"))
_LAYER_SOURCES["mlp.experts.down_proj"] = (_experts("down_proj"), _expert_names("down_proj"))

_TOP_SOURCES = {
    "model.embed_tokens.weight": (_rows("model.embed_tokens.weight", "vocab"),
                                  lambda ck, prefix: ["model.embed_tokens.weight"]),
    "model.norm.weight": (_whole("model.norm.weight"), lambda ck, prefix: ["model.norm.weight"]),
    "lm_head.weight": (_rows("lm_head.weight", "vocab"), lambda ck, prefix: ["lm_head.weight"]),
}

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _source_of(name: str):
    m = _LAYER_NAME.match(name)
    if m:
        prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
        return prefix, _LAYER_SOURCES.get(suffix)
    return "", _TOP_SOURCES.get(name)


def load_weights(model: GptOssForCausalLM, folder: str | Path, progress: bool = True) -> int:
    """Fill every parameter of `model` from the checkpoint in `folder` (this rank's shards only).
    Returns the number of checkpoint bytes read."""
    ck = Checkpoint(folder)
    shards = _Shards.of(model.config, model.parallel)
    params = [(n, p) for n, p in model.named_parameters() if not n.endswith(".inv_freq")]
    used: set[str] = set()
    bar = _progress(len(params), progress)
    for name, param in params:
        prefix, source = _source_of(name)
        if source is None:
            raise CheckpointError(f"parameter {name} has no checkpoint source (loader table out of date)")
        reader, names_of = source
        names = names_of(ck, prefix)
        for n in names:
            if n not in ck:
                raise CheckpointError(f"tensor {n} is missing from checkpoint {ck.folder}")
        used.update(names)
        value = reader(ck, prefix, shards, param)
        if tuple(value.shape) != tuple(param.shape):
            full = {n: ck.shape(n) for n in names}
            raise CheckpointError(
                f"tensor {names[0]} in {ck.where(names[0])} has shape {full[names[0]]}; "
                f"parameter {name} needs {list(param.shape)} from it (after sharding)"
            )
        if value.data_ptr() != param.data_ptr():
            with torch.no_grad():
                param.copy_(value)
        del value
        bar.update(1)
    bar.close()
    # FP8 experts (kernels/moe/fp8_experts.py) hold buffers, not parameters: model/convert.py loads them.
    if any(isinstance(m, Fp8Experts) for m in model.modules()):
        used.update(n for n in ck.names() if ".mlp.experts." in n)
    unexpected = sorted(ck.names() - used)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in {ck.where(unexpected[0])}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    return ck.bytes_read


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="loading weights", unit="tensor", disable=not enabled, leave=False)


def read_config(folder: str | Path) -> GptOssConfig:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    config = GptOssConfig.from_json(path)
    gen = Path(folder) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        if eos:
            config.eos_token_ids = sorted(set(config.eos_token_ids) | set(eos))
    return config


def resolve_dtype(name: str, config: GptOssConfig) -> torch.dtype:
    if name == "auto":
        name = config.torch_dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return table[name]


def load_model(folder: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               parallel: Parallel = SINGLE, progress: bool = True, **model_kwargs) -> GptOssForCausalLM:
    config = read_config(folder)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, config)
    model = GptOssForCausalLM(config, parallel, torch_dtype, device, **model_kwargs)
    load_weights(model, folder, progress)
    return model.eval()
