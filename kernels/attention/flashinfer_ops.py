"""FlashInfer 0.5.3, wrapped: the one module of the engine that imports `flashinfer` (bench/fp8_sink_prefill_probe.py,
a probe of its FP8 kernel, is the other).

What we use from it:
- `BatchAttentionWithAttentionSinkWrapper` for sink attention over the paged cache (prefill, and the
  decode comparison in bench/attention.py). Its JIT module is specialised at construction on
  (backend fa2|fa3, sliding window on|off), so a backend owns one wrapper per layer kind.
- `BatchDecodeWithPagedKVCacheWrapper`, FlashInfer's decode without sinks (its CUDA-core decode
  kernel, and with use_tensor_cores=True its fa2 prefill kernel): the bandwidth yardsticks the
  benchmark prints beside our Triton decode.

JIT cache. FlashInfer compiles each module on first use (about 70 s for one fa3 sink variant on
16 cores) into `$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops` (the
workspace base defaults to $HOME). Point FLASHINFER_WORKSPACE_BASE at a persistent folder and run
`python scripts/prebuild_flashinfer_jit.py` once per host image (it needs nvcc but no GPU when
FLASHINFER_CUDA_ARCH_LIST is set, e.g. "9.0a"); later processes find the modules built.
"""

from __future__ import annotations

import flashinfer
import torch
from flashinfer.jit import env as jit_env
from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module, gen_customize_batch_prefill_module
from flashinfer.jit.attention.variants import attention_sink_decl
from flashinfer.jit.core import JitSpec
from flashinfer.jit.page import gen_page_module
from flashinfer.utils import is_sm90a_supported

FLASHINFER_VERSION = flashinfer.__version__
PREFILL_BACKENDS = ("fa3", "fa2")
WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's split-KV scratch; its docs recommend 128 MB+


def default_prefill_backend(device: torch.device) -> str:
    """fa3 (wgmma, TMA) on Hopper; fa2 everywhere else."""
    return "fa3" if is_sm90a_supported(device) else "fa2"


def new_workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def sink_prefill_wrapper(
    workspace: torch.Tensor, window_left: int, backend: str, head_dim: int
) -> "flashinfer.BatchAttentionWithAttentionSinkWrapper":
    """Sink attention over an NHD paged bf16 cache; window_left=-1 for full layers, W-1 for a window W."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"prefill backend {backend!r} unknown; use one of {PREFILL_BACKENDS}")
    return flashinfer.BatchAttentionWithAttentionSinkWrapper(
        workspace,
        kv_layout="NHD",
        backend=backend,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        head_dim_qk=head_dim,
        head_dim_vo=head_dim,
        window_left=window_left,
    )


def plan_sink_prefill(
    wrapper,
    qo_indptr: torch.Tensor,  # int32 [B+1], host
    kv_indptr: torch.Tensor,  # int32 [B+1], host
    kv_indices: torch.Tensor,  # int32 [nnz pages], device
    last_page_len: torch.Tensor,  # int32 [B], host
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    window_left: int,
    scale: float,
) -> None:
    """Causal plan. FlashInfer's plan reads the indptrs on the host (it syncs): prefill only, never
    inside a CUDA graph. fa2's split-KV is turned off because its sink variant adds the sink in the
    first tile of every KV chunk (AttentionSink.REGISTER_M_D_UPDATE keys on kv_tile_idx == 0)."""
    wrapper.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal=True,
        sm_scale=scale,
        window_left=window_left,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        disable_split_kv=True,
    )


def sink_prefill_ragged_wrapper(
    workspace: torch.Tensor, window_left: int, backend: str, head_dim: int
) -> "flashinfer.BatchPrefillWithRaggedKVCacheWrapper":
    """Sink attention over K/V given as contiguous rows [nnz, Hkv, D] per sequence (no pages): FlashInfer's
    ragged wrapper on the same JIT module as sink_prefill_wrapper (its `ragged_run` entry point)."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"prefill backend {backend!r} unknown; use one of {PREFILL_BACKENDS}")
    args, kwargs = _sink_jit_args(backend, window_left >= 0, head_dim)
    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend,
                                                           jit_args=args, jit_kwargs=kwargs)


def plan_sink_prefill_ragged(wrapper, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
                             num_kv_heads: int, head_dim: int, window_left: int, scale: float) -> None:
    """Causal plan over ragged K/V (host int32 indptrs [B+1]; each sequence's queries are its last keys)."""
    wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=True, sm_scale=scale,
                 window_left=window_left, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                 disable_split_kv=True)


def run_sink_prefill_ragged(wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k / v [nnz, Hkv, D] (rows may be strided views: the head and D strides must be the
    contiguous ones), sinks fp32 [Hq]."""
    return wrapper.run(q, k, v, sinks, scale, out=out)


def run_sink_prefill(
    wrapper,
    q: torch.Tensor,  # [T, Hq, D] bf16
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    sinks: torch.Tensor,  # fp32 [Hq], natural-log units (added unscaled to the logits)
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # The variant's extra arguments follow its declaration: tensor "sink", then scalar "sm_scale".
    return wrapper.run(q, (k_cache, v_cache), sinks, scale, out=out)


def decode_wrapper(workspace: torch.Tensor, tensor_cores: bool = False) -> "flashinfer.BatchDecodeWithPagedKVCacheWrapper":
    """FlashInfer's own decode (split-KV), without sinks: a yardstick only."""
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD", use_tensor_cores=tensor_cores)


def plan_decode(wrapper, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                page_size, scale) -> None:
    wrapper.plan(kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


def run_decode(wrapper, q, k_cache, v_cache, out=None) -> torch.Tensor:
    return wrapper.run(q, (k_cache, v_cache), out=out)


def _sink_jit_args(backend: str, sliding: bool, head_dim: int) -> tuple[list, dict]:
    """The JIT arguments BatchAttentionWithAttentionSinkWrapper.__init__ builds its module from (same uri), so
    a module built here, or a ragged wrapper given them, is the one that wrapper finds in the cache."""
    dtype = torch.bfloat16
    args = [f"batch_prefill_attention_sink_bf16_swa_{sliding}_{backend}", dtype, dtype, dtype, torch.int32,
            head_dim, head_dim, ["sink"], ["float"], ["sm_scale"], ["double"], "AttentionSink",
            attention_sink_decl[backend]]
    return args, {"use_sliding_window": sliding, "use_fp16_qk_reduction": False, "pos_encoding_mode": 0}


def _sink_prefill_spec(backend: str, sliding: bool, head_dim: int) -> JitSpec:
    args, kwargs = _sink_jit_args(backend, sliding, head_dim)
    return gen_customize_batch_prefill_module(backend, *args, **kwargs)


def jit_specs(head_dim: int = 64, backends: tuple[str, ...] = PREFILL_BACKENDS, with_decode: bool = True) -> list[JitSpec]:
    """Every FlashInfer module this project can load: sink prefill per backend x (full, sliding), the
    page helper fa3 uses, and (for the benchmark) the no-sink bf16 decode kernels (CUDA-core decode
    and the fa2 prefill kernel that use_tensor_cores=True runs)."""
    specs = [_sink_prefill_spec(b, sliding, head_dim) for b in backends for sliding in (False, True)]
    specs.append(gen_page_module())
    if with_decode:
        dtype = torch.bfloat16
        specs.append(gen_batch_decode_module(dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False))
        specs.append(gen_batch_prefill_module("fa2", dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False))
    return specs


def jit_cache_dir() -> str:
    return str(jit_env.FLASHINFER_JIT_DIR)
