"""Build a GptOssForCausalLM for one device with the kernels that device runs.

Two sources of weights:
- a checkpoint folder (`checkpoint=`): dense weights through model/loader.py; with the FP8 MoE the
  experts come from model/convert.py (an FP8-converted checkpoint read as is, MXFP4/bf16 converted on
  the device);
- random weights of the real shapes (`random_weights=True`), made directly on the device: the
  benchmarks run the full 20b/120b shapes where the real checkpoints cannot be downloaded. FP8 experts
  are drawn expert by expert straight into FP8, so the 120b experts (117 GB in FP8) never exist in bf16.

Backends: "auto" picks the GPU kernels on CUDA (FlashInfer + our Triton decode for attention, the
Triton FP8 grouped GEMMs for the MoE) and the pure-torch twins on CPU.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from engine.config import DECODE_FRONTS, DENSE_DTYPES, LM_HEAD_DTYPES, segments_rows_problem
from model.config import GptOssConfig
from model.gpt_oss import GptOssForCausalLM
from model.parallel import SINGLE, Parallel

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
MOE_BACKENDS = ("auto", "torch", "fp8")
# DeepGEMM where a build works here (deep_gemm_ops.available() runs a probe GEMM), else Triton. The
# prebuilt sgl-deep-gemm wheels fail on torch 2.11; a from-source build works (kernels/moe/NOTES.md).
FP8_KERNELS = "auto"

log = logging.getLogger(__name__)


class ModelFactoryError(ValueError):
    """A backend choice does not fit the device, or the weight source is missing; the message says what to change."""


def resolve_backends(attention: str, moe: str, device: torch.device) -> tuple[str, str]:
    """("torch" | "flashinfer", "torch" | "fp8") for `device`; auto = GPU kernels on CUDA, twins on CPU."""
    if attention not in ATTENTION_BACKENDS:
        raise ModelFactoryError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if moe not in MOE_BACKENDS:
        raise ModelFactoryError(f"moe_backend must be one of {MOE_BACKENDS}, got {moe!r}")
    cuda = device.type == "cuda"
    if attention == "flashinfer" and not cuda:
        raise ModelFactoryError(f"attention_backend 'flashinfer' needs a CUDA device, got {device}; use 'torch' or 'auto'")
    attention = ("flashinfer" if cuda else "torch") if attention == "auto" else attention
    moe = ("fp8" if cuda else "torch") if moe == "auto" else moe
    return attention, moe


def make_attention_backend(config: GptOssConfig, parallel: Parallel, device: torch.device,
                           max_batch: int = 256, max_kv_len: int | None = None, cuda_graph: bool = False):
    """The FlashInfer/Triton backend for this rank's heads. `cuda_graph=True` fixes the decode split
    count per batch size (from `max_kv_len`), which captured graphs need."""
    from kernels.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        [config.is_sliding(i) for i in range(config.num_hidden_layers)], config.sliding_window, config.head_dim,
        config.num_attention_heads // parallel.tp_size, config.num_key_value_heads // parallel.tp_size, device,
        max_batch=max_batch, max_kv_len=max_kv_len or config.max_position_embeddings, cuda_graph=cuda_graph)


def _fp8_experts_module(config: GptOssConfig, parallel: Parallel, device: torch.device):
    from kernels.moe.fp8_experts import Fp8Experts

    num_local = config.num_local_experts // parallel.ep_size
    return Fp8Experts(num_local, parallel.ep_rank * num_local, config.hidden_size, config.intermediate_size,
                      config.swiglu_alpha, config.swiglu_limit, device,
                      backend=FP8_KERNELS if device.type == "cuda" else "torch")


@torch.no_grad()
def random_fp8_experts(config: GptOssConfig, parallel: Parallel, device: torch.device,
                       generator: torch.Generator):
    """One layer's Fp8Experts with random weights: values ~N(0, 1) rounded to e4m3, block scales
    1/sqrt(K), so a layer keeps activations O(1) like a trained one. K padding stays zero."""
    module = _fp8_experts_module(config, parallel, device)
    for w, s, k in ((module.w13, module.s13, config.hidden_size), (module.w2, module.s2, config.intermediate_size)):
        s.fill_(1.0 / math.sqrt(k))
        for e in range(w.shape[0]):  # one expert at a time: a bf16 temporary of ~34 MB, never a layer
            tmp = torch.empty(w.shape[1], k, dtype=torch.bfloat16, device=device).normal_(generator=generator)
            w[e, :, :k].copy_(tmp.to(w.dtype))
    module.b13.normal_(0.0, 0.02, generator=generator)
    module.b2.normal_(0.0, 0.02, generator=generator)
    return module


@torch.no_grad()
def random_mxfp4_experts(config: GptOssConfig, parallel: Parallel, device: torch.device, generator: torch.Generator,
                         mxfp4_decode_max_tokens: int):
    """One layer's experts drawn as MXFP4 (uniform random E2M1 codes, group scales 2^-8..2^-6, so a layer keeps
    activations O(1)), converted to FP8 as a checkpoint's are (exactly: kernels/moe/fp8_quant.py), and the
    MXFP4 copy attached for decode steps of up to `mxfp4_decode_max_tokens` tokens."""
    from kernels.moe.fp8_experts import Fp8Experts

    num_local = config.num_local_experts // parallel.ep_size
    d, i = config.hidden_size, config.intermediate_size

    def draw(n: int, k: int):
        blocks = torch.randint(0, 256, (num_local, n, k // 32, 16), dtype=torch.uint8, device=device, generator=generator)
        scales = torch.randint(119, 122, (num_local, n, k // 32), dtype=torch.uint8, device=device, generator=generator)
        return blocks, scales

    (gb, gs), (db, ds) = draw(2 * i, d), draw(d, i)
    b13 = torch.empty(num_local, 2 * i, device=device).normal_(0.0, 0.02, generator=generator)
    b2 = torch.empty(num_local, d, device=device).normal_(0.0, 0.02, generator=generator)
    module = Fp8Experts.from_mxfp4(gb, gs, b13, db, ds, b2, parallel.ep_rank * num_local, config.swiglu_alpha,
                                   config.swiglu_limit, device, backend=FP8_KERNELS)
    module.attach_mxfp4(gb, gs, db, ds, mxfp4_decode_max_tokens)
    return module


@torch.no_grad()
def randomize_dense(model: GptOssForCausalLM, generator: torch.Generator) -> None:
    """Random dense weights (everything but FP8 experts, which random_fp8_experts fills): N(0, 1/fan_in)
    for matrices, small biases, unit norms, N(0, 1) sinks."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=generator)
        else:
            p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.02, generator=generator)


