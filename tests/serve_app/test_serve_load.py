"""bench.serve_load against the app over the real engine (uvicorn in a thread, no Ray), and the
`random:<shape>` model setting that lets the Serve app run full-size shapes without a checkpoint."""

from __future__ import annotations

import pytest

from bench import serve_load
from serve_app.config import ServeAppConfig, ServeConfigError
from serve_app.harmony.encoding import load_harmony_encoding
from tests.serve_app.conftest import LiveServer

MODEL = "tiny-random"
MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def live():
    from serve_app.engine_host import start_engine
    from serve_app.openai_api.app import create_app

    config = ServeAppConfig.from_args({"model": "random:tiny", "max_context": str(MAX_CONTEXT),
                                       "kv_cache_memory_gib": "0.0625", "max_num_seqs": "8"})
    engine = start_engine(config, config.decode, "cpu")
    app = create_app(engine, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date="2026-11-30")
    with LiveServer(app) as server:
        yield server, engine
    engine.shutdown()


def test_prompts_have_the_asked_token_count_and_distinct_starts():
    prompts = serve_load.build_prompts(5, 100, seed=1)
    encoding = load_harmony_encoding()
    counts = [len(encoding.encode(p, allowed_special=set())) for p in prompts]
    assert all(95 <= c <= 105 for c in counts), counts  # re-encoding a cut may merge a token or two
    assert len({p[:3] for p in prompts}) == 5


def test_load_levels_count_every_request(live):
    server, engine = live
    finished = lambda: sum(engine.metrics()["requests_finished_total"].values())  # noqa: E731
    before = finished()
    levels = serve_load.run(server.url, MODEL, [1, 3], requests=4, prompt_tokens=40, max_tokens=6, warmup=1)
    assert finished() - before == 1 + 2 * 4
    assert [s["concurrency"] for s in levels] == [1, 3]
    for s in levels:
        assert s["ok"] == s["requests"] == 4 and s["failed"] == 0, s["errors"]
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["output_tok_s"] > 0
        assert s["prompt_tokens_mean"] > 40  # the user message plus Harmony's system message and headers
        assert 1 <= s["completion_tokens_mean"] <= 6  # usage as the server reported it


def test_bad_requests_are_4xx_in_openai_shape(live):
    server, _ = live
    checks = serve_load.error_checks(server.url, MODEL)
    assert [c["check"] for c in checks] == [what for what, _ in serve_load.ERROR_CHECKS]
    assert all(c["passed"] for c in checks), checks


def test_a_failed_request_is_counted_not_raised(live, tmp_path):
    server, _ = live
    levels = serve_load.run(server.url, "no-such-model", [2], requests=2, prompt_tokens=10, max_tokens=2, warmup=0)
    assert levels[0]["ok"] == 0 and levels[0]["failed"] == 2
    assert any("404" in e or "NotFound" in e for e in levels[0]["errors"])
    serve_load.plot(levels, tmp_path / "p.png", "all failed")  # nothing to draw: no plot, no crash (the table follows)
    assert not (tmp_path / "p.png").exists()


def test_random_model_setting():
    config = ServeAppConfig.from_args({"model": "random:gpt-oss-20b", "device": "cuda"})
    assert config.random_model == "gpt-oss-20b"
    assert config.model_config_if_readable().num_hidden_layers == 24
    with pytest.raises(ServeConfigError, match="unknown preset"):
        ServeAppConfig.from_args({"model": "random:gpt-oss-7b"})
    with pytest.raises(ServeConfigError, match="needs device=cuda"):
        ServeAppConfig.from_args({"model": "random:gpt-oss-120b", "device": "cpu"})
    with pytest.raises(ServeConfigError, match="tp_size/ep_size do not fit"):
        ServeAppConfig.from_args({"model": "random:gpt-oss-20b", "device": "cuda", "tp_size": "3"})


def test_random_tiny_replicas_draw_the_same_model():
    """Prefill and decode replicas each draw `random:` weights: from the same seed they must be one model."""
    from engine.request import GenerateRequest, SamplingParams
    from serve_app.engine_host import start_engine

    config = ServeAppConfig.from_args({"model": "random:tiny", "max_context": "256", "kv_cache_memory_gib": "0.03"})
    outputs = []
    def sync_engine(cfg):
        hosted = start_engine(cfg, cfg.prefill, "cpu")
        hosted.shutdown()  # stop its thread: this test steps the engine itself
        return hosted.engine

    for _ in range(2):
        engine = sync_engine(config)
        engine.add_request(GenerateRequest("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5)))
        ids = []
        while engine.has_unfinished():
            ids += [t for d in engine.step() for t in d.token_ids]
        outputs.append(ids)
        engine.close()
    assert len(outputs[0]) == 5 and outputs[0] == outputs[1]
    other = ServeAppConfig.from_args({"model": "random:tiny", "max_context": "256", "kv_cache_memory_gib": "0.03",
                                      "seed": "1"})
    engine = sync_engine(other)
    params = [p.detach().clone() for p in engine.runner.model.parameters()][:3]
    engine.close()
    engine = sync_engine(config)
    assert any(not (a == b).all() for a, b in zip(params, engine.runner.model.parameters()))
    engine.close()


@pytest.mark.slow
def test_launch_loads_the_serve_app_and_reads_its_replicas(tmp_path, monkeypatch):
    """`--launch`: serve_app on a local Ray (prefill + decode replicas, K/V over the object store), loaded
    over HTTP; the JSON carries the server side per level (engine TTFT / TPOT, CPU of Ray's processes). The app
    wants an API key, which the load (readiness probe, requests, error checks) sends from $OPENAI_API_KEY."""
    import json

    monkeypatch.setenv("OPENAI_API_KEY", "sk-load-1")
    rc = serve_load.main(["--launch", "model=random:tiny", "max_context=512", "kv_cache_memory_gib=0.0625",
                          "ingress.api_keys=sk-load-0,sk-load-1",
                          "decode.num_replicas=1", "prefill.num_replicas=1", "--concurrency", "2",
                          "--requests", "3", "--prompt-tokens", "30", "--max-tokens", "4", "--warmup", "1",
                          "--error-checks", "--out-dir", str(tmp_path), "--label", "launch"])
    assert rc == 0
    result = json.loads((tmp_path / "launch.json").read_text())
    assert (tmp_path / "launch.png").stat().st_size > 0
    level = result["levels"][0]
    assert level["ok"] == 3 and all(c["passed"] for c in result["error_checks"])
    decode = result["replicas"][0]
    assert decode["transport"] == "object_store" and decode["transfers"] == 1 + 3 and decode["fallbacks"] == 0
    engines = level["server"]["engines"]
    assert engines["PrefillServer"]["ttft_ms_mean"] > 0  # the prompts ran on the prefill replica
    assert engines["DecodeServer"]["tpot_ms_mean"] > 0
    assert any("DecodeServer" in title for title in level["server"]["cpu_cores_busy"])


def test_a_launch_that_fails_stops_the_ray_it_started(monkeypatch, tmp_path):
    """A Ray instance left running by a failed launch made every later ray.init in the process fail."""
    import ray

    from bench import serve_launch

    def start_then_fail(self):
        ray.init(include_dashboard=False, num_cpus=1)
        raise RuntimeError("serve_app failed to deploy: (simulated)")

    monkeypatch.setattr(serve_launch.LaunchedApp, "start", start_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        serve_load.main(["--launch", "model=random:tiny", "--out-dir", str(tmp_path)])
    assert not ray.is_initialized()
