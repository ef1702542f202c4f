"""Settings of the Serve application: one pydantic model, read from a Serve YAML or `serve run` arguments.

Three ways to set a field, all validated by the same model:

- Serve YAML (`import_path: serve_app:app`): `args:` is a nested mapping,
  e.g. `args: {model: /ckpt/gpt-oss-120b, decode: {autoscaling: {max_replicas: 4}}}`.
- `serve run serve_app:app key=value ...`: every value arrives as a string. Nested fields take dotted
  keys (`decode.autoscaling.max_replicas=4`) or a JSON object for the whole sub-model
  (`decode='{"autoscaling": {"max_replicas": 4}}'`); JSON scalars and lists work too (`tp_size=4`,
  `prefill.resources_per_worker='{"H200": 1}'`). Both forms can be mixed; dotted keys win.
- Python: `ServeAppConfig(model=..., decode=DeploymentSettings(...))`.

Combinations are checked here rather than deep inside a replica: TP/EP/DP against the model's heads and
experts (through model/parallel.py), GPU-direct KV transport against the device, Serve's own
autoscaling rules. A replica failing these would otherwise crash-loop until Serve gives up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app.config_args import ServeConfigError, deep_merge, nest_args
from serve_app.deployment_settings import (
    DeploymentSettings,
    IngressSettings,
    _Settings,
    default_decode,
    default_ingress_autoscaling,
    default_prefill,
)

GIB = 2**30
RANDOM_PREFIX = "random:"  # model: random:<shape name> (ServeAppConfig.model)


class ServeAppConfig(_Settings):
    """Everything `serve run serve_app:app` accepts. Defaults: the embedded tiny model on this machine."""

    # ---- the model -------------------------------------------------------------------------------
    model: str | None = Field(
        None, description="HF-layout checkpoint folder (config.json + safetensors). None: the embedded tiny "
                          "random model, created on first use under $GPTOSS_CACHE_DIR or ~/.cache/gptoss. "
                          "`random:gpt-oss-20b` / `random:gpt-oss-120b` / `random:tiny`: random weights of "
                          "those shapes drawn on each replica's device from `seed` (every replica draws the same "
                          "model), for benchmarking the deployment where no checkpoint is at hand; the tokens "
                          "are meaningless.")
    served_model_name: str = Field(
        "gpt-oss", min_length=1, description="The name clients pass as `model` in API requests.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where replicas run the model. auto: cuda when the Ray cluster (or, before Ray "
                            "starts, this machine) has GPUs, else cpu. Set cuda explicitly on clusters "
                            "whose GPU nodes autoscale from zero.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights and KV cache dtype; auto: the checkpoint's.")
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3"] = Field(
        "auto", description="K/V storage; auto: the weights' dtype. fp8_e4m3 holds twice the tokens and halves "
                            "the bytes decode attention reads, at ~1e-2 relative change of attention outputs.")
    lm_head_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="Unembedding weights; auto: the checkpoint's (the model matches the reference). "
                            "fp8_e4m3 rounds them at load to 128x128-block FP8 (weight-only): 1.03-1.05x faster decode "
                            "steps at batch 1-4, even at 32, slower above 64; logits within the FP8 rounding.")
    dense_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="QKV and O weights; auto: the checkpoint's (the model matches the reference). fp8_e4m3 "
                            "rounds them at load to 128x128-block FP8 and runs steps of more than 64 tokens (prompts) "
                            "on FP8 activations through DeepGEMM's FP8 GEMM: faster prefill; decode steps of <= 64 "
                            "tokens weight-only (batch-1 decode steps 1.14x on the H200). A request's numerics then "
                            "depend on its step's size.")
    mxfp4_decode_max_tokens: int = Field(
        0, ge=0, le=16, description="Decode steps of at most this many tokens compute the experts from the "
                                    "checkpoint's MXFP4 weights (CUDA MXFP4 GEMM) instead of their FP8 conversion; "
                                    "0: never. Keeps both copies of the experts (~10 GB more for 20b; 120b does not "
                                    "fit one GPU so); needs an original MXFP4 checkpoint. Decode replicas only (and replicas running "
                                    "both phases); ignored on CPU replicas.")
    decode_front: Literal["auto", "triton", "cuda"] = Field(
        "auto", description="The MoE front of single-token decode steps (router, top-k, plan, FP8 row). cuda: one "
                            "8-CTA cluster (built with nvcc while the weights load, 85 s unless the node prebuilt it: "
                            "cluster.yaml); triton: one Triton launch; auto: cuda for routers of >= 128 experts (120b: "
                            "batch-1 steps 1.02x on the H200) on GPU replicas, Triton when the build fails.")
    moe_segments_max_rows: int | None = Field(
        None, ge=0, le=128, description="Steps of more than 64 tokens whose experts average at most this many rows run "
                                        "the weight-streaming segments GEMM instead of DeepGEMM's grouped GEMM (120b "
                                        "steps of 65-512 tokens, 20b's of 65-128); None: the kernel's default (16); 0: "
                                        "never. GPU replicas; ignored on CPU replicas.")
    all_reduce: Literal["auto", "nccl", "symm_mem"] = Field(
        "auto", description="The ranks' sums in a TP/EP replica; symm_mem: a one-shot all-reduce over symmetric "
                            "memory for decode-sized tensors (<= 256 KiB), NCCL above; auto: symm_mem where every "
                            "rank sees all the replica's GPUs with peer access (CUDA IPC transport's "
                            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), else NCCL. 120b TP2/EP2, 2x H200: "
                            "batch-1 decode 176 -> 193 tok/s, same tokens.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks per model instance (splits heads, vocab).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel ranks per model instance (splits experts).")
    dp_size: int = Field(
        1, ge=1, description="Model instances per replica; a replica holds dp_size * max(tp_size, ep_size) GPUs.")
    # ---- the engine ------------------------------------------------------------------------------
    max_context: int | None = Field(
        None, ge=1, description="Prompt + output tokens per request; None: the model's max_position_embeddings.")
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV page pools' memory per replica (both pools). None: 256 MiB on CPU; on CUDA "
                                "gpu_memory_fraction of what is free after loading weights.")
    gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of free GPU memory the KV pools take when kv_cache_memory_gib is None.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV page.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences a decode step batches together.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="New tokens in one forward pass: the chunked-prefill budget.")
    seed: int = Field(0, ge=0, description="Seeds requests that bring none, so a run is reproducible.")
    cuda_graphs: bool = Field(
        True, description="Replay decode steps as CUDA graphs at batch buckets up to max_num_seqs. Applies to "
                          "GPU replicas (every rank of a TP/EP replica captures the same graphs); CPU replicas run eagerly.")
    prefill_graphs: bool = Field(
        True, description="Run prefill and mixed steps as piecewise CUDA graphs at token buckets up to "
                          "max_num_batched_tokens, attention eager between them (engine/prefill_graphs.py), with "
                          "cuda_graphs on GPU replicas (every rank of a TP/EP replica). 20b on an H200: 1k-token "
                          "TTFT 39.8 -> 16.2 ms through the engine; TP2/EP2 on 2 H200s: 4k prefill 53.1 -> 45.9 ms.")
    triton_precompile: bool = Field(
        True, description="GPU replicas: compile the Triton kernels a shipped manifest lists for this model and "
                          "split in worker processes while the weights load, so graph capture loads them from "
                          "Triton's cache (engine/triton_precompile.py). Matters on a node whose cache is empty.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the K/V of prompt prefixes already computed (whole pages: shared system "
                          "prompts, earlier turns of a chat). 20b on an H200, 16 requests sharing 2k tokens: "
                          "TTFT 64.9 -> 30.1 ms mean. Tokens as without, up to bf16 rounding on GPUs.")
    host_kv_cache_gib: float = Field(
        0, ge=0, description="The prefix cache's host tier, per GPU (rank) of a replica: host memory holding the "
                             "cached prompt blocks the GPU evicts (in the replicas that run prompts: prefill, or decode "
                             "when not disaggregated), copied back over PCIe when a later prompt shares "
                             "them instead of computed again (engine/host_kv_tier.py; pinned on GPUs; reserved from "
                             "Ray's `memory` resource with the replica's bundles). 0: off. Needs "
                             "enable_prefix_caching.")
    speculative_tokens: int = Field(
        4, ge=0, le=16, description="Speculative decoding from text the request holds (engine/speculative.py): "
                                    "draft tokens per step at most; 0 turns it off. Drafts come from a chat request's "
                                    "`prediction` (OpenAI's Predicted Outputs) and, with speculative_ngram, from the "
                                    "request's own prompt and output. Same tokens as without, up to bf16 rounding. "
                                    "20b on an H200, batch 1, every draft right: 468 -> 696 tok/s at 2 drafts.")
    speculative_ngram: bool = Field(
        False, description="Draft from the request's own tokens too (prompt lookup): pays where answers copy "
                           "their prompt (code edits, quoting); a step without the lookahead costs ~20% where "
                           "nothing is found.")
    speculative_max_seqs: int = Field(
        8, ge=1, description="Speculate only while at most this many sequences decode on a replica.")
    jump_forward_tokens: int = Field(
        8, ge=0, le=16, description="Structured output: tokens the grammar forces (JSON punctuation, a schema's "
                                    "fixed keys) run as drafts of the decode step, up to this many; 0 turns it off. "
                                    "Same tokens as without, up to bf16 rounding.")
    prefix_routing: bool = Field(
        True, description="With prefix caching: route a prompt to the replica that ran its longest known "
                          "prefix while that replica's queue is within 4 of the shortest (serve_app/prefix_router.py; "
                          "the prefill deployment, or decode when not disaggregated), else power of two choices; "
                          "disaggregated with prefill_same_node, the decode deployment too (within 16), so a "
                          "conversation's next turn returns to the node holding its history.")
    prefill_same_node: bool = Field(
        True, description="Disaggregated: a decode replica sends its prompts to a prefill replica on its own node "
                          "while one there is within 4 requests of the least busy (the ones holding the prompt's "
                          "prefix first), so the K/V comes back over CUDA IPC or the node's shared memory instead "
                          "of the network (serve_app/prefix_router.py). Serve's default router does not prefer the "
                          "caller's node for calls between deployments.")
    async_decode: bool = Field(
        True, description="Lookahead: schedule and launch the next engine step before reading this one's "
                          "tokens, so the host's step work overlaps the GPU. GPU replicas, TP/EP ones included "
                          "(120b TP2/EP2 on 2x H200: batch-1 decode 196 -> 328 tok/s, same tokens).")
    stream_coalescing: bool = Field(
        True, description="A request's tokens that queue up while its replica is busy leave in one message "
                          "(Ray streaming item, SSE chunk) instead of one per engine step: fewer messages per "
                          "token under load, the same tokens (bench.serve_load; bench/RESULTS.md, The Serve app on GPUs).")
    stream_items_per_s: float = Field(
        2000.0, ge=0, description="Deltas per second a decode replica's streams may send together (0: no limit). "
                                  "With N streams sending, a stream's tokens leave at most every N / this many seconds "
                                  "(the first at once), several per Ray streaming item under load: each item costs "
                                  "the replica's process a fixed ~0.1-0.4 ms of CPU, and past ~2,000 items/s (this "
                                  "project's CPU machine) they queued in Ray, the tokens reaching the ingress seconds "
                                  "late. Tokens/s through Serve at 512 streams of a paced engine making 19.6-19.8k: "
                                  "2.4k -> 15.1k (default data plane), 9.5k -> 19.3k (RAY_SERVE_THROUGHPUT_OPTIMIZED); "
                                  "at 64-256 streams 1.4-3.9x and 0.98-1.4x (bench.serve_stream_capacity).")
    warm_up: bool = Field(
        True, description="Before a replica takes traffic, run four short requests through its engine (a prompt, a "
                          "prefix-cache hit in a mixed step, the sampler's paths, drafts; engine/warm_up.py), so the "
                          "first user requests do not compile kernels (20b on an H200: first 1k-token TTFT 1,189 -> "
                          "23 ms); its counters are then reset.")
    priority_aging_s: float | None = Field(
        30.0, gt=0, description="With ingress.allow_priority: one priority step is worth this many seconds of "
                                "waiting in the engines' queues, so a request is passed only by better-priority "
                                "ones that arrive within that many seconds (x the difference) after it, and never "
                                "starves; null: strict priority (vLLM's).")
    max_failed_steps: int = Field(
        3, ge=0, description="Engine steps failing in a row after which a replica reports itself unhealthy, so "
                             "Serve replaces it (engine/health.py; a device error or a dead rank does so at once); "
                             "0: never by count.")
    step_timeout_s: float | None = Field(
        300.0, gt=0, description="An engine step running longer than this (a hung kernel or collective) makes "
                                 "the replica unhealthy; null: never.")
    # ---- disaggregation and KV transfer --------------------------------------------------------
    disaggregated: bool = Field(
        True, description="Run prompts on the prefill deployment and move their KV to decode: decode steps "
                          "never wait behind a prompt chunk. False: no prefill deployment; decode replicas run "
                          "prompts themselves (more tokens per GPU, longer token gaps under prompt bursts: "
                          "bench/RESULTS.md, bench.disaggregated_load).")
    kv_transport: Literal["auto", "object_store", "cuda_ipc"] = Field(
        "auto", description="How KV moves prefill -> decode. object_store: Ray's object store (host memory, "
                            "any node). cuda_ipc: GPU memory mapped between processes of one node, falling "
                            "back to the object store across nodes. auto: cuda_ipc on cuda, else object_store.")
    cuda_ipc_buffer_gib: float = Field(
        2.0, gt=0, description="GPU memory each decode replica sets aside to receive K/V over CUDA IPC; a "
                               "transfer that finds no room there goes through the object store.")
    prefill_timeout_s: float = Field(
        120.0, gt=0, description="Longest wait for a prefill replica's answer (queueing included); past it "
                                 "decode runs the prompt itself.")
    kv_transfer_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait to receive one request's KV; past it decode runs the prompt itself.")
    local_prefill_max_tokens: int = Field(
        512, ge=0, description="Disaggregated, with prefix caching: a prompt that continues an output this decode "
                               "replica generated (its cached prefix here runs into that output's blocks: a "
                               "conversation's next turn after a tool call, a stream taken up elsewhere) and has at "
                               "most this many tokens past what is cached here runs here instead of on prefill, "
                               "which never saw that output and would compute it again and send all of the K/V "
                               "back. A prompt that shares only a prompt (a system prompt) goes to prefill as "
                               "before. 0: always prefill remotely. Not yet measured on a GPU.")
    # ---- deployments -----------------------------------------------------------------------------
    ingress: IngressSettings = Field(default_factory=IngressSettings, description="HTTP ingress options.")
    prefill: DeploymentSettings = Field(default_factory=default_prefill, description="Prefill deployment options.")
    decode: DeploymentSettings = Field(default_factory=default_decode, description="Decode deployment options.")

    @field_validator("model")
    @classmethod
    def _absolute_model_path(cls, value: str | None) -> str | None:
        # Replicas run with another working directory: pin a relative path to where the app was built.
        if value is None or value.strip().lower() in ("", "none", "null", "tiny"):
            return None
        if value.startswith(RANDOM_PREFIX):
            random_model_config(value)  # an unknown shape name fails here, not in a replica
            return value
        return os.path.abspath(os.path.expanduser(value))

    @model_validator(mode="after")
    def _check_combinations(self) -> "ServeAppConfig":
        if self.kv_transport == "cuda_ipc" and self.device == "cpu":
            raise ValueError("kv_transport=cuda_ipc needs device=cuda (or auto on a GPU cluster); "
                             "use kv_transport=object_store on CPU")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): a full decode batch needs one token per sequence")
        if self.random_model is not None and self.random_model != "tiny" and self.device == "cpu":
            raise ValueError(f"model {self.model} draws full-size weights: it needs device=cuda (on CPU use "
                             f"{RANDOM_PREFIX}tiny or a checkpoint)")
        if self.world_size > 1 and self.device == "cpu":
            raise ValueError(f"tp_size={self.tp_size}, ep_size={self.ep_size} needs device=cuda: the CPU path "
                             "runs one rank in the replica's process")
        if self.host_kv_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_gib needs enable_prefix_caching: the host tier keeps cached prompt blocks")
        self._check_against_model()
        return self

    def _check_against_model(self) -> None:
        """TP/EP must divide the model's heads, KV heads, vocabulary and experts; max_context must fit it."""
        model_config = self.model_config_if_readable()
        if model_config is None:
            return  # a checkpoint only the GPU nodes can see: the replica checks when it loads
        from model.parallel import Parallel, ParallelConfigError

        try:
            Parallel(tp_size=self.tp_size, ep_size=self.ep_size).validate(
                model_config.num_attention_heads, model_config.num_key_value_heads,
                model_config.num_local_experts, model_config.vocab_size)
        except ParallelConfigError as err:
            raise ValueError(f"tp_size/ep_size do not fit the model {self.model or '(tiny)'}: {err}") from None
        if self.max_context is not None and self.max_context > model_config.max_position_embeddings:
            raise ValueError(f"max_context ({self.max_context}) exceeds the model's max_position_embeddings "
                             f"({model_config.max_position_embeddings})")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of one model instance."""
        return max(self.tp_size, self.ep_size)

    @property
    def gpus_per_replica(self) -> int:
        return self.dp_size * self.world_size

    @property
    def random_model(self) -> str | None:
        """The shape name of a `random:<name>` model, else None."""
        return self.model.removeprefix(RANDOM_PREFIX) if self.model and self.model.startswith(RANDOM_PREFIX) else None

    def model_config_if_readable(self):
        """The model's GptOssConfig, or None when `model` names a folder this machine cannot read."""
        from model.config import ConfigError, GptOssConfig

        if self.model is None:
            return tiny_model_config()
        if self.random_model is not None:
            return random_model_config(self.model)
        path = Path(self.model) / "config.json"
        if not path.is_file():
            return None
        try:
            return GptOssConfig.from_json(path)
        except ConfigError as err:
            raise ValueError(f"model {self.model}: {err}") from None

    def resolved_device(self) -> str:
        """cpu or cuda: `device`, with auto decided by the GPUs Ray (or this machine) has."""
        if self.device != "auto":
            return self.device
        return "cuda" if _gpus_visible() else "cpu"

    def resolved_transport(self, device: str) -> str:
        if self.kv_transport != "auto":
            return self.kv_transport
        return "cuda_ipc" if device == "cuda" else "object_store"

    def health_policy(self):
        """When a replica's engine counts as unable to serve (engine/health.py)."""
        from engine.health import HealthPolicy

        return HealthPolicy(max_failed_steps=self.max_failed_steps, step_timeout_s=self.step_timeout_s)

    def role_of(self, settings) -> str:
        """"prefill" or "decode": the deployment whose settings these are."""
        return "prefill" if settings is self.prefill else "decode"

    def host_kv_bytes(self, role: str) -> int:
        """The host tier of a `role` replica's ranks: only where prompts run (prefill; decode when not
        disaggregated). A disaggregated decode replica imports its K/V and never looks its prompts up in the
        prefix cache, so a host tier there would copy out evicted blocks nobody asks for."""
        runs_prompts = role == "prefill" or not self.disaggregated
        return int(self.host_kv_cache_gib * GIB) if runs_prompts else 0

    def engine_config(self, device: str, role: str = "decode"):
        """The engine's EngineConfig for one replica of `role` ("prefill" or "decode") on `device` ("cpu" or
        "cuda[:N]")."""
        from engine.config import EngineConfig

        mxfp4 = self.mxfp4_decode_max_tokens if device != "cpu" else 0
        if role == "prefill" and self.random_model is None:
            # The prefill deployment runs prompts: the MXFP4 copy of the experts (~10 GB for 20b) would sit unused.
            # Random weights keep it: they are drawn as MXFP4 then, and both deployments must draw one model.
            mxfp4 = 0

        return EngineConfig(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_context,
            kv_cache_bytes=None if self.kv_cache_memory_gib is None else int(self.kv_cache_memory_gib * GIB),
            gpu_memory_fraction=self.gpu_memory_fraction,
            device=device,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            lm_head_dtype=self.lm_head_dtype,
            dense_dtype=self.dense_dtype,
            mxfp4_decode_max_tokens=mxfp4,
            decode_front=self.decode_front if device != "cpu" else "auto",
            moe_segments_max_rows=self.moe_segments_max_rows if device != "cpu" else None,
            all_reduce=self.all_reduce if device != "cpu" else "nccl",  # auto resolves per rank (worker.py)
            seed=self.seed,
            cuda_graphs=self.cuda_graphs and device != "cpu",
            # auto (None) turns them on with cuda_graphs; False keeps them off
            prefill_graphs=None if self.prefill_graphs and device != "cpu" else False,
            triton_precompile=self.triton_precompile,
            async_decode=self.async_decode and device != "cpu",
            enable_prefix_caching=self.enable_prefix_caching,
            host_kv_cache_bytes=self.host_kv_bytes(role),
            speculative_tokens=self.speculative_tokens,
            speculative_ngram=self.speculative_ngram,
            speculative_max_seqs=self.speculative_max_seqs,
            jump_forward_tokens=self.jump_forward_tokens,
            priority_aging_s=self.priority_aging_s,
            tp_size=self.tp_size,
            ep_size=self.ep_size,
        )

    # ---- parsing ---------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: "dict[str, Any] | ServeAppConfig | None") -> "ServeAppConfig":
        """Parse Serve application arguments: a nested mapping (YAML), flat `key=value` strings from
        `serve run` (dotted keys for nested fields, JSON for non-strings), or an existing config."""
        if isinstance(args, ServeAppConfig):
            return args
        # Partial sub-settings (`decode.autoscaling.max_replicas=4`) keep the deployment's other defaults.
        defaults = {"prefill": default_prefill().model_dump(), "decode": default_decode().model_dump(),
                    "ingress": {"autoscaling": default_ingress_autoscaling().model_dump()}}
        nested = deep_merge(defaults, nest_args(args or {}))
        try:
            return cls.model_validate(nested)
        except ValidationError as err:
            raise ServeConfigError(_explain(err)) from None


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(arguments)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown setting; see serve_app/config.py for the accepted keys"
        lines.append(f"{key}: {msg}")
    return "invalid serve_app arguments:\n  " + "\n  ".join(lines)


