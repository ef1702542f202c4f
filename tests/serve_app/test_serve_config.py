"""Serve app settings (no Ray cluster): argument parsing, validation, deployment options, cluster.yaml."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema
from ray.serve.scripts import convert_args_to_dict

import serve_app
from serve_app.builder import DECODE_NAME, PREFILL_NAME, deployment_options
from serve_app.config import ServeAppConfig, ServeConfigError
from serve_app.placement import NOSET_CUDA_VISIBLE_DEVICES, STRATEGY, ReplicaResources

ROOT = Path(__file__).resolve().parents[2]


def serve_run_args(*pairs: str) -> dict:
    """Arguments exactly as `serve run serve_app:app key=value ...` hands them to the builder."""
    return convert_args_to_dict(pairs)


def test_defaults_are_the_quick_start():
    config = ServeAppConfig.from_args(serve_run_args())
    assert config.model is None and config.disaggregated and config.device == "auto"
    if not torch.cuda.is_available():
        assert config.resolved_device() == "cpu"
    assert config.resolved_transport("cpu") == "object_store"
    assert config.resolved_transport("cuda") == "cuda_ipc"
    assert config.gpus_per_replica == 1


def test_serve_run_arguments_dotted_keys_and_json():
    config = ServeAppConfig.from_args(serve_run_args(
        "decode={\"max_ongoing_requests\": 7, \"autoscaling\": {\"max_replicas\": 3, \"upscale_delay_s\": 5}}",
        "decode.autoscaling.max_replicas=4",  # a dotted key overrides one field of the JSON object
        "prefill.num_replicas=2",
        "prefill.resources_per_worker={\"H200\": 1}",
        "served_model_name=123",  # a free-form string stays a string
        "model=none",
        "max_context=4096",
        "kv_transfer_timeout_s=2.5",
        "disaggregated=false",
    ))
    assert config.decode.max_ongoing_requests == 7
    assert config.decode.autoscaling.max_replicas == 4
    assert config.decode.autoscaling.upscale_delay_s == 5
    assert config.decode.autoscaling.target_ongoing_requests is None  # untouched defaults survive (None: from
    # max_num_seqs, test_decode_autoscaling_target_follows_max_num_seqs)
    assert config.prefill.num_replicas == 2 and config.prefill.resources_per_worker == {"H200": 1}
    assert config.served_model_name == "123" and config.model is None
    assert config.max_context == 4096 and config.kv_transfer_timeout_s == 2.5 and not config.disaggregated


def test_serve_yaml_args(tmp_path):
    text = """
applications:
  - name: gptoss
    import_path: serve_app:app
    args:
      model: ./ckpt
      decode:
        num_replicas: 3
        autoscaling.target_ongoing_requests: 12
      prefill.autoscaling: {min_replicas: 2, max_replicas: 5}
