"""Offline FP8 conversion of the MoE experts (`gptoss convert SRC DST`) and loading of FP8 experts.

A converted checkpoint is the source checkpoint with each layer's expert weights replaced by the
tensors `Fp8Experts` computes with (float8_e4m3fn, K padded 2880 -> 2944, fp32 128x128 block scales):

  model.layers.N.mlp.experts.gate_up_proj_fp8         [E, 2I, Hp]  F8_E4M3 (rows interleaved gate/up)
  model.layers.N.mlp.experts.gate_up_proj_fp8_scale   [E, ceil(2I/128), Hp/128] F32
  model.layers.N.mlp.experts.down_proj_fp8            [E, D, Ip]   F8_E4M3
  model.layers.N.mlp.experts.down_proj_fp8_scale      [E, ceil(D/128), Ip/128]  F32

Everything else (biases included) is copied unchanged. One safetensors file per layer keeps the
converter's memory at one layer. The same conversion runs at load time on the GPU when the
checkpoint is not converted (`load_fp8_experts`); both produce identical tensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernels.moe.fp8_experts import Fp8Experts
from kernels.moe.fp8_quant import mxfp4_to_fp8_blocks, padded, quantize_weight_blocks
from model.config import GptOssConfig
from model.loader import Checkpoint, CheckpointError, read_config
from model.parallel import SINGLE, Parallel

FP8_SUFFIXES = ("gate_up_proj_fp8", "gate_up_proj_fp8_scale", "down_proj_fp8", "down_proj_fp8_scale")


def _expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def is_converted(ck: Checkpoint) -> bool:
    return _expert_prefix(0) + "gate_up_proj_fp8" in ck


def _convert_weight(ck: Checkpoint, base: str, experts: slice, k_padded: int, device: torch.device):
    """One expert weight (MXFP4 blocks/scales or dense HF [E, in, out]) -> (fp8, scales) on `device`."""
    if base + "_blocks" in ck:
        blocks = ck.read(base + "_blocks", rows=experts).to(device)
        scales = ck.read(base + "_scales", rows=experts).to(device)
        return mxfp4_to_fp8_blocks(blocks, scales, k_padded)
    if base in ck:
        return quantize_weight_blocks(ck.read(base, rows=experts).to(device).transpose(1, 2), k_padded)
    raise CheckpointError(f"neither {base}_blocks nor {base} is in checkpoint {ck.folder}")


def convert_checkpoint(src: str | Path, dst: str | Path, device: str | torch.device | None = None,
                       progress: bool = True) -> dict:
    """Write the FP8-expert checkpoint of `src` to `dst`; returns timing and size statistics."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError("DST must differ from SRC: the converter writes a new checkpoint folder")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = read_config(src)
    ck = Checkpoint(src)
    if is_converted(ck):
        raise CheckpointError(f"{src} already holds FP8 experts (mlp.experts.*_fp8)")
    dst.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    hp, ip = padded(config.hidden_size), padded(config.intermediate_size)
    all_experts = slice(0, config.num_local_experts)
    weight_map: dict[str, str] = {}
    consumed: set[str] = set()
    written = 0
    for layer in range(config.num_hidden_layers):
        prefix = _expert_prefix(layer)
        tensors = {}
        for name, kp in (("gate_up_proj", hp), ("down_proj", ip)):
            q, s = _convert_weight(ck, prefix + name, all_experts, kp, device)
            tensors[prefix + name + "_fp8"], tensors[prefix + name + "_fp8_scale"] = q.cpu(), s.cpu()
            consumed.update({prefix + name, prefix + name + "_blocks", prefix + name + "_scales"})
        fname = f"model-layer{layer:03d}.safetensors"
        save_file(tensors, dst / fname, metadata={"format": "pt"})
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: fname for n in tensors})
        if progress:
            print(f"layer {layer + 1}/{config.num_hidden_layers} converted", flush=True)
    rest = {n: ck.read(n) for n in sorted(ck.names() - consumed)}
    save_file(rest, dst / "model-rest.safetensors", metadata={"format": "pt"})
    written += sum(t.numel() * t.element_size() for t in rest.values())
    weight_map.update({n: "model-rest.safetensors" for n in rest})
    index = {"metadata": {"total_size": written}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {
        "quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic", "modules": ["mlp.experts"], "k_padded_to_multiple_of": 128,
    }
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / extra).exists():
            shutil.copy2(src / extra, dst / extra)
    return {"seconds": time.perf_counter() - start, "bytes_written": written, "device": str(device)}


