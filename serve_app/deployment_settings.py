"""The settings of each deployment of the Serve application: prefill and decode (replicas or autoscaling,
placement, queues, health checks) and the ingress (the OpenAI API's own options). serve_app/config.py's
ServeAppConfig holds one of each; they are validated by the same pydantic rules (unknown keys are errors)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from serve_app.harmony.render_worker import DEFAULT_OFF_LOOP_CHARS, DEFAULT_RENDER_WORKERS


class _Settings(BaseModel):
    # Unknown keys are typos (`max_replica=4`): reject them instead of silently using a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AutoscalingSettings(_Settings):
    """Serve's `autoscaling_config` for one deployment, with defaults for LLM replicas: a replica takes
    minutes to start (weights, KV pools, CUDA graphs) and serves requests that last tens of seconds, so
    scale up after sustained load only and scale down late, never in the middle of a burst."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running, even when idle.")
    max_replicas: int = Field(1, ge=1, description="Most replicas; each holds a whole node's GPUs on a GPU cluster.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas started at deploy time; None: min_replicas.")
    target_ongoing_requests: float | None = Field(
        ..., gt=0, description="In-flight requests per replica the autoscaler aims for (queued + running). None "
                               "(decode's default; prefill and decode only): three quarters of max_num_seqs, 48 at "
                               "the default 64.")
    upscale_delay_s: float = Field(
        60.0, ge=0, description="Load must stay above target this long before a replica is added.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Load must stay below target this long before a replica is removed.")
    metrics_interval_s: float = Field(10.0, gt=0, description="How often replicas report their load.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window over which reported load is averaged.")

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must lie between min_replicas "
                             f"({self.min_replicas}) and max_replicas ({self.max_replicas})")
        return self

    def to_serve(self, target: float | None = None) -> dict[str, Any]:
        """The dict Serve's `autoscaling_config` option takes, checked by Serve's own model; `target` stands for a
        target_ongoing_requests of None."""
        from ray.serve.config import AutoscalingConfig

        out = self.model_dump(exclude_none=True)
        if self.target_ongoing_requests is None:
            if target is None:
                raise ValueError("target_ongoing_requests: this deployment has no default; give a number")
            out["target_ongoing_requests"] = target
        AutoscalingConfig(**out)  # Serve's own rules (raises on what it rejects)
        return out