def build_model(config: GptOssConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                attention_backend: str = "auto", moe_backend: str = "auto", checkpoint: str | Path | None = None,
                random_weights: bool = False, seed: int = 0, parallel: Parallel = SINGLE,
                max_batch: int = 256, max_kv_len: int | None = None, cuda_graph: bool = False,
                progress: bool = False, lm_head_dtype: str = "auto",
                mxfp4_decode_max_tokens: int = 0, dense_dtype: str = "auto",
                decode_front: str = "auto", moe_segments_max_rows: int | None = None) -> GptOssForCausalLM:
    """The model on `device` with resolved backends, from `checkpoint` or (random_weights=True) random;
    lm_head_dtype="fp8_e4m3" then rounds the unembedding to FP8 (quantize_lm_head_fp8), dense_dtype="fp8_e4m3"
    QKV and O (quantize_dense_fp8);
    mxfp4_decode_max_tokens > 0 keeps the MXFP4 experts too, for decode steps of up to that many tokens
    (EngineConfig.mxfp4_decode_max_tokens); decode_front picks the MoE front of single-token steps
    (EngineConfig.decode_front), its CUDA extension building while the weights load; moe_segments_max_rows, if
    given, replaces the FP8 experts' segments_max_rows (EngineConfig.moe_segments_max_rows)."""
    if (checkpoint is None) == (not random_weights):
        raise ModelFactoryError("give exactly one weight source: checkpoint=FOLDER or random_weights=True")
    from engine.distributed.executor import check_devices

    check_devices(1, str(device))  # a named but absent GPU: one message, not a failure deep in the build
    if lm_head_dtype not in LM_HEAD_DTYPES:
        raise ModelFactoryError(f"lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {lm_head_dtype!r}")
    if dense_dtype not in DENSE_DTYPES:
        raise ModelFactoryError(f"dense_dtype must be one of {DENSE_DTYPES}, got {dense_dtype!r}")
    if problem := segments_rows_problem(moe_segments_max_rows):
        raise ModelFactoryError(problem)
    if mxfp4_decode_max_tokens:
        _, moe = resolve_backends(attention_backend, moe_backend, torch.device(device))
        if torch.device(device).type != "cuda" or moe != "fp8":
            raise ModelFactoryError(f"mxfp4_decode_max_tokens={mxfp4_decode_max_tokens} runs a CUDA kernel on the FP8 "
                                    f"MoE's experts: it needs a CUDA device and moe_backend 'fp8' (got {device}, {moe})")
        check_mxfp4_copy_fits(config, parallel, torch.cuda.mem_get_info(torch.device(device))[0], dense_dtype,
                              lm_head_dtype)
    front_build = _start_decode_front(decode_front, config, torch.device(device), attention_backend, moe_backend)
    model = _build(config, device, dtype, attention_backend, moe_backend, checkpoint, seed, parallel, max_batch,
                   max_kv_len, cuda_graph, progress, mxfp4_decode_max_tokens)
    if front_build is not None:
        _use_decode_front(model, decode_front, front_build)
    if lm_head_dtype == "fp8_e4m3":
        quantize_lm_head_fp8(model)
    if dense_dtype == "fp8_e4m3":
        quantize_dense_fp8(model)
    if moe_segments_max_rows is not None:
        set_segments_max_rows(model, moe_segments_max_rows)
    return model