def load_layer_experts(ck: Checkpoint, config: GptOssConfig, layer: int, parallel: Parallel = SINGLE,
                       device: str | torch.device = "cuda", mxfp4_decode_max_tokens: int = 0, **kwargs) -> Fp8Experts:
    """This rank's experts of one layer as `Fp8Experts`, from a converted checkpoint (read as is) or
    from MXFP4 / bf16 experts (converted on `device`); mxfp4_decode_max_tokens > 0 also keeps the MXFP4
    experts for small decode steps (Fp8Experts.attach_mxfp4), which only an MXFP4 checkpoint has."""
    device = torch.device(device)
    num_local = config.num_local_experts // parallel.ep_size
    first = parallel.ep_rank * num_local
    experts = slice(first, first + num_local)
    prefix = _expert_prefix(layer)
    args = (num_local, first, config.hidden_size, config.intermediate_size,
            config.swiglu_alpha, config.swiglu_limit, device)
    module = Fp8Experts(*args, **kwargs)
    biases = [ck.read(prefix + n, rows=experts) for n in ("gate_up_proj_bias", "down_proj_bias")]
    if mxfp4_decode_max_tokens:
        names = [prefix + n + s for n in ("gate_up_proj", "down_proj") for s in ("_blocks", "_scales")]
        if any(n not in ck for n in names):
            raise CheckpointError(f"mxfp4_decode_max_tokens={mxfp4_decode_max_tokens} needs the MXFP4 experts "
                                  f"({names[0]} ...), which {ck.folder} does not hold (FP8-converted or bf16 experts): "
                                  f"load the original checkpoint or set mxfp4_decode_max_tokens to 0")
        gb, gs, db, ds = (ck.read(n, rows=experts).to(device) for n in names)
        module.load_quantized(*mxfp4_to_fp8_blocks(gb, gs, module.w13.shape[2]), biases[0],
                              *mxfp4_to_fp8_blocks(db, ds, module.w2.shape[2]), biases[1])
        module.attach_mxfp4(gb, gs, db, ds, mxfp4_decode_max_tokens)
    elif prefix + "gate_up_proj_fp8" in ck:
        w = [ck.read(prefix + n, rows=experts).to(device) for n in FP8_SUFFIXES]
        module.load_quantized(w[0], w[1], biases[0], w[2], w[3], biases[1])
    else:
        w13 = _convert_weight(ck, prefix + "gate_up_proj", experts, module.w13.shape[2], device)
        w2 = _convert_weight(ck, prefix + "down_proj", experts, module.w2.shape[2], device)
        module.load_quantized(*w13, biases[0], *w2, biases[1])
    return module


def load_fp8_experts(folder: str | Path, parallel: Parallel = SINGLE, device: str | torch.device = "cuda",
                     mxfp4_decode_max_tokens: int = 0, **kwargs) -> list[Fp8Experts]:
    """Every layer's `Fp8Experts` (for `GptOssForCausalLM(experts_factory=iter(result).__next__)`)."""
    config = read_config(folder)
    ck = Checkpoint(folder)
    return [load_layer_experts(ck, config, layer, parallel, device, mxfp4_decode_max_tokens, **kwargs)
            for layer in range(config.num_hidden_layers)]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF GPT-OSS checkpoint folder (MXFP4 or bf16 experts)")
    p.add_argument("dst", help="output folder (created)")
    p.add_argument("--device", default=None, help="where to convert (default: cuda if available, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no per-layer progress lines")
    p.set_defaults(func=_run_convert)


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Register `convert SRC DST` on an argparse subparsers object (the `gptoss` CLI); the parsed
    namespace's `func(args)` runs it and returns the exit code."""
    p = subparsers.add_parser("convert", help="write a copy of a checkpoint with FP8 (128x128-block) experts")
    _add_arguments(p)
    return p


def _run_convert(args: argparse.Namespace) -> int:
    stats = convert_checkpoint(args.src, args.dst, args.device, progress=not args.quiet)
    print(f"wrote {args.dst}: {stats['bytes_written'] / 1e9:.2f} GB in {stats['seconds']:.1f} s on {stats['device']}")
    return 0


def main_convert(argv: list[str] | None = None) -> int:
    """Entry point for the arguments after `gptoss convert`: SRC DST [--device D] [--quiet]."""
    p = argparse.ArgumentParser(prog="gptoss convert", description="FP8 (128x128-block) experts checkpoint")
    _add_arguments(p)
    args = p.parse_args(argv)
    return args.func(args)
