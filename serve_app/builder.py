"""The Serve application: HarmonyIngress -> DecodeServer -> PrefillServer, each with its own options, and the
ingress' ResponseStore (stored /v1/responses) beside them.

`build_app` is the application builder behind `serve_app:app`, so the same code serves three entry
points: `serve run serve_app:app key=value ...`, a Serve YAML with `import_path: serve_app:app` and
`args:`, and `serve.run(build_app({...}))` in Python. See serve_app/config.py for the arguments. With a
`models` list it builds several models behind one API (build_models_app).
"""

from __future__ import annotations

import re
from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.config import ServeAppConfig
from serve_app.config_args import ServeConfigError, deep_merge, nest_args
from serve_app.deployment_settings import DeploymentSettings, IngressSettings
from serve_app.placement import HEAD_NODE_RESOURCE, NOSET_CUDA_VISIBLE_DEVICES, ReplicaResources

INGRESS_NAME = "HarmonyIngress"
RESPONSE_STORE_NAME = "ResponseStore"
DECODE_NAME = "DecodeServer"
PREFILL_NAME = "PrefillServer"


def replica_max_ongoing(config: ServeAppConfig, settings: DeploymentSettings) -> int:
    """A replica's cap on requests at once: the setting, or (None) twice the engine's max_num_seqs."""
    return settings.max_ongoing_requests if settings.max_ongoing_requests is not None else 2 * config.max_num_seqs


def replica_target_ongoing(config: ServeAppConfig) -> float:
    """The autoscaling target of a replica whose setting is None: three quarters of the engine's seats."""
    return max(1, 3 * config.max_num_seqs // 4)


def deployment_options(config: ServeAppConfig, settings: DeploymentSettings, device: str,
                       transport: str) -> dict[str, Any]:
    """Serve options of a prefill or decode deployment: replicas or autoscaling, placement, health checks, and
    the prefix-affinity router where `router_kwargs` wants it."""
    # CUDA IPC opens a peer replica's GPU memory, so every GPU of the node must stay visible to torch;
    # each replica then picks its own GPU from Ray's assignment (placement.local_cuda_device).
    env = {NOSET_CUDA_VISIBLE_DEVICES: "1"} if transport == "cuda_ipc" else None
    options = ReplicaResources.of(config, settings, device).deployment_options(env)
    if settings.num_replicas is not None:
        options["num_replicas"] = settings.num_replicas
    else:
        options["autoscaling_config"] = settings.autoscaling.to_serve(replica_target_ongoing(config))
    options.update(
        max_ongoing_requests=replica_max_ongoing(config, settings),
        max_queued_requests=settings.max_queued_requests,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
    )
    kwargs = router_kwargs(config, config.role_of(settings))
    if kwargs is not None:
        try:  # Ray Serve's RequestRouter API (alpha; tested with ray 2.60)
            from ray.serve.config import RequestRouterConfig

            from serve_app.prefix_router import PrefixAffinityRouter
        except ImportError as err:
            raise ValueError(f"prefix_routing and prefill_same_node need Ray Serve's request router API, which this "
                             f"ray lacks ({err}); upgrade ray or set both false") from None
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                               request_router_kwargs=kwargs)
    return options


DECODE_IMBALANCE = 16  # a decode replica's queue is its batch (target 96 in serve_h200.yaml): 16 more is little


def router_kwargs(config: ServeAppConfig, role: str) -> dict[str, Any] | None:
    """The settings of the prefix-affinity router (serve_app/prefix_router.py) in front of the `role` deployment,
    or None for Serve's default router:
    - the deployment that runs prompts (prefill; decode when not disaggregated): prefix affinity (`prefix_routing`);
    - prefill behind decode (disaggregated): the caller's node first (`prefill_same_node`);
    - decode in front of prefill with `prefill_same_node`: prefix affinity with a looser load guard while the decode
      replicas span several nodes, so a conversation's next turn goes back to the node whose prefill replicas hold
      its history (the prefill call stays on the decode replica's node); on one node, Serve's power of two choices."""
    affinity = config.enable_prefix_caching and config.prefix_routing
    if role == "prefill":
        kwargs = {"prefix_affinity": affinity, "same_node": config.disaggregated and config.prefill_same_node}
    elif not config.disaggregated:
        kwargs = {"prefix_affinity": affinity, "same_node": False}
    else:
        kwargs = {"prefix_affinity": affinity and config.prefill_same_node, "same_node": False,
                  "imbalance": DECODE_IMBALANCE, "across_nodes_only": True}
    return kwargs if kwargs["prefix_affinity"] or kwargs["same_node"] else None