def _fp8_experts(model: GptOssForCausalLM) -> list:
    from kernels.moe.fp8_experts import Fp8Experts

    return [m for m in model.modules() if isinstance(m, Fp8Experts)]


def set_segments_max_rows(model: GptOssForCausalLM, rows: int) -> None:
    """Every FP8 experts module's segments_max_rows = rows (nothing without the FP8 MoE)."""
    for m in _fp8_experts(model):
        m.segments_max_rows = rows


def segments_max_rows_of(model: GptOssForCausalLM) -> int | None:
    """The FP8 experts' segments_max_rows (None without the FP8 MoE), for benchmark records."""
    values = {m.segments_max_rows for m in _fp8_experts(model)}
    if len(values) > 1:
        raise ModelFactoryError(f"the layers' experts disagree on segments_max_rows: {sorted(values)}")
    return values.pop() if values else None


def _start_decode_front(choice: str, config: GptOssConfig, device: torch.device, attention_backend: str,
                        moe_backend: str):
    """The CUDA front's build (a future) when `choice` resolves to it for this model and device, else None."""
    from kernels.moe import decode_front_cuda

    if choice not in DECODE_FRONTS:
        raise ModelFactoryError(f"decode_front must be one of {DECODE_FRONTS}, got {choice!r}")
    _, moe = resolve_backends(attention_backend, moe_backend, device)
    if choice == "cuda" and (device.type != "cuda" or moe != "fp8"):
        raise ModelFactoryError(f"decode_front='cuda' runs a CUDA kernel of the FP8 MoE: it needs a CUDA device and "
                                f"moe_backend 'fp8' (got {device}, {moe})")
    if not decode_front_cuda.wanted(choice, config.num_local_experts, device, moe):
        return None
    why = decode_front_cuda.model_outside_range(config.num_local_experts, config.hidden_size,
                                                config.num_experts_per_tok, device)
    if why is not None:
        if choice == "cuda":
            raise ModelFactoryError(f"decode_front='cuda': {why}; use decode_front='triton'")
        return None
    return decode_front_cuda.build_in_background()


def _use_decode_front(model: GptOssForCausalLM, choice: str, build) -> None:
    """Wait for the CUDA front's build; on success every FP8 MoE layer takes it at one token. A failed build
    raises for decode_front='cuda' and falls back to the Triton front (logged) for 'auto'."""
    try:
        build.result()
    except Exception as e:  # a compiler error, no nvcc / ninja: the Triton front serves instead
        if choice == "cuda":
            raise ModelFactoryError(f"decode_front='cuda': building kernels/moe/decode_front_cuda.py's extension "
                                    f"failed ({type(e).__name__}: {e}); use decode_front='triton'") from e
        log.warning("decode_front auto: the CUDA front did not build (%s: %s); single-token steps take the Triton "
                    "front", type(e).__name__, str(e)[:500])
        return
    for module in _fp8_experts(model):
        module.cuda_front = True


