"""The Serve application: HarmonyIngress -> DecodeServer -> PrefillServer, each with its own options, and the
ingress' ResponseStore (stored /v1/responses) beside them.

`build_app` is the application builder behind `serve_app:app`, so the same code serves three entry
points: `serve run serve_app:app key=value ...`, a Serve YAML with `import_path: serve_app:app` and
`args:`, and `serve.run(build_app({...}))` in Python. See serve_app/config.py for the arguments.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.config import DeploymentSettings, ServeAppConfig
from serve_app.placement import NOSET_CUDA_VISIBLE_DEVICES, ReplicaResources

INGRESS_NAME = "HarmonyIngress"
RESPONSE_STORE_NAME = "ResponseStore"
DECODE_NAME = "DecodeServer"
PREFILL_NAME = "PrefillServer"


def deployment_options(config: ServeAppConfig, settings: DeploymentSettings, device: str,
                       transport: str, runs_prompts: bool = False) -> dict[str, Any]:
    """Serve options of a prefill or decode deployment: replicas or autoscaling, placement, health checks;
    for the deployment that runs prompts (`runs_prompts`), the prefix-affinity router when configured."""
    # CUDA IPC opens a peer replica's GPU memory, so every GPU of the node must stay visible to torch;
    # each replica then picks its own GPU from Ray's assignment (placement.local_cuda_device).
    env = {NOSET_CUDA_VISIBLE_DEVICES: "1"} if transport == "cuda_ipc" else None
    options = ReplicaResources.of(config, settings, device).deployment_options(env)
    if settings.num_replicas is not None:
        options["num_replicas"] = settings.num_replicas
    else:
        options["autoscaling_config"] = settings.autoscaling.to_serve()
    options.update(
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
    )
    if runs_prompts and config.enable_prefix_caching and config.prefix_routing:
        try:  # Ray Serve's RequestRouter API (alpha; tested with ray 2.60)
            from ray.serve.config import RequestRouterConfig

            from serve_app.prefix_router import PrefixAffinityRouter
        except ImportError as err:
            raise ValueError(f"prefix_routing needs Ray Serve's request router API, which this ray lacks ({err}); "
                             "upgrade ray or set prefix_routing=false") from None
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    return options


def build_app(args: dict[str, Any] | ServeAppConfig | None = None) -> Application:
    from serve_app.decode_server import DecodeServer
    from serve_app.ingress import HarmonyIngress
    from serve_app.prefill_server import PrefillServer
    from serve_app.response_store import ResponseStoreServer

    config = ServeAppConfig.from_args(args)
    # Decide `auto` once, here, so every replica agrees (a CPU head node must not pick cpu for GPU nodes).
    device = config.resolved_device()
    transport = config.resolved_transport(device)
    resolved = config.model_copy(update={"device": device, "kv_transport": transport})

    prefill = None
    if config.disaggregated:
        prefill = serve.deployment(PrefillServer, name=PREFILL_NAME, **deployment_options(
            config, config.prefill, device, transport, runs_prompts=True)).bind(resolved)
    decode = serve.deployment(DecodeServer, name=DECODE_NAME, **deployment_options(
        config, config.decode, device, transport, runs_prompts=not config.disaggregated)).bind(prefill, resolved)
    replicas = {"num_replicas": config.ingress.num_replicas} if config.ingress.num_replicas is not None \
        else {"autoscaling_config": config.ingress.autoscaling.to_serve()}
    ingress = serve.deployment(
        HarmonyIngress, name=INGRESS_NAME, **replicas, max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus},
    )
    store = None
    if config.ingress.store_max_responses > 0:  # one replica: it is the store (serve_app/response_store.py)
        # No CPU reserved (like Serve's own controller): its calls take microseconds, and a reservation could
        # leave it unplaceable on a node the other replicas fill (seen: 2 cores, 2 ingress replicas; the app
        # then never became ready).
        store = serve.deployment(
            ResponseStoreServer, name=RESPONSE_STORE_NAME, num_replicas=1, max_ongoing_requests=1024,
            ray_actor_options={"num_cpus": 0},
        ).bind(config.ingress.store_max_responses, int(config.ingress.store_max_mib * 2**20))
    return ingress.bind(decode, config.served_model_name, config.max_context, config.ingress, store)