def build_app(args: dict[str, Any] | ServeAppConfig | None = None) -> Application:
    """The application of one model, or of several behind one API when `args` has `models` (build_models_app)."""
    if isinstance(args, dict) and "models" in args:
        return build_models_app(args)
    config = ServeAppConfig.from_args(args)
    return _ingress_app([(config, _model_deployments(config))], config.ingress)


def models_configs(args: dict[str, Any]) -> list[ServeAppConfig]:
    """`models`: a list of model settings (a YAML list, or JSON text from `serve run`), each a ServeAppConfig's
    fields; every other argument is a default for all of them. The ingress (`ingress.*`) is shared, so it is set
    at the top level only. Served model names must differ."""
    shared = nest_args(args)
    models = shared.pop("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise ServeConfigError("models: a non-empty list of model settings (each like serve_app:app's arguments), "
                               f"not {models!r}")
    configs = []
    for i, own in enumerate(models):
        own = nest_args(own)
        if "ingress" in own:
            raise ServeConfigError(f"models.{i}.ingress: the ingress is shared by every model; set ingress.* at the "
                                   "top level")
        try:
            configs.append(ServeAppConfig.from_args(deep_merge(shared, own)))
        except ServeConfigError as err:
            raise ServeConfigError(f"models.{i}: {err}") from None
    names = [c.served_model_name for c in configs]
    if len(set(names)) != len(names):
        raise ServeConfigError(f"models: served_model_name must differ between models, got {names}")
    return configs


def build_models_app(args: dict[str, Any]) -> Application:
    """Several models behind one OpenAI API (serve_app/openai_api/model_router.py): each with its own decode (and
    prefill) deployments, named after its served_model_name, one ingress and one response store for all."""
    configs = models_configs(args)
    return _ingress_app([(c, _model_deployments(c, suffix=f"-{_safe(c.served_model_name)}")) for c in configs],
                        configs[0].ingress)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _model_deployments(config: ServeAppConfig, suffix: str = ""):
    """One model's decode deployment (bound to its prefill deployment when disaggregated), names + `suffix`."""
    from serve_app.decode_server import DecodeServer
    from serve_app.prefill_server import PrefillServer

    # Decide `auto` once, here, so every replica agrees (a CPU head node must not pick cpu for GPU nodes).
    device = config.resolved_device()
    transport = config.resolved_transport(device)
    resolved = config.model_copy(update={"device": device, "kv_transport": transport})

    prefill = None
    if config.disaggregated:
        prefill = serve.deployment(PrefillServer, name=PREFILL_NAME + suffix, **deployment_options(
            config, config.prefill, device, transport)).bind(resolved)
    return serve.deployment(DecodeServer, name=DECODE_NAME + suffix, **deployment_options(
        config, config.decode, device, transport)).bind(prefill, resolved)


def _ingress_app(models: list[tuple[ServeAppConfig, Any]], settings: IngressSettings) -> Application:
    """The ingress over `models` ((config, decode deployment); the first is the default) and the response store."""
    from serve_app.ingress import HarmonyIngress
    from serve_app.response_store import ResponseStoreServer

    replicas = {"num_replicas": settings.num_replicas} if settings.num_replicas is not None \
        else {"autoscaling_config": settings.autoscaling.to_serve()}
    ingress = serve.deployment(
        HarmonyIngress, name=INGRESS_NAME, **replicas, max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": settings.num_cpus},
    )
    store = None
    if settings.store_max_responses > 0:  # one replica: it is the store (serve_app/response_store.py)
        # No CPU reserved (like Serve's own controller): its calls take microseconds, and a reservation could
        # leave it unplaceable on a node the other replicas fill (seen: 2 cores, 2 ingress replicas; the app
        # then never became ready).
        # With a file it runs where the file is: on the head node (the path is that node's).
        where = {"resources": {HEAD_NODE_RESOURCE: 0.001}} if settings.store_path else {}
        store = serve.deployment(
            ResponseStoreServer, name=RESPONSE_STORE_NAME, num_replicas=1, max_ongoing_requests=1024,
            ray_actor_options={"num_cpus": 0, **where},
        ).bind(settings.store_max_responses, int(settings.store_max_mib * 2**20), settings.store_path,
               int(settings.files_max_mib * 2**20), settings.store_orphan_s)
    (first, decode), *rest = models
    more = {config.served_model_name: (other, config.max_context) for config, other in rest} or None
    return ingress.bind(decode, first.served_model_name, first.max_context, settings, store, more)