def random_model_config(model: str):
    """The GptOssConfig of `random:<name>`: a preset (gpt-oss-20b, gpt-oss-120b) or the embedded tiny shapes."""
    from model.config import ConfigError, GptOssConfig
    from model.tiny import tiny_config

    name = model.removeprefix(RANDOM_PREFIX)
    if name == "tiny":
        return tiny_config()
    try:
        return GptOssConfig.preset(name)
    except ConfigError as err:
        raise ValueError(f"model {model!r}: {err} (or tiny)") from None


def tiny_model_path() -> Path:
    """The embedded tiny checkpoint (the `gptoss` CLI's default model), created on first use under
    $GPTOSS_CACHE_DIR or ~/.cache/gptoss; concurrent first uses are safe."""
    from engine.cli import default_model_dir, ensure_tiny_model

    return ensure_tiny_model(default_model_dir())


def tiny_model_config():
    """The tiny model's GptOssConfig, without writing the checkpoint (for validating settings)."""
    from engine.cli import default_model_dir
    from model.loader import read_config
    from model.tiny import tiny_config

    folder = default_model_dir()
    return read_config(folder) if (folder / "config.json").is_file() else tiny_config()


def _gpus_visible() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    # `serve run` builds the app before it starts Ray: look at this machine.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch

    return torch.cuda.is_available()