class DeploymentSettings(_Settings):
    """Per-deployment Serve options for the prefill or the decode deployment."""

    num_replicas: int | None = Field(
        None, ge=1, description="A fixed replica count; None: autoscale with `autoscaling`.")
    autoscaling: AutoscalingSettings = Field(description="Autoscaling policy, used when num_replicas is None.")
    max_ongoing_requests: int | None = Field(
        ..., ge=1, description="Requests one replica accepts at once; more wait in the caller's queue (Serve's, first "
                               "come first served). None (decode's default): twice max_num_seqs, so the engine's "
                               "seats fill and the requests beyond them wait in its own queue, where priority acts.")
    max_queued_requests: int = Field(
        -1, ge=-1, description="Requests that may wait in each caller's queue (Ray Serve's max_queued_requests: "
                               "per ingress replica for decode, per decode replica for prefill); more are refused "
                               "at once. Decode: HTTP 503 `server_overloaded` with Retry-After: 1 (the openai "
                               "client retries it); prefill: the decode replica runs the prompt itself. -1: no "
                               "limit.")
    cpus_per_worker: float | None = Field(
        None, ge=0, description="CPUs reserved per model rank (one rank per GPU; the replica's own process "
                                "is rank 0). None: 1 on cuda, 0.5 on cpu.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per worker bundle, e.g. {'H200': 1} to pin "
                                          "replicas to a node type.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve checks a replica.")
    health_check_timeout_s: float = Field(
        60.0, gt=0, description="A check slower than this marks the replica unhealthy (a long prefill "
                                "step can hold the event loop for seconds).")
    graceful_shutdown_timeout_s: float = Field(
        300.0, ge=0, description="On scale-down or redeploy, how long running streams may finish.")

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_limit(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (no limit) or at least 1")
        return value

    @field_validator("resources_per_worker")
    @classmethod
    def _no_builtin_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for key in ("CPU", "GPU", "memory"):
            if key in value:
                raise ValueError(f"resources_per_worker must not set {key!r}: use cpus_per_worker, and the "
                                 "GPU count follows from tp_size/ep_size/dp_size")
        return value


def default_prefill() -> DeploymentSettings:
    # Prefill requests are short and compute-bound: a replica saturates with a few prompts in flight (the
    # autoscaling target), but it accepts many more and queues them in its engine (first come, first served,
    # batched into its steps). Refused requests wait in the caller's Serve router, which retries after 0, 25,
    # 50, ... 500 ms: with 16 here, 32 concurrent chats on the tiny CPU model had TTFT p50 1,050-1,350 ms
    # against 740-890 ms with 64 (three runs each, 2026-11-30, bench/RESULTS.md, "The Serve app on GPUs").
    return DeploymentSettings(max_ongoing_requests=64, autoscaling=AutoscalingSettings(target_ongoing_requests=4))


def default_decode() -> DeploymentSettings:
    # Decode batches up to max_num_seqs sequences; aim below that so new requests rarely queue (the autoscaling
    # target: three quarters of it, 48 at the default 64). The cap on requests follows max_num_seqs too
    # (builder.deployment_options: twice it, 128 at the default 64): a fixed 128 had held a max_num_seqs=512 replica
    # to 128 sequences, the other requests waiting in Serve's queue (20b on an H100, 256 streams: client TTFT p50
    # 14.1 s against the engine's 0.39 s, bench/RESULTS.md).
    return DeploymentSettings(max_ongoing_requests=None, autoscaling=AutoscalingSettings(target_ongoing_requests=None))


def default_ingress_autoscaling() -> AutoscalingSettings:
    # An ingress replica is CPU-only and starts in seconds, so it can follow load closely; its cost per request
    # is small (~15 us of CPU per streamed token), so one holds hundreds of streams.
    return AutoscalingSettings(max_replicas=8, target_ongoing_requests=256, upscale_delay_s=10, downscale_delay_s=300)


API_KEYS_ENV = "GPTOSS_API_KEYS"  # comma-separated; the default of ingress.api_keys


def api_keys_from_env() -> list[SecretStr]:
    """The keys in $GPTOSS_API_KEYS of the process that builds the app (`serve run`'s, or the cluster's under
    `serve deploy`): comma-separated, blanks around them dropped."""
    return [SecretStr(key.strip()) for key in os.environ.get(API_KEYS_ENV, "").split(",") if key.strip()]


class IngressSettings(_Settings):
    """The HTTP ingress (OpenAI API): CPU-only, torch-free, cheap to replicate."""

    num_replicas: int | None = Field(
        1, ge=1, description="Ingress replicas (each parses Harmony for its requests); None: autoscale with "
                             "`autoscaling` (an ingress replica is CPU-only and starts in seconds).")
    autoscaling: AutoscalingSettings = Field(
        default_factory=default_ingress_autoscaling,
        description="Ingress autoscaling, used when num_replicas is None: in-flight HTTP requests (streams "
                    "included) per replica.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per ingress replica.")
    max_ongoing_requests: int = Field(512, ge=1, description="Concurrent HTTP requests per ingress replica.")
    conversation_start_date: str | None = Field(
        None, pattern=r"^\d{4}-\d{2}-\d{2}$",
        description="YYYY-MM-DD in the Harmony system message. None: today's UTC date at each request (the "
                    "prompt, and so the output, then changes at midnight; pin it for reproducible runs).")
    default_max_tokens: int | None = Field(
        None, ge=1, description="Output tokens of a chat or responses request that sets no limit (max_tokens, "
                                "max_completion_tokens, max_output_tokens); None: the rest of the context, as "
                                "OpenAI's API does. /v1/completions keeps OpenAI's 16.")
    stream_keepalive_s: float | None = Field(
        15.0, gt=0, description="A stream waits this long for its first token (a refusal within it is the HTTP "
                                "status: 400, 503), then starts with HTTP 200 and sends the SSE comment "
                                "`: keep-alive` after each such idle period, so a load balancer's idle timeout "
                                "(AWS ALB: 60 s) does not cut a request waiting in a queue; a later refusal is "
                                "an error event in the stream. None: wait silently for the first token.")
    store_max_responses: int = Field(
        10_000, ge=0, description="Stored /v1/responses (for previous_response_id and GET / DELETE by id), "
                                  "/v1/conversations and chat completions made with store=true together, kept in one "
                                  "ResponseStore replica's memory, least recently used out first; a response with "
                                  "store=false is not kept. 0: no store "
                                  "(the endpoint is stateless, previous_response_id and conversations are refused).")
    store_max_mib: float = Field(512, gt=0, description="Memory the stored responses and conversations may take, "
                                                        "their JSON's size.")
    store_path: str | None = Field(
        None, description="A SQLite file on the head node where the store writes every stored response and "
                          "conversation and reads them back when its replica restarts (a redeploy or a crash then "
                          "forgets nothing; streams of background responses cannot be resumed across it). The "
                          "store's replica is placed on the head node. None: memory only.")
    store_orphan_s: float = Field(
        30.0, gt=0, description="How long the store waits without word from the ingress replica running a background "
                                "response or a batch before it counts that replica dead: the response and the batch are "
                                "then adopted by another replica (a streamed background response goes on there "
                                "from its stored events). Longer than the pauses a busy replica may have (its "
                                "writes come every 0.5-1 s).")
    files_max_mib: float = Field(
        1024, gt=0, description="Memory the /v1/files files may take together in the store's replica (batch inputs, "
                                "and the output and error files batches write); an upload past it is a 400 until "
                                "files are deleted. Kept in the store's file too with store_path.")
    file_max_mib: float = Field(200, gt=0, description="The largest /v1/files upload (a batch's input file).")
    batch_concurrency: int = Field(
        64, ge=1, description="/v1/batches requests in flight at once from one ingress replica, all its running "
                              "batches together (more batches share these slots; they do not add to them).")
    batch_priority: int = Field(
        1, description="Engine priority a batch's requests get on top of their own (lower runs sooner): at 1 they "
                       "run when interactive requests (0) leave room, and are preempted for them.")
    allow_priority: bool = Field(
        False, description="Honour requests' `priority` (vLLM's extension, an integer: lower runs sooner; a waiting "
                           "request of a better priority preempts running ones of worse priority in the engines). "
                           "Off: a non-zero priority is a 400, since any client could put itself first; turn it "
                           "on where the clients are trusted (e.g. behind a gateway that sets it).")
    isolate_prefix_cache: bool = Field(
        False, description="With api_keys: each key's requests reuse only cached prompt blocks of the same key "
                           "(engine prefix caches and prefix routing are salted by the key), so the cache hits a "
                           "client sees in its time to first token tell it nothing of other keys' prompts; a "
                           "system prompt shared across keys is then computed once per key. Off: one shared "
                           "cache (a request's own `cache_salt` still separates it).")
    forced_call_reasoning_tokens: int = Field(
        2048, ge=0, description="A request whose tool_choice forces a call (a named function, 'required', "
                                "allowed_tools in mode 'required') may reason first, as gpt-oss does before any "
                                "call: an analysis message and a preamble, each optional and of at most this many "
                                "tokens (and a quarter of the request's output limit), then the call (held by a grammar: one of the forced functions, its "
                                "arguments JSON, a strict tool's to its schema). 0: the call at once.")
    render_workers: int = Field(
        DEFAULT_RENDER_WORKERS, ge=0,
        description="Processes per ingress replica that tokenize long prompts (render_off_loop_chars or more "
                    "characters of text), so that the replica's event loop, which streams every request's tokens, "
                    "does not stop meanwhile (the Harmony tokenizer holds it 0.6-1 ms per 1,000 tokens: ~0.1 s for a "
                    "128k-token prompt). 0: tokenize on the event loop.")
    render_off_loop_chars: int = Field(
        DEFAULT_OFF_LOOP_CHARS, ge=0,
        description="Prompts with fewer characters of text are tokenized on the event loop (a few ms), where a "
                    "worker's round trip would cost more than it saves.")
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="Origins whose browser pages may call the API (CORS), e.g. "
                                          "https://app.example.com; \"*\" for any. A list or comma-separated text. "
                                          "Empty: no CORS headers (browsers then refuse cross-origin calls).")
    api_keys: list[SecretStr] = Field(
        default_factory=api_keys_from_env,
        description="Keys clients must send on every path but /health (`Authorization: Bearer KEY`, the "
                    "openai client's api_key; else HTTP 401). Empty: no check. A list or comma-separated text; "
                    "default: $GPTOSS_API_KEYS (comma-separated) where the app is built, which keeps the keys out "
                    "of the Serve config the dashboard shows.")

    @field_validator("autoscaling")
    @classmethod
    def _ingress_target(cls, value: AutoscalingSettings) -> AutoscalingSettings:
        if value.target_ongoing_requests is None:
            raise ValueError("target_ongoing_requests: the ingress has no engine to size it from; give a number")
        return value

    @field_validator("api_keys", "cors_allow_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        # `serve run ingress.api_keys=k1,k2`
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for key in keys:
            value = key.get_secret_value()
            if not value or any(c.isspace() or c == "," for c in value) or not value.isprintable():
                raise ValueError("each API key must be a non-empty printable string without spaces or commas")
        return keys

    def api_key_values(self) -> tuple[str, ...]:
        return tuple(key.get_secret_value() for key in self.api_keys)