"""
    app = ServeDeploySchema.model_validate(yaml.safe_load(text)).applications[0]
    config = ServeAppConfig.from_args(app.args)
    assert config.model == str(Path("./ckpt").resolve())  # replicas run elsewhere: paths are pinned
    assert config.decode.num_replicas == 3 and config.decode.autoscaling.target_ongoing_requests == 12
    assert (config.prefill.autoscaling.min_replicas, config.prefill.autoscaling.max_replicas) == (2, 5)


@pytest.mark.parametrize("args, message", [
    (("decode.autoscaling.max_replica=4",), "decode.autoscaling.max_replica: unknown setting"),
    (("tp_size=4",), "num_key_value_heads=2 is not divisible by tp=4"),
    (("ep_size=3", "device=cuda"), "num_local_experts=4 is not divisible by ep=3"),
    (("tp_size=2", "ep_size=4", "device=cuda"), "must each be 1 or the replica's world size"),
    (("tp_size=2", "device=cpu"), "needs device=cuda"),
    (("kv_transport=cuda_ipc", "device=cpu"), "kv_transport=cuda_ipc needs device=cuda"),
    (("decode.autoscaling.min_replicas=5",), "min_replicas (5) exceeds max_replicas (1)"),
    (("prefill.autoscaling.initial_replicas=3", "prefill.autoscaling.max_replicas=2"), "initial_replicas (3)"),
    (("prefill.resources_per_worker={\"GPU\": 2}",), "must not set 'GPU'"),
    (("max_num_seqs=4096",), "max_num_batched_tokens (2048) must be >= max_num_seqs (4096)"),
    (("max_context=200000",), "exceeds the model's max_position_embeddings (131072)"),
    (("tp_size.x=1",), "tp_size"),
    (("decode.autoscaling=3",), "decode.autoscaling"),
    (("device=tpu",), "device: Input should be 'auto', 'cpu' or 'cuda'"),
    (("block_size=0",), "block_size: Input should be greater than or equal to 1"),
])
def test_bad_arguments_name_the_key(args, message):
    with pytest.raises(ServeConfigError) as err:
        ServeAppConfig.from_args(serve_run_args(*args))
    assert message in str(err.value)


def test_parallel_sizes_checked_against_the_checkpoint(tmp_path):
    from model.tiny import make_tiny

    make_tiny(tmp_path / "m", vocab_size=999, num_attention_heads=6, num_key_value_heads=3, num_local_experts=6)
    ok = ServeAppConfig.from_args({"model": str(tmp_path / "m"), "tp_size": "3", "ep_size": "3", "device": "cuda"})
    assert ok.world_size == 3 and ok.gpus_per_replica == 3
    with pytest.raises(ServeConfigError, match="num_key_value_heads=3 is not divisible by tp=2"):
        ServeAppConfig.from_args({"model": str(tmp_path / "m"), "tp_size": "2", "device": "cuda"})
    # A folder only the GPU nodes can see is accepted here; the replica checks it when it loads.
    remote = ServeAppConfig.from_args({"model": "/nonexistent/gpt-oss-120b", "tp_size": "4", "device": "cuda"})
    assert remote.model_config_if_readable() is None


def test_engine_config_mapping():
    config = ServeAppConfig.from_args(serve_run_args("kv_cache_memory_gib=0.5", "block_size=32", "max_context=1000",
                                                     "max_num_seqs=8", "max_num_batched_tokens=64", "seed=7"))
    engine = config.engine_config("cpu")
    assert (engine.kv_cache_bytes, engine.block_size, engine.max_model_len) == (2**29, 32, 1000)
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.seed, engine.device) == (8, 64, 7, "cpu")
    assert engine.kv_cache_dtype == "auto"
    fp8 = ServeAppConfig.from_args(serve_run_args("kv_cache_dtype=fp8_e4m3")).engine_config("cpu")
    assert fp8.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ServeConfigError):
        ServeAppConfig.from_args(serve_run_args("kv_cache_dtype=fp8"))
    assert engine.lm_head_dtype == "auto"
    assert ServeAppConfig.from_args(serve_run_args("lm_head_dtype=fp8_e4m3")).engine_config("cpu").lm_head_dtype == "fp8_e4m3"
    with pytest.raises(ServeConfigError):
        ServeAppConfig.from_args(serve_run_args("lm_head_dtype=int8"))
    assert engine.dense_dtype == "auto"
    assert ServeAppConfig.from_args(serve_run_args("dense_dtype=fp8_e4m3")).engine_config("cpu").dense_dtype == "fp8_e4m3"
    with pytest.raises(ServeConfigError):
        ServeAppConfig.from_args(serve_run_args("dense_dtype=fp8"))
    assert engine.jump_forward_tokens == 8
    assert ServeAppConfig.from_args(serve_run_args("jump_forward_tokens=0")).engine_config("cpu").jump_forward_tokens == 0
    with pytest.raises(ServeConfigError, match="jump_forward_tokens"):
        ServeAppConfig.from_args(serve_run_args("jump_forward_tokens=17"))


def test_gpu_replica_reserves_one_bundle_per_gpu_strict_pack():
    config = ServeAppConfig.from_args(serve_run_args("device=cuda", "ep_size=4", "dp_size=2",
                                                     "decode.resources_per_worker={\"H200\": 1}",
                                                     "decode.cpus_per_worker=3", "decode.num_replicas=2"))
    options = deployment_options(config, config.decode, "cuda", "cuda_ipc")
    assert options["placement_group_strategy"] == STRATEGY == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 3.0, "GPU": 1.0, "H200": 1.0}] * 8
    actor = options["ray_actor_options"]
    # The replica actor is rank 0: exactly bundle 0's resources.
    assert (actor["num_cpus"], actor["num_gpus"], actor["resources"]) == (3.0, 1, {"H200": 1.0})
    assert actor["runtime_env"]["env_vars"] == {NOSET_CUDA_VISIBLE_DEVICES: "1"}
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    serve.deployment(_Dummy, **options)  # Serve's own option validation accepts them


def test_host_kv_tier_setting_reaches_the_engine_and_reserves_host_memory():
    config = ServeAppConfig.from_args(serve_run_args("device=cuda", "tp_size=2", "host_kv_cache_gib=1.5"))
    # only where prompts run: the prefill replicas (a disaggregated decode replica imports its K/V)
    assert config.engine_config("cuda", "prefill").host_kv_cache_bytes == 3 * 2**29  # per rank
    assert config.engine_config("cuda", "decode").host_kv_cache_bytes == 0
    options = deployment_options(config, config.prefill, "cuda", "cuda_ipc")
    assert [b["memory"] for b in options["placement_group_bundles"]] == [1.5 * 2**30] * 2
    assert options["ray_actor_options"]["memory"] == 3 * 2**29
    serve.deployment(_Dummy, **options)
    assert "memory" not in deployment_options(config, config.decode, "cuda", "cuda_ipc")["ray_actor_options"]
    together = ServeAppConfig.from_args(serve_run_args("device=cuda", "host_kv_cache_gib=2", "disaggregated=false"))
    assert together.engine_config("cuda", "decode").host_kv_cache_bytes == 2**31
    assert deployment_options(together, together.decode, "cuda", "cuda_ipc")["ray_actor_options"]["memory"] == 2**31
    with pytest.raises(ServeConfigError, match="host_kv_cache_gib needs enable_prefix_caching"):
        ServeAppConfig.from_args(serve_run_args("host_kv_cache_gib=1", "enable_prefix_caching=false"))
    with pytest.raises(ServeConfigError, match="host_kv_cache_gib"):
        ServeAppConfig.from_args(serve_run_args("host_kv_cache_gib=-1"))


def test_cpu_replica_and_autoscaling_options():
    config = ServeAppConfig.from_args(serve_run_args("prefill.autoscaling.max_replicas=3"))
    options = deployment_options(config, config.prefill, "cpu", "object_store")
    assert options["placement_group_bundles"] == [{"CPU": 0.5}]
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    auto = options["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 3, 4)
    assert auto["upscale_delay_s"] >= 30 and auto["downscale_delay_s"] >= 300  # slow start, long requests
    assert options["graceful_shutdown_timeout_s"] >= 60
    serve.deployment(_Dummy, **options)
    assert ReplicaResources.of(config, config.decode, "cpu").num_ranks == 1


def test_decode_autoscaling_target_follows_max_num_seqs():
    """Decode's default target is three quarters of the engine's seats (and its request cap twice them); a number
    given wins; the ingress, which has no engine, needs a number."""
    for seats, target, cap in ((64, 48, 128), (512, 384, 1024), (1, 1, 2)):
        config = ServeAppConfig.from_args(serve_run_args(f"max_num_seqs={seats}", "max_num_batched_tokens=2048"))
        options = deployment_options(config, config.decode, "cpu", "object_store")
        assert options["autoscaling_config"]["target_ongoing_requests"] == target
        assert options["max_ongoing_requests"] == cap
        serve.deployment(_Dummy, **options)  # Serve takes it
    config = ServeAppConfig.from_args(serve_run_args("max_num_seqs=512",
                                                     "decode.autoscaling.target_ongoing_requests=100"))
    assert deployment_options(config, config.decode, "cpu", "object_store")["autoscaling_config"][
        "target_ongoing_requests"] == 100
    with pytest.raises(ServeConfigError, match="target_ongoing_requests"):
        ServeAppConfig.from_args(serve_run_args("ingress.autoscaling.target_ongoing_requests=null"))


def test_app_is_a_serve_application_builder():
    app = call_user_app_builder_with_args_if_necessary(serve_app.app, serve_run_args("decode.num_replicas=2"))
    ingress = app._bound_deployment
    decode = ingress.init_args[0]._bound_deployment
    prefill = decode.init_args[0]._bound_deployment
    assert (ingress.name, decode.name, prefill.name) == ("HarmonyIngress", DECODE_NAME, PREFILL_NAME)
    assert decode.num_replicas == 2
    settings = ingress.init_args[3]  # the ingress' own settings travel whole to its replicas
    assert settings.num_replicas == 1 and settings.default_max_tokens is None and settings.api_key_values() == ()
    assert settings.stream_keepalive_s == 15.0
    store = ingress.init_args[4]._bound_deployment  # the ResponseStore: one replica holds every stored response
    assert (store.name, store.num_replicas, store.init_args) == ("ResponseStore", 1,
                                                                 (10_000, 512 * 2**20, None, 2**30, 30.0))
    assert store.ray_actor_options["num_cpus"] == 0  # never the replica that does not fit (builder.py)
    assert "resources" not in store.ray_actor_options  # memory only: anywhere
    filed = call_user_app_builder_with_args_if_necessary(serve_app.app, serve_run_args(
        "ingress.store_path=/srv/store.db", "ingress.store_orphan_s=5"))
    filed = filed._bound_deployment.init_args[4]._bound_deployment
    assert filed.init_args[2] == "/srv/store.db"  # with a file: on the head node, where the file is
    assert filed.init_args[4] == 5.0
    assert filed.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    keyed = call_user_app_builder_with_args_if_necessary(serve_app.app, serve_run_args(
        "ingress.default_max_tokens=512", "ingress.api_keys=sk-x", "ingress.stream_keepalive_s=null",
        "ingress.store_max_responses=0"))
    assert keyed._bound_deployment.init_args[4] is None  # no store: /v1/responses is stateless
    scaled = call_user_app_builder_with_args_if_necessary(serve_app.app, serve_run_args(
        "ingress.num_replicas=null", "ingress.autoscaling.max_replicas=3"))._bound_deployment
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 3, 256)
    assert keyed._bound_deployment.init_args[3].default_max_tokens == 512
    assert keyed._bound_deployment.init_args[3].api_key_values() == ("sk-x",)
    assert keyed._bound_deployment.init_args[3].stream_keepalive_s is None
    with pytest.raises(ServeConfigError, match="stream_keepalive_s"):
        ServeAppConfig.from_args({"ingress.stream_keepalive_s": "0"})
    no_prefill = call_user_app_builder_with_args_if_necessary(serve_app.app, {"disaggregated": "false"})
    assert no_prefill._bound_deployment.init_args[0]._bound_deployment.init_args[0] is None


def test_several_models_behind_one_ingress():
    """`models`: each entry a model's settings over the shared top-level ones; its deployments named after it; one
    ingress (the first model is its default, the others `more_models`) and one store."""
    import json

    models = [{"served_model_name": "small", "max_context": 1024},
              {"served_model_name": "large/v2", "max_num_seqs": 8, "decode.num_replicas": 3}]
    app = call_user_app_builder_with_args_if_necessary(serve_app.app, serve_run_args(
        f"models={json.dumps(models)}", "disaggregated=false", "max_context=2048", "ingress.api_keys=sk-x"))
    ingress = app._bound_deployment
    decode, name, max_context, settings, store, more = ingress.init_args
    assert (decode._bound_deployment.name, name, max_context) == (f"{DECODE_NAME}-small", "small", 1024)
    assert settings.api_key_values() == ("sk-x",) and store._bound_deployment.name == "ResponseStore"
    (other_name, (other, other_context)), = more.items()
    assert (other_name, other_context) == ("large/v2", 2048)  # the top-level default
    other = other._bound_deployment
    assert other.name == f"{DECODE_NAME}-large_v2" and other.num_replicas == 3
    assert other.init_args[0] is None and other.init_args[1].max_num_seqs == 8  # not disaggregated; its own seats
    split = call_user_app_builder_with_args_if_necessary(serve_app.app, {"models": [{"served_model_name": "a"}]})
    assert split._bound_deployment.init_args[0]._bound_deployment.init_args[0]._bound_deployment.name == \
        f"{PREFILL_NAME}-a"
    for models, message in [([], "non-empty list"), ("x", "non-empty list"),
                            ([{"served_model_name": "a", "ingress": {"num_cpus": 1}}], "models.0.ingress"),
                            ([{"served_model_name": "a"}, {"served_model_name": "a"}], "must differ"),
                            ([{"served_model_name": "a"}, {"tp_size": 0}], "models.1")]:
        with pytest.raises(ServeConfigError, match=message):
            serve_app.app({"models": models})


def test_ingress_imports_no_torch():
    code = ("import sys, serve_app, serve_app.ingress; from serve_app.openai_api.app import create_app; "
            "assert 'torch' not in sys.modules, 'the ingress imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cluster_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    prepared = prepare_config(copy.deepcopy(raw))  # merges the AWS defaults; no cloud call
    validate_config(prepared)  # Ray's JSON schema + its own checks
    gpu = prepared["available_node_types"]["h200"]
    assert gpu["node_config"]["InstanceType"] == "p5e.48xlarge" and gpu["resources"]["GPU"] == 8
    assert 1 <= gpu["min_workers"] <= gpu["max_workers"] == prepared["max_workers"] == 8
    assert "GPU" not in prepared["available_node_types"]["head"]["resources"] or \
        prepared["available_node_types"]["head"]["resources"]["GPU"] == 0
    assert any("[gpu]" in cmd for cmd in prepared["setup_commands"])
    assert any("serve deploy serve_app/serve_h200.yaml" in cmd for cmd in prepared["head_start_ray_commands"])
    starts = [cmd for key in ("head_start_ray_commands", "worker_start_ray_commands") for cmd in prepared[key]
              if "ray start" in cmd]
    assert len(starts) == 2 and all("RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 " in cmd
                                    for cmd in starts)  # the HTTP front end and data plane bench/RESULTS.md measured
    # A typo is caught by the same validation.
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["h200"]["min_wrokers"] = 1
    with pytest.raises(Exception, match="min_wrokers"):
        validate_config(prepare_config(broken))


def test_cluster_serve_yaml_builds_a_valid_config():
    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve_app" / "serve_h200.yaml").read_text()))
    (app,) = schema.applications
    assert app.import_path == "serve_app:app"
    config = ServeAppConfig.from_args(app.args)
    assert config.device == "cuda" and config.resolved_transport("cuda") == "cuda_ipc"
    for settings in (config.prefill, config.decode):
        options = deployment_options(config, settings, "cuda", "cuda_ipc")
        assert all(b["GPU"] == 1 and b["H200"] == 1 for b in options["placement_group_bundles"])
        serve.deployment(_Dummy, **options)


class _Dummy:
    pass


def test_prefix_caching_reaches_the_engine():
    assert ServeAppConfig.from_args({}).engine_config("cpu").enable_prefix_caching is True
    assert ServeAppConfig.from_args({"enable_prefix_caching": "false"}).engine_config("cpu").enable_prefix_caching is False


def test_prefix_router_goes_where_prompts_run_and_in_front_of_them():
    from serve_app.builder import deployment_options
    from serve_app.prefix_router import PrefixAffinityRouter

    def router(args, role="prefill"):
        """The router kwargs of the `role` deployment's options, or None for Serve's default router."""
        config = ServeAppConfig.from_args(args)
        options = deployment_options(config, config.prefill if role == "prefill" else config.decode, "cpu",
                                     "object_store")
        rc = options.get("request_router_config")
        if rc is None:
            return None
        assert rc.request_router_class in (PrefixAffinityRouter, "serve_app.prefix_router.PrefixAffinityRouter",
                                           "serve_app.prefix_router:PrefixAffinityRouter")
        return rc.request_router_kwargs

    assert router({}) == {"prefix_affinity": True, "same_node": True}
    # decode in front of prefill: affinity with a looser guard, so a conversation returns to its node
    assert router({}, role="decode") == {"prefix_affinity": True, "same_node": False, "imbalance": 16,
                                         "across_nodes_only": True}
    assert router({"disaggregated": "false"}, role="decode") == {"prefix_affinity": True, "same_node": False}
    # the prefill deployment keeps the caller's node first without the prefix cache or its routing
    assert router({"prefix_routing": "false"}) == {"prefix_affinity": False, "same_node": True}
    assert router({"enable_prefix_caching": "false"}) == {"prefix_affinity": False, "same_node": True}
    assert router({"prefix_routing": "false"}, role="decode") is None
    assert router({"prefill_same_node": "false"}) == {"prefix_affinity": True, "same_node": False}
    assert router({"prefill_same_node": "false"}, role="decode") is None  # any node's prefill replica: Serve's
    assert router({"prefix_routing": "false", "prefill_same_node": "false"}) is None
    assert router({"disaggregated": "false", "prefix_routing": "false"}, role="decode") is None


def test_cuda_graphs_apply_to_gpu_replicas_of_any_split():
    gpu = ServeAppConfig.from_args({"device": "cuda"})
    assert gpu.engine_config("cuda:0").cuda_graphs is True
    assert gpu.engine_config("cpu").cuda_graphs is False
    # every rank captures the same graphs (engine/distributed/runner.py; tests/engine/test_parallel_graphs_gpu.py)
    assert ServeAppConfig.from_args({"device": "cuda", "tp_size": 2, "ep_size": 2}).engine_config("cuda:0").cuda_graphs
    assert ServeAppConfig.from_args({"device": "cuda", "cuda_graphs": "false"}).engine_config("cuda:0").cuda_graphs is False
    # the lookahead (engine/llm_engine.py): GPU replicas of one rank
    assert gpu.engine_config("cuda:0").async_decode is True and gpu.engine_config("cpu").async_decode is False
    assert ServeAppConfig.from_args({"device": "cuda", "async_decode": "false"}).engine_config("cuda:0").async_decode is False
    assert ServeAppConfig.from_args({"device": "cuda", "tp_size": 2}).engine_config("cuda:0").async_decode is True


def test_prefill_graphs_follow_decode_graphs():
    def engine(args: dict, device: str = "cuda:0"):
        return ServeAppConfig.from_args({"device": "cuda", **args}).engine_config(device)

    assert engine({}).uses_prefill_graphs
    assert not engine({}, "cpu").uses_prefill_graphs
    assert not engine({"prefill_graphs": "false"}).uses_prefill_graphs
    assert not engine({"cuda_graphs": "false"}).uses_prefill_graphs
    assert engine({"tp_size": 2, "ep_size": 2}).uses_prefill_graphs  # every rank captures them


def test_triton_precompile_key_reaches_the_engine():
    assert ServeAppConfig.from_args({"device": "cuda"}).engine_config("cuda:0").triton_precompile is True
    config = ServeAppConfig.from_args({"device": "cuda", "triton_precompile": "false"})
    assert config.engine_config("cuda:0").triton_precompile is False
    assert config.engine_config("cuda:0", "prefill").triton_precompile is False


def test_decode_replicas_take_twice_their_seats():
    """decode.max_ongoing_requests follows max_num_seqs (twice it) unless set: a fixed 128 had held a 512-seat replica
    to 128 sequences, the rest queued in Serve where engine priority cannot reach them. Prefill keeps its 64."""
    default = ServeAppConfig.from_args(serve_run_args())
    assert deployment_options(default, default.decode, "cpu", "object_store")["max_ongoing_requests"] == \
        2 * default.max_num_seqs == 128
    assert deployment_options(default, default.prefill, "cpu", "object_store")["max_ongoing_requests"] == 64
    wide = ServeAppConfig.from_args(serve_run_args("max_num_seqs=512", "max_num_batched_tokens=8192"))
    options = deployment_options(wide, wide.decode, "cpu", "object_store")
    assert options["max_ongoing_requests"] == 1024
    serve.deployment(_Dummy, **options)
    pinned = ServeAppConfig.from_args(serve_run_args("max_num_seqs=512", "max_num_batched_tokens=8192",
                                                     "decode.max_ongoing_requests=300"))
    assert deployment_options(pinned, pinned.decode, "cpu", "object_store")["max_ongoing_requests"] == 300