def check_mxfp4_copy_fits(config: GptOssConfig, parallel: Parallel, free_bytes: int, dense_dtype: str = "auto",
                          lm_head_dtype: str = "auto") -> None:
    """Refuse, before loading, weights that with the MXFP4 copy of the experts would not fit the device (120b on
    one H200: 117 GB of FP8 experts and 62 GB of MXFP4), rather than run out of memory halfway through."""
    from engine.memory_budget import FIXED_BYTES, weight_bytes_estimate

    need = weight_bytes_estimate(config, parallel.tp_size, parallel.ep_size, mxfp4_copy=True, dense_dtype=dense_dtype,
                                 lm_head_dtype=lm_head_dtype)
    total = sum(need.values()) + FIXED_BYTES
    if total > free_bytes:
        gb = {k: round(v / 1e9, 1) for k, v in need.items()}
        raise ModelFactoryError(f"mxfp4_decode_max_tokens keeps the experts twice: FP8 {gb['fp8_experts']} GB and MXFP4 "
                                f"{gb['mxfp4_copy']} GB, with {gb['dense']} GB of dense weights {total / 1e9:.1f} GB, more "
                                f"than the {free_bytes / 1e9:.1f} GB free on this device: set mxfp4_decode_max_tokens=0, "
                                f"or split the experts over more GPUs (ep_size)")


def quantize_lm_head_fp8(model: GptOssForCausalLM) -> None:
    """Swap the unembedding for an FP8 128x128-block copy (the bf16 weight is released).

    Only the unembedding (lm_head_dtype): the FP8 GEMV streams it 1.6-1.8x faster than cuBLAS reads the bf16
    weight at <= 16 tokens (H200 2026-11-30, bench/results/gemv_fp8_h200.json, kernels/layers/NOTES.md). QKV and
    O are the separate opt-in dense_dtype (quantize_dense_fp8)."""
    from kernels.layers.fp8_linear import Fp8Linear

    model.lm_head = Fp8Linear.from_linear(model.lm_head)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def quantize_dense_fp8(model: GptOssForCausalLM) -> None:
    """Swap every layer's QKV and O projections for FP8 128x128-block copies with FP8 activations above 64
    tokens (kernels/layers/fp8_linear.py; the bf16 weights are released). Each rank converts its own shard."""
    from kernels.layers.fp8_linear import Fp8Linear

    if model.device.type == "cuda" and model.dtype != torch.bfloat16:
        raise ModelFactoryError(f"dense_dtype='fp8_e4m3' on CUDA needs bf16 activations (its FP8 GEMMs write bf16); "
                                f"the model is {model.dtype}")
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.qkv_proj = Fp8Linear.from_linear(attn.qkv_proj, fp8_activations=True)
        attn.o_proj = Fp8Linear.from_linear(attn.o_proj, fp8_activations=True)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _build(config: GptOssConfig, device, dtype: torch.dtype, attention_backend: str, moe_backend: str,
           checkpoint, seed: int, parallel: Parallel, max_batch: int, max_kv_len: int | None, cuda_graph: bool,
           progress: bool, mxfp4_decode_max_tokens: int = 0) -> GptOssForCausalLM:
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches on the current device: a model on cuda:1 in a process still on cuda:0 fails its
        # first kernel. A process serves one model (a replica, a rank), so it follows the model's device.
        torch.cuda.set_device(device)
    attention, moe = resolve_backends(attention_backend, moe_backend, device)
    backend = (make_attention_backend(config, parallel, device, max_batch, max_kv_len, cuda_graph)
               if attention == "flashinfer" else None)
    if checkpoint is not None:
        from model.convert import is_converted
        from model.loader import Checkpoint, load_model

        factory = None
        if moe == "torch" and is_converted(Checkpoint(checkpoint)):
            # a `gptoss convert` checkpoint holds only the FP8 experts: run them (the torch twin on CPU)
            moe = "fp8"
        if moe == "fp8":
            from model.convert import load_fp8_experts

            factory = iter(load_fp8_experts(checkpoint, parallel, device, mxfp4_decode_max_tokens,
                                            backend=FP8_KERNELS if device.type == "cuda" else "torch")).__next__
        return load_model(checkpoint, dtype=dtype, device=device, parallel=parallel, progress=progress,
                          backend=backend, experts_factory=factory)
    generator = torch.Generator(device).manual_seed(seed)
    factory = None
    if moe == "fp8" and mxfp4_decode_max_tokens:
        def factory():
            return random_mxfp4_experts(config, parallel, device, generator, mxfp4_decode_max_tokens)
    elif moe == "fp8":
        def factory():
            return random_fp8_experts(config, parallel, device, generator)
    model = GptOssForCausalLM(config, parallel, dtype, device, backend=backend, experts_factory=factory)
    randomize_dense(model, generator)
    return model.eval()


