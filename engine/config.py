"""Engine settings: one validated dataclass shared by the engine, the CLI and the Serve deployments."""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")  # = kernels.attention.kv_cache.KV_CACHE_DTYPES (no torch here)
LM_HEAD_DTYPES = ("auto", "fp8_e4m3")
DENSE_DTYPES = ("auto", "fp8_e4m3")
DECODE_FRONTS = ("auto", "triton", "cuda")
ALL_REDUCES = ("auto", "nccl", "symm_mem")
DEFAULT_CPU_KV_BYTES = 256 * 2**20


class EngineConfigError(ValueError):
    """An engine setting is out of range or inconsistent with another; the message names the field."""


def segments_rows_problem(rows) -> str | None:
    """What is wrong with a moe_segments_max_rows value (EngineConfig, build_model), or None."""
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= 128):
        return f"moe_segments_max_rows must be None or an integer in [0, 128], got {rows!r}"
    return None


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV page
    max_num_seqs: int = 64  # sequences in one batch (decode batch size)
    max_num_batched_tokens: int = 2048  # new tokens in one forward: the chunked-prefill budget
    max_model_len: int | None = None  # prompt + output tokens; None: the model's max_position_embeddings
    # KV memory for both page pools. None: 256 MiB on CPU; on CUDA `gpu_memory_fraction` of the memory
    # still free once the weights are loaded.
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.9
    # Explicit pool sizes (tests, benchmarks) replace the byte budget; give both or neither.
    num_full_pages: int | None = None
    num_sliding_pages: int | None = None
    device: str = "cpu"
    dtype: str = "auto"  # weights and KV cache; auto: the checkpoint's dtype
    # K/V storage: "auto" = the weights' dtype; "fp8_e4m3" halves KV memory and decode attention bytes
    # (kernels/attention/kv_cache.py says what it costs in accuracy). Any TP/EP split: the ranks move K/V
    # hand-offs as bytes (engine/distributed/wire.flatten_kv).
    kv_cache_dtype: str = "auto"
    # Unembedding weights: "auto" = the checkpoint's (bf16: the model matches the reference); "fp8_e4m3"
    # rounds them at load to 128x128-block FP8, weight-only (kernels/layers/fp8_linear.py): half the bytes
    # of the largest single read of a decode step, faster at <= 32 sequences, slower above 64.
    lm_head_dtype: str = "auto"
    # QKV and O weights: "auto" = the checkpoint's (bf16); "fp8_e4m3" rounds them at load to 128x128-block FP8
    # and, in steps of more than 64 tokens (prompts), quantizes their inputs per token per 128 channels for
    # DeepGEMM's FP8 GEMM (kernels/layers/fp8_linear.py): faster prefill (their GEMMs are ~2x cuBLAS bf16's
    # rate), decode steps of <= 64 tokens weight-only (batch-1 decode steps 1.14x on the H200: the slab GEMV at 1-2
    # tokens, kernels/layers/slab_gemv_triton.py). A request's numerics then depend on its step's size.
    dense_dtype: str = "auto"
    # Decode steps of at most this many tokens compute the experts from the checkpoint's MXFP4 weights (the
    # CUDA MXFP4 decode GEMM, kernels/moe/mxfp4_decode_layer.py) instead of their FP8 conversion; 0: never.
    # Costs a second copy of the experts (~10 GB for 20b; 120b does not fit one GPU with both) and needs
    # MXFP4 experts (an original checkpoint, or random weights), the FP8 MoE and CUDA. 20b steps on the H200:
    # 1.02-1.07x at batch 1-8, 0.73x at 16 (kernels/moe/NOTES.md): 8 is the useful value. Activations stay bf16
    # there instead of FP8 (the MoE output 50x closer to the bf16 reference's).
    mxfp4_decode_max_tokens: int = 0
    # The MoE front of single-token decode steps (router GEMV, top-k, plan, the token's FP8 row): "triton" (one
    # Triton launch, kernels/moe/decode_front_triton.py), "cuda" (one 8-CTA cluster, kernels/moe/
    # decode_front_cuda.py: built with nvcc while the weights load, 30 s unless prebuilt, scripts/
    # prebuild_cuda_kernels.py), "auto": cuda for routers of >= 128 experts on SM90+ with the FP8 MoE (120b batch-1
    # steps 1.02x on the H200; 20b's 32 experts 0.99x), Triton when the build fails (logged).
    decode_front: str = "auto"
    # Steps of more than 64 tokens whose experts average at most this many rows (pairs / local experts) run the
    # weight-streaming segments GEMM instead of DeepGEMM's contiguous grouped GEMM (kernels/moe/NOTES.md, "Weight-
    # streaming GEMMs over contiguous segments"): 120b steps of 65-512 tokens, 20b's of 65-128 at 16. None: the
    # kernel's default (Fp8Experts.segments_max_rows, 16); 0: never. Measured slower from ~32-64 rows on.
    moe_segments_max_rows: int | None = None
    seed: int = 0  # draws the seeds of requests that bring none, so a whole run is reproducible
    # Kernels (engine/model_factory.py): auto = GPU kernels on CUDA, the pure-torch twins on CPU.
    attention_backend: str = "auto"  # "auto" | "torch" | "flashinfer"
    moe_backend: str = "auto"  # "auto" | "torch" | "fp8"
    cuda_graphs: bool = False  # capture decode steps at batch buckets up to max_num_seqs (CUDA only)
    # Prefill and mixed steps of up to max_num_batched_tokens as piecewise CUDA graphs at token buckets,
    # attention eager between them (engine/prefill_graphs.py). None: on with cuda_graphs, on every rank of a
    # TP/EP split too (each captures the same buckets; 20b TP2/EP2 on 2x H200: 4k prefill 53.1 -> 45.9 ms).
    prefill_graphs: bool | None = None
    # CUDA: compile the Triton kernels a shipped manifest lists for this model and split (engine/triton_precompile.py)
    # in worker processes while the weights load, so graph capture finds them in Triton's cache. 20b over an
    # empty cache on the H200: engine build 54.6 s compiling 105 kernels one at a time, 11.9 s with them
    # (and their launchers) precompiled on 16 cores. No effect on the CPU, where no manifest matches, or once the cache holds them.
    triton_precompile: bool = True
    # Lookahead (engine/llm_engine.py): schedule and launch the next step before reading this one's
    # tokens. None: on with one CUDA rank; off on CPU (it only hides host time behind a GPU) and, until
    # measured on several GPUs, with several ranks (True turns it on there).
    async_decode: bool | None = None
    # One model instance over tp/ep ranks, one process and one device each (engine/distributed/); tp and
    # ep are each 1 or the world size. Ranks > 0 use the devices after `device` (cuda:1, cuda:2, ...).
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1  # data-parallel attention: not implemented, see engine/distributed/README.md
    # The ranks' sums (O projection, experts, embedding): "nccl" (torch.distributed), or "symm_mem": a
    # one-shot all-reduce over symmetric memory for tensors up to 256 KiB (decode), NCCL above
    # (kernels/comm/symm_all_reduce.py; CUDA only). "auto": symm_mem where every rank's process sees all
    # the group's GPUs with peer access (else, or if it cannot be set up, NCCL). 120b TP2/EP2 on 2x H200:
    # the step's 73 sums 1,124 -> 696 us, batch-1 decode 176 -> 193 tok/s, same tokens (2026-11-30).
    all_reduce: str = "auto"
    # Reuse the K/V of cached prompt prefixes (whole blocks; engine/block_manager.py). The K/V and (fp32)
    # tokens are the same as without (tests/engine/test_prefix_cache.py); on the GPU the K/V within bf16
    # noise (tests/engine/test_e2e_gpu.py); 20b, 16 requests sharing 2k tokens: TTFT 64.9 -> 30.1 ms.
    enable_prefix_caching: bool = True
    # The prefix cache's host tier (engine/host_kv_tier.py): bytes of host memory per rank for copies of the
    # cached prompt blocks the GPU pools evict, copied back into pages when a later prompt shares them instead of
    # computed again (0: off; needs enable_prefix_caching). Pinned memory on CUDA, allocated at start.
    host_kv_cache_bytes: int = 0
    # Speculative decoding from text the request holds (engine/speculative.py): drafts of up to
    # `speculative_tokens` tokens (0: off) from a request's predicted output (SamplingParams.prediction) and,
    # with `speculative_ngram`, from its own prompt and output (prompt lookup), verified in the decode step
    # while at most `speculative_max_seqs` sequences run. The tokens are the same as without.
    speculative_tokens: int = 4
    speculative_ngram: bool = False
    speculative_max_seqs: int = 8
    # Jump-forward decoding for structured output: where a request's constraint forces its next tokens (each
    # mask allows one id: JSON punctuation, the keys a schema fixes), up to this many of them run as a draft
    # of the decode step, all accepted (0: off; any batch size). The tokens are the same as without (in fp32; in
    # bf16 up to the rounding of another batch shape, as for speculative decoding).
    jump_forward_tokens: int = 8
    # Priority scheduling (GenerateRequest.priority): None orders by priority, then arrival (a steady stream of
    # better-priority requests can hold a worse one back forever); a number of seconds makes one priority step
    # worth that much waiting (engine/scheduler.py), so every request is eventually admitted.
    priority_aging_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name))
        aging = self.priority_aging_s
        if aging is not None and (isinstance(aging, bool) or not isinstance(aging, (int, float)) or not aging > 0
                                  or aging == float("inf")):
            raise EngineConfigError(f"priority_aging_s must be a positive number of seconds or None, got {aging!r}")
        for name in ("max_model_len", "kv_cache_bytes"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("num_full_pages", "num_sliding_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise EngineConfigError(f"{name} must be a non-negative integer, got {value!r}")
        host = self.host_kv_cache_bytes
        if not isinstance(host, int) or isinstance(host, bool) or host < 0:
            raise EngineConfigError(f"host_kv_cache_bytes must be a non-negative integer, got {host!r}")
        if host and not self.enable_prefix_caching:
            raise EngineConfigError("host_kv_cache_bytes needs enable_prefix_caching: the host tier keeps cached "
                                    "prompt blocks")
        if (self.num_full_pages is None) != (self.num_sliding_pages is None):
            raise EngineConfigError("give both num_full_pages and num_sliding_pages, or neither (then "
                                    "kv_cache_bytes sizes the pools)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): a full decode batch needs one token per sequence")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise EngineConfigError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            raise EngineConfigError(f"lm_head_dtype must be one of {LM_HEAD_DTYPES}, "
                                    f"got {self.lm_head_dtype!r}")
        if not isinstance(self.mxfp4_decode_max_tokens, int) or isinstance(self.mxfp4_decode_max_tokens, bool) \
                or not 0 <= self.mxfp4_decode_max_tokens <= 16:
            raise EngineConfigError(f"mxfp4_decode_max_tokens must be an integer in [0, 16], "
                                    f"got {self.mxfp4_decode_max_tokens!r}")
        if self.dense_dtype not in DENSE_DTYPES:
            raise EngineConfigError(f"dense_dtype must be one of {DENSE_DTYPES}, got {self.dense_dtype!r}")
        if self.decode_front not in DECODE_FRONTS:
            raise EngineConfigError(f"decode_front must be one of {DECODE_FRONTS}, got {self.decode_front!r}")
        if problem := segments_rows_problem(self.moe_segments_max_rows):
            raise EngineConfigError(problem)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise EngineConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.decode_front == "cuda" and (not self.device.startswith("cuda") or self.moe_backend == "torch"):
            raise EngineConfigError("decode_front='cuda' runs a CUDA kernel of the FP8 MoE: it needs device 'cuda' or "
                                    f"'cuda:N' and moe_backend 'auto' or 'fp8'; got device {self.device!r}, moe_backend "
                                    f"{self.moe_backend!r}")
        if self.mxfp4_decode_max_tokens and (not self.device.startswith("cuda") or self.moe_backend == "torch"):
            raise EngineConfigError("mxfp4_decode_max_tokens > 0 needs device 'cuda' or 'cuda:N' and the FP8 MoE "
                                    f"(moe_backend 'auto' or 'fp8'); got device {self.device!r}, moe_backend "
                                    f"{self.moe_backend!r}")
        for name, allowed in (("attention_backend", ("auto", "torch", "flashinfer")),
                              ("moe_backend", ("auto", "torch", "fp8"))):
            if getattr(self, name) not in allowed:
                raise EngineConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise EngineConfigError("cuda_graphs=True needs device 'cuda' or 'cuda:N'")
        if self.prefill_graphs not in (None, True, False):
            raise EngineConfigError(f"prefill_graphs must be true, false or null (auto), got {self.prefill_graphs!r}")
        if self.prefill_graphs and not self.device.startswith("cuda"):
            raise EngineConfigError("prefill_graphs=True needs device 'cuda' or 'cuda:N'")
        if self.async_decode not in (None, True, False):
            raise EngineConfigError(f"async_decode must be true, false or null (auto), got {self.async_decode!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise EngineConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("tp_size", "ep_size", "dp_size", "speculative_max_seqs"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.speculative_tokens, int) or isinstance(self.speculative_tokens, bool) \
                or not 0 <= self.speculative_tokens <= 16:
            raise EngineConfigError(f"speculative_tokens must be an integer in [0, 16], got {self.speculative_tokens!r}")
        if not isinstance(self.jump_forward_tokens, int) or isinstance(self.jump_forward_tokens, bool) \
                or not 0 <= self.jump_forward_tokens <= 16:
            raise EngineConfigError(f"jump_forward_tokens must be an integer in [0, 16], got {self.jump_forward_tokens!r}")
        if self.speculative_ngram not in (True, False):
            raise EngineConfigError(f"speculative_ngram must be true or false, got {self.speculative_ngram!r}")
        if self.tp_size not in (1, self.world_size) or self.ep_size not in (1, self.world_size):
            raise EngineConfigError(f"tp_size={self.tp_size} and ep_size={self.ep_size} must each be 1 or the "
                                    f"number of ranks {self.world_size}: TP and EP run over the same ranks")
        if self.all_reduce not in ALL_REDUCES:
            raise EngineConfigError(f"all_reduce must be one of {ALL_REDUCES}, got {self.all_reduce!r}")
        if self.all_reduce == "symm_mem" and not self.device.startswith("cuda"):
            raise EngineConfigError("all_reduce='symm_mem' needs CUDA devices (device 'cuda' or 'cuda:N'); "
                                    "use 'nccl' (gloo on CPU)")
        if self.dp_size != 1:
            raise EngineConfigError(
                f"dp_size={self.dp_size}: data-parallel attention is not implemented; use dp_size=1 and run "
                f"{self.dp_size} engines (Serve replicas) for data parallelism")

    @property
    def uses_prefill_graphs(self) -> bool:
        """prefill_graphs resolved: explicit, else on with decode graphs."""
        if self.prefill_graphs is not None:
            return self.prefill_graphs
        return self.cuda_graphs

    @property
    def world_size(self) -> int:
        """Ranks (processes, devices) of one model instance."""
        return max(self.tp_size, self.ep_size)


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