def weight_bytes(model: GptOssForCausalLM) -> dict[str, int]:
    """Bytes held by the experts and by everything else (dense), for memory planning and reports."""
    experts = dense = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = t.numel() * t.element_size()
        if ".experts." in name:
            experts += n
        elif not name.endswith(("inv_freq", "cos_sin")):  # the rotary's tables are no weights
            dense += n
    return {"experts": experts, "dense": dense}


def random_for_engine(model_config: GptOssConfig, config, parallel: Parallel = SINGLE, seed: int = 0) -> GptOssForCausalLM:
    """What load_for_engine builds, with random weights of `model_config`'s shapes instead of a checkpoint
    (benchmarks of the full-size models where no checkpoint can be downloaded): this rank's shard,
    drawn on its device from `seed` (ranks with the same seed draw alike, so shards are not slices of one
    model: fine for timing, not for comparing logits across TP sizes)."""
    from model.loader import resolve_dtype

    return _with_precompile(model_config, config, parallel, lambda: build_model(
        model_config, config.device, resolve_dtype(config.dtype, model_config), config.attention_backend,
        config.moe_backend, random_weights=True, seed=seed, parallel=parallel, max_batch=config.max_num_seqs,
        max_kv_len=config.max_model_len, cuda_graph=config.cuda_graphs, lm_head_dtype=config.lm_head_dtype,
        mxfp4_decode_max_tokens=config.mxfp4_decode_max_tokens, dense_dtype=config.dense_dtype,
        decode_front=config.decode_front, moe_segments_max_rows=config.moe_segments_max_rows))


def load_for_engine(folder: str | Path, config, parallel: Parallel = SINGLE, progress: bool = False) -> GptOssForCausalLM:
    """The model an engine with EngineConfig `config` runs: this rank's shard of the checkpoint in `folder`,
    with the kernels and buffer sizes the config asks for (the one place that maps EngineConfig to build_model)."""
    from model.loader import read_config, resolve_dtype

    mc = read_config(folder)
    return _with_precompile(mc, config, parallel, lambda: build_model(
        mc, config.device, resolve_dtype(config.dtype, mc), config.attention_backend, config.moe_backend,
        checkpoint=folder, parallel=parallel, max_batch=config.max_num_seqs, max_kv_len=config.max_model_len,
        cuda_graph=config.cuda_graphs, progress=progress, lm_head_dtype=config.lm_head_dtype,
        mxfp4_decode_max_tokens=config.mxfp4_decode_max_tokens, dense_dtype=config.dense_dtype,
        decode_front=config.decode_front, moe_segments_max_rows=config.moe_segments_max_rows))


def _with_precompile(model_config: GptOssConfig, config, parallel: Parallel, build):
    """build(), with the Triton kernels of a matching manifest compiling in other processes meanwhile
    (engine/triton_precompile.py); the handle goes with the model to its first graph capture."""
    from engine import triton_precompile

    precompile = triton_precompile.start_for(model_config, config, parallel)
    try:
        model = build()
    except BaseException:
        if precompile is not None:
            precompile.cancel()
        raise
    return triton_precompile.attach(model, precompile)
