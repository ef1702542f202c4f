"""The whole app on a real local Ray: HTTP (the openai client) -> HarmonyIngress -> DecodeServer ->
PrefillServer, K/V over the object store, compared token for token with a single-process engine.

One Ray instance and one app for the module; the test that kills a replica runs last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import tempfile
import time
import urllib.request

import openai
import pytest
import ray
import torch
from ray import serve

from engine.request import EngineUnhealthyError, GenerateRequest, SamplingParams
from serve_app.builder import DECODE_NAME, INGRESS_NAME, PREFILL_NAME, RESPONSE_STORE_NAME, build_app, deployment_options
from serve_app.config import ServeAppConfig
from serve_app.decode_server import DecodeServer
from serve_app.kv_transfer import KVHandle, KVTransferError, ObjectStoreTransport
from serve_app.openai_api.app import create_app
from serve_app.prefill_server import PrefillServer
from tests.serve_app.serve_helpers import (
    ServerThread,
    collect,
    free_port,
    reference_engine,
    replica_actors,
    run_async,
    running_replicas,
    start_ray,
    stop_ray,
    wait_until,
)

APP = "e2e"
ARGS = {
    "max_context": "1024",
    "kv_cache_memory_gib": "0.0625",
    "decode.num_replicas": "1",
    "prefill.num_replicas": "1",
    "decode.graceful_shutdown_timeout_s": "1",
    "prefill.graceful_shutdown_timeout_s": "1",
    "decode.health_check_period_s": "1",
    # The Harmony system message carries a date: pinned, so the tiny model's output (and what these
    # tests see of it: content or not, streamed in pieces or recovered at the end) is the same every day.
    "ingress.conversation_start_date": "2026-11-29",
    "ingress.api_keys": "sk-e2e-first,sk-e2e-second",  # every /v1/ call below sends the first
    "ingress.forced_call_reasoning_tokens": "4",  # a random model reasons until the budget: keep it short
    # every prompt of 16 characters or more is tokenized in the ingress' render worker (the default is 16,384):
    # these tests, which compare with an app that tokenizes in place, then cover the worker under Ray
    "ingress.render_off_loop_chars": "16",
    # the store writes through to a file and reads it back when its replica restarts (on the head node: this one)
    # (a path only: the store makes the folder, and the module's fixture removes it)
    "ingress.store_path": str(pathlib.Path(tempfile.gettempdir()) / f"gptoss-e2e-{os.getpid()}" / "responses.db"),
    # a dead ingress replica's batch is adopted after this much silence (30 s by default)
    "ingress.store_orphan_s": "6",
}
KEY = "sk-e2e-first"
CONFIG = ServeAppConfig.from_args(ARGS)


@pytest.fixture(scope="module")
def ray_ports():
    ports = start_ray(export_metrics=True, _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.run(build_app(ARGS), name=APP, route_prefix="/")
        yield ports
    finally:
        stop_ray()
        shutil.rmtree(pathlib.Path(ARGS["ingress.store_path"]).parent, ignore_errors=True)


@pytest.fixture(scope="module")
def http_port(ray_ports):
    return ray_ports.http


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    engine = reference_engine(CONFIG)
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)  # reference_engine narrowed it for this module only


@pytest.fixture(scope="module")
def reference_port(reference):
    port = free_port()
    with ServerThread(create_app(reference, model_name=CONFIG.served_model_name, max_context=1024,
                                 conversation_start_date=CONFIG.ingress.conversation_start_date,
                                 forced_call_reasoning_tokens=CONFIG.ingress.forced_call_reasoning_tokens), port):
        yield port


def client(port: int) -> openai.OpenAI:
    # No retries: a retried request would hide a dropped one.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)


def stats(deployment: str) -> dict:
    return serve.get_deployment_handle(deployment, APP).stats.remote().result()


def processes() -> list[tuple[int, str]]:
    """(pid, command line) of this machine's processes (Linux /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                pass
    return found


def parent(pid: int) -> int:
    try:
        return int((pathlib.Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200000, (n,), generator=g).tolist()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])  # fp8: kv_cache_dtype="fp8_e4m3"
def test_object_store_transport_roundtrip_and_failures(http_port, kv_dtype):
    from engine.kv_payload import PrefilledKV

    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(n, 2, 16, generator=g).to(kv_dtype) for n in (19, 127)]
    vs = [torch.randn(n, 2, 16, generator=g).to(kv_dtype) for n in (19, 127)]
    payload = PrefilledKV("rt", list(range(19)), [5], [], 7, 19, 0, [False, True], ks, vs)
    transport = ObjectStoreTransport("cpu")
    offer = transport.offer(10**6)
    handle = transport.send(payload, offer)
    got = run_async(transport.receive(handle, offer, timeout_s=10))
    assert (got.request_id, got.output_ids, got.seed, got.num_cached) == ("rt", [5], 7, 19)
    assert all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip((*ks, *vs), (*got.k, *got.v)))
    assert transport.last_stats.nbytes == handle.nbytes >= payload.nbytes

    @ray.remote(num_cpus=0)
    def never_ready():
        time.sleep(60)

    lost = KVHandle("object_store", handle.skeleton, handle.specs, handle.nbytes, 0.0, never_ready.remote())
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="did not arrive within 0.5 s"):
        run_async(transport.receive(lost, offer, timeout_s=0.5))
    assert time.monotonic() - t0 < 5
    with pytest.raises(KVTransferError, match="same kv_transport"):
        run_async(transport.receive(KVHandle("cuda_ipc", handle.skeleton, [], 0, 0.0), offer, timeout_s=1))


CASES = [  # prompt length, sampling: greedy, seeded sampling with filters, logprobs; awkward lengths
    (1, SamplingParams(temperature=0.0, max_tokens=9)),
    (19, SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=17, logprobs=2)),
    (130, SamplingParams(temperature=0.7, top_k=50, min_p=0.01, seed=5, max_tokens=12)),  # past the window
    (301, SamplingParams(temperature=0.0, max_tokens=5, logprobs=0)),
]


def test_tokens_match_the_single_process_engine(http_port, reference):
    before = stats(DECODE_NAME)
    decode = serve.get_deployment_handle(DECODE_NAME, APP).options(stream=True)
    for i, (n, sampling) in enumerate(CASES):
        request = GenerateRequest(f"match-{i}", random_prompt(n, i), sampling)
        served = list(decode.generate.remote(request))
        want = run_async(collect(reference.generate(GenerateRequest(f"ref-{i}", request.prompt_ids, sampling))))
        assert [t for d in served for t in d.token_ids] == [t for d in want for t in d.token_ids], f"case {i}"
        assert served[-1].finish_reason == want[-1].finish_reason
        assert served[-1].num_prompt_tokens == n
        if sampling.logprobs is not None:
            got_lp = [lp for d in served for lp in d.logprobs]
            want_lp = [lp for d in want for lp in d.logprobs]
            assert [(a.token_id, [t for t, _ in a.top]) for a in got_lp] == \
                   [(b.token_id, [t for t, _ in b.top]) for b in want_lp]
            assert max(abs(a.logprob - b.logprob) for a, b in zip(got_lp, want_lp)) < 1e-4
    after = stats(DECODE_NAME)
    assert after["transfers"] - before["transfers"] == len(CASES)  # every prompt ran on the prefill replica
    assert after["fallbacks"] == before["fallbacks"]
    assert after["kv_imported_total"] - before["kv_imported_total"] == len(CASES)
    assert stats(PREFILL_NAME)["kv_exported_total"] >= len(CASES)


def test_a_prompt_continuing_an_output_generated_here_runs_on_decode(http_port, reference):
    """local_prefill_max_tokens (512): a prompt whose prefix cached on the decode replica runs into an output that
    replica generated (named when it ended), with at most 512 tokens past it, runs on decode: the prefill replica
    never saw that output. A prompt that shares only the earlier prompt goes to prefill as before. Tokens as the
    single-process engine's either way."""
    decode = serve.get_deployment_handle(DECODE_NAME, APP).options(stream=True)
    prompt = random_prompt(150, 77)
    first = list(decode.generate.remote(GenerateRequest("turn-1", prompt, SamplingParams(temperature=0.0,
                                                                                           max_tokens=40))))
    out = [t for d in first for t in d.token_ids]
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    for rid, follow, local in [("turn-2", prompt + out + random_prompt(9, 78), True),
                               ("other-2", prompt + random_prompt(9, 79), False)]:
        before = stats(DECODE_NAME)
        served = list(decode.generate.remote(GenerateRequest(rid, follow, sampling)))
        want = run_async(collect(reference.generate(GenerateRequest(f"ref-{rid}", follow, sampling))))
        after = stats(DECODE_NAME)
        assert [t for d in served for t in d.token_ids] == [t for d in want for t in d.token_ids], rid
        assert (after["local_prefills"] - before["local_prefills"], after["transfers"] - before["transfers"]) == \
            ((1, 0) if local else (0, 1)), rid
        if local:  # the prompt and the output's whole blocks came from this replica's cache
            assert served[-1].num_cached_tokens >= (len(prompt) + len(out)) // 16 * 16 - 16, served[-1]


CHAT = dict(model="gpt-oss", messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is a KV cache?"}])


def test_chat_over_http_matches_the_single_process_app(http_port, reference_port):
    served, ref = client(http_port), client(reference_port)
    for sampling in (dict(temperature=0, max_tokens=24, logprobs=True, top_logprobs=3),
                     dict(temperature=1.0, top_p=0.95, seed=11, max_tokens=20)):
        got = served.chat.completions.create(**CHAT, **sampling)
        want = ref.chat.completions.create(**CHAT, **sampling)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert re.fullmatch(r"fp_[0-9a-f]{12}", got.system_fingerprint)  # the decode deployment's (fingerprint.py)
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.model_dump() == want.usage.model_dump()
        if sampling.get("logprobs"):
            gl, wl = got.choices[0].logprobs.content, want.choices[0].logprobs.content
            assert [(t.bytes, [x.bytes for x in t.top_logprobs]) for t in gl] == \
                   [(t.bytes, [x.bytes for x in t.top_logprobs]) for t in wl]
            if got.choices[0].message.content:  # content tokens carry logprobs (also text recovered as content)
                assert gl and max(abs(a.logprob - b.logprob) for a, b in zip(gl, wl)) < 1e-4

    # Streaming: the same answer, delivered in several chunks, then the finish reason and usage.
    want = ref.chat.completions.create(**CHAT, temperature=0, max_tokens=24)
    chunks = list(served.chat.completions.create(**CHAT, temperature=0, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1
    assert "".join(texts) == want.choices[0].message.content
    assert {c.system_fingerprint for c in chunks} == {got.system_fingerprint}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
           [want.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens

    # The ingress replica tokenized those prompts in its render worker process (a child of the replica's actor).
    workers = [pid for pid, cmd in processes() if "serve_app.harmony.render_worker" in cmd and parent(pid) != os.getpid()]
    assert workers and all("ServeReplica" in dict(processes()).get(parent(pid), "") for pid in workers)

    # /v1/completions through the Serve ingress: the same raw text as the single-process app.
    raw = dict(model="gpt-oss", prompt="<|start|>user<|message|>Hello<|end|><|start|>assistant", max_tokens=16,
               temperature=0)
    fingerprint = got.system_fingerprint
    got, want = served.completions.create(**raw), ref.completions.create(**raw)
    assert got.choices[0].text == want.choices[0].text and got.usage.model_dump() == want.usage.model_dump()
    assert got.system_fingerprint == fingerprint


def test_structured_output_across_the_prefill_decode_hand_off(http_port, reference_port):
    """A strict forced tool call and a response_format completion: the prefill replica samples the first token
    under the constraint, the decode replica replays it into its own and goes on (through the reasoning the
    forced call allows, 4 tokens here, and the call); the result equals the single-process app's and satisfies
    the schema."""
    import json

    from tests.serve_app.test_harmony_constrain import valid
    from tests.serve_app.test_real_engine import WEATHER

    served, ref = client(http_port), client(reference_port)
    before = stats(DECODE_NAME)
    tool = {"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}}
    kwargs = dict(**CHAT, max_tokens=60, temperature=1.0, seed=7, tools=[tool], tool_choice="required")
    got, want = served.chat.completions.create(**kwargs), ref.chat.completions.create(**kwargs)
    assert got.choices[0].message.tool_calls[0].function.arguments == \
        want.choices[0].message.tool_calls[0].function.arguments
    assert valid(json.loads(got.choices[0].message.tool_calls[0].function.arguments), WEATHER)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    raw = dict(model="gpt-oss", prompt="<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>",
               max_tokens=60, temperature=1.0, seed=3, extra_body={"response_format": fmt})
    got, want = served.completions.create(**raw), ref.completions.create(**raw)
    assert got.choices[0].text == want.choices[0].text and got.choices[0].finish_reason == "stop"
    assert valid(json.loads(got.choices[0].text), WEATHER)
    after = stats(DECODE_NAME)
    assert after["transfers"] - before["transfers"] == 2 and after["fallbacks"] == before["fallbacks"]


def test_twenty_concurrent_streams_then_pools_are_free(http_port, reference_port):
    requests = [dict(model="gpt-oss", messages=[{"role": "user", "content": f"Question {i}: " + "why? " * (i % 7)}],
                     temperature=0, max_tokens=8 + i) for i in range(20)]
    ref = client(reference_port)
    expected = [ref.chat.completions.create(**r) for r in requests]
    before = stats(DECODE_NAME)

    async def one(api: openai.AsyncOpenAI, request: dict) -> tuple[str, str | None]:
        parts, finish = [], None
        async for chunk in await api.chat.completions.create(**request, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def all_at_once():
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0,
                                 timeout=120)
        return await asyncio.gather(*(one(api, r) for r in requests))

    results = run_async(all_at_once())
    for i, ((text, finish), want) in enumerate(zip(results, expected)):
        assert text == want.choices[0].message.content, f"stream {i} differs"
        assert finish == want.choices[0].finish_reason
    assert stats(DECODE_NAME)["transfers"] - before["transfers"] == 20

    def pools_free() -> bool:
        return all(s["num_running"] == s["num_waiting"] == s["num_prefilled"] == 0
                   and s["full_pages_free"] == s["full_pages_total"]
                   and s["sliding_pages_free"] == s["sliding_pages_total"]
                   for s in (stats(DECODE_NAME), stats(PREFILL_NAME)))

    wait_until(pools_free, 10, "every KV page back in the pools")


class FaultyPrefill(PrefillServer):
    """A prefill replica that fails on purpose, chosen by the request id's prefix."""

    async def prefill(self, request, offer):
        mode = request.request_id.split("-", 1)[0]
        if mode == "raise":
            raise RuntimeError("injected prefill failure")
        if mode == "sick":  # what an unhealthy engine answers (check_health fails too; Serve replaces the replica)
            raise EngineUnhealthyError("injected: a step failed with an error the engine cannot recover from")
        if mode == "slow":
            await asyncio.sleep(4)  # past the decode replica's prefill_timeout_s
        handle = await super().prefill(request, offer)
        if mode == "lost":
            handle.ref = _never_ready.remote()  # K/V that never arrives
        if mode == "mismatch":
            handle.skeleton.layer_is_sliding = [not s for s in handle.skeleton.layer_is_sliding]
        return handle


@ray.remote(num_cpus=0)
def _never_ready():
    time.sleep(120)


def test_failed_prefill_or_transfer_falls_back_to_local_prefill(http_port, reference):
    config = ServeAppConfig.from_args({**ARGS, "prefill_timeout_s": "2.5", "kv_transfer_timeout_s": "1"})
    prefill = serve.deployment(FaultyPrefill, name="FaultyPrefill",
                               **deployment_options(config, config.prefill, "cpu", "object_store")).bind(config)
    decode = serve.deployment(DecodeServer, name="FallbackDecode",
                              **deployment_options(config, config.decode, "cpu", "object_store")).bind(prefill, config)
    handle = serve.run(decode, name="faulty", route_prefix=None).options(stream=True)
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=10)
    prompt = random_prompt(40, 99)
    want = [t for d in run_async(collect(reference.generate(GenerateRequest("ref-f", prompt, sampling))))
            for t in d.token_ids]
    faulty_stats = serve.get_deployment_handle("FallbackDecode", "faulty").stats
    # A first request warms both fresh replicas (on a busy 2-core machine the cold prefill replica once answered
    # 20 ms after a 1.5 s timeout); what it counts is left out below.
    assert [t for d in handle.generate.remote(GenerateRequest("ok-0", prompt, sampling)) for t in d.token_ids] == want
    s0 = faulty_stats.remote().result()
    for mode in ("ok", "raise", "slow", "lost", "mismatch", "sick"):
        t0 = time.monotonic()
        got = [t for d in handle.generate.remote(GenerateRequest(f"{mode}-1", prompt, sampling)) for t in d.token_ids]
        assert got == want, f"mode {mode}"
        assert time.monotonic() - t0 < 10
    s = faulty_stats.remote().result()
    assert (s["transfers"] - s0["transfers"], s["fallbacks"] - s0["fallbacks"]) == (2, 5)  # ok and mismatch
    # arrived; 5 recovered locally
    assert s["fallback_reasons"]["prefill_unhealthy"] - s0["fallback_reasons"].get("prefill_unhealthy", 0) == 1
    serve.delete("faulty")


def test_engine_metrics_reach_prometheus(ray_ports, reference):
    # A request whose prediction is its own output: the decode replica verifies (and accepts) drafts.
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = random_prompt(20, 5)
    want = [t for d in run_async(collect(reference.generate(GenerateRequest("ref-m", prompt, sampling))))
            for t in d.token_ids]
    decode = serve.get_deployment_handle(DECODE_NAME, APP).options(stream=True)
    predicted = dataclasses.replace(sampling, prediction=tuple(want))
    assert [t for d in decode.generate.remote(GenerateRequest("m-1", prompt, predicted)) for t in d.token_ids] == want
    # one request through the HTTP API, so that the API's own metrics exist when this test runs alone
    client(ray_ports.http).chat.completions.create(model=CONFIG.served_model_name, max_tokens=2, temperature=0,
                                                   messages=[{"role": "user", "content": "Hi"}])
    wanted = ["ray_gptoss_ttft_seconds_bucket", "ray_gptoss_tpot_seconds_bucket", "ray_gptoss_kv_transfer_bytes_bucket",
              "ray_gptoss_kv_transfer_seconds_bucket", "ray_gptoss_kv_usage_ratio", "ray_gptoss_queue_depth",
              "ray_gptoss_tokens", "ray_gptoss_steps", "ray_gptoss_forwards", "ray_serve_deployment_request_counter",
              "ray_gptoss_prefix_cache_tokens", "ray_gptoss_prefix_routing", "ray_gptoss_draft_tokens",
              "ray_gptoss_response_store_responses", "ray_gptoss_response_store_conversations",
              "ray_gptoss_response_store_chat_completions",
              "ray_gptoss_response_store_bytes",
              "ray_gptoss_response_store_background_running", "ray_gptoss_response_store_file_bytes",
              "ray_gptoss_response_store_batches_running", "ray_gptoss_api_requests",
              "ray_gptoss_api_tokens"]

    accepted = re.compile(r'ray_gptoss_draft_tokens(_total)?\{[^}]*kind="accepted"')  # (m-1's, once exported)

    def scrape() -> str | None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{ray_ports.metrics}/metrics", timeout=10).read().decode()
        return text if all(name in text for name in wanted) and accepted.search(text) else None

    text = wait_until(scrape, 30, "engine metrics in Ray's Prometheus export", interval_s=1)
    assert re.search(r'ray_gptoss_kv_transfer_bytes_count\{[^}]*deployment="decode"[^}]*transport="object_store"', text)
    assert re.search(r'ray_gptoss_queue_depth\{[^}]*deployment="prefill"', text)
    assert re.search(r'ray_gptoss_kv_usage_ratio\{[^}]*pool="full"', text)
    assert re.search(r'ray_gptoss_steps(_total)?\{[^}]*launch="sync"', text)  # CPU replicas: no lookahead
    assert re.search(r'ray_gptoss_forwards(_total)?\{[^}]*path="eager"', text)  # CPU replicas: no CUDA graphs
    # prefix caching and routing are on by default: the prefill deployment's router sits in the decode replica
    assert re.search(r'ray_gptoss_prefix_cache_tokens(_total)?\{[^}]*kind="query"', text)
    assert re.search(r'ray_gptoss_prefix_routing(_total)?\{[^}]*deployment="PrefillServer"[^}]*outcome=', text) or \
        re.search(r'ray_gptoss_prefix_routing(_total)?\{[^}]*outcome="[a-z_]+"[^}]*deployment="PrefillServer"', text)
    # the ingress' usage accounting of the earlier HTTP requests: per model, endpoint and API key (its hash)
    from serve_app.openai_api.auth import key_id

    usage = [line for line in text.splitlines() if line.startswith("ray_gptoss_api_tokens")
             and 'endpoint="chat.completions"' in line and f'key="{key_id(KEY.encode())}"' in line
             and 'kind="prompt"' in line and f'model="{CONFIG.served_model_name}"' in line]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) > 0, usage
    assert KEY not in text  # the key itself is never a label

    # The Grafana dashboard (serve_app/grafana.py) and the alerting rules (serve_app/alerts.py) against this scrape:
    # their series are these names, and every label a query groups, joins or filters by is on the series' lines.
    # The ingress replica (on this head node) installed the dashboard.
    from serve_app import alerts, grafana

    present = {name for name in grafana.series_names() if re.search(rf"^{name}\{{", text, re.M)}
    # all but the host tier's pages and the fallbacks, which this app's traffic need not produce
    exercised = {f"ray_gptoss_{n}" for n in (
        "api_requests_total", "api_tokens_total", "ttft_seconds_bucket", "tpot_seconds_bucket", "tokens_total",
        "queue_depth", "running_requests", "kv_usage_ratio", "prefix_cache_tokens_total", "kv_transfer_seconds_bucket",
        "kv_transfer_bytes_sum", "draft_tokens_total", "steps_total", "forwards_total", "prefix_routing_total",
        "response_store_responses", "response_store_conversations", "response_store_chat_completions",
        "response_store_bytes",
        "response_store_background_running", "response_store_file_bytes", "response_store_batches_running",
        "stream_items_total")}
    assert exercised <= grafana.series_names() and exercised <= present, exercised - present
    for expr in grafana.expressions() + [a.expr for a in alerts.ALERTS]:
        for series, used in grafana.query_labels(expr).items():
            if series not in present:
                continue
            line = re.search(rf"^{series}\{{([^}}]*)\}}", text, re.M).group(1)
            carried = set(re.findall(r'(\w+)="', line))
            assert used <= carried, (series, used - carried)
    installed = grafana.session_dashboard_dir(ray._private.worker._global_node.get_session_dir_path())
    assert (installed / grafana.FILE_NAME).exists(), list(installed.iterdir())


def test_api_keys_guard_the_v1_paths(http_port):
    """ingress.api_keys reach the ingress replica: /v1/ needs one of them, /health does not."""
    def models(key: str) -> list[str]:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=key, max_retries=0, timeout=30)
        return [m.id for m in api.models.list()]

    assert models("sk-e2e-second") == [CONFIG.served_model_name]
    with pytest.raises(openai.AuthenticationError) as err:
        models("sk-e2e-third")
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10).status == 200


def test_x_request_id_is_serves_one_value(http_port):
    """Serve's proxy gives each request an x-request-id (or keeps the client's) and returns it; the app adds no
    second value (the openai client's `_request_id` would read both, comma-joined)."""
    import httpx

    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    body = dict(CHAT, max_tokens=2)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url, json=body, headers=auth, timeout=60)
    assert r.status_code == 200 and r.headers.get_list("x-request-id") and "," not in r.headers["x-request-id"]
    r = httpx.post(url, json=body, headers={**auth, "x-request-id": "trace-e2e-1"}, timeout=60)
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["trace-e2e-1"]

    # the decode replica's summary line of that request carries the same id
    logs = pathlib.Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    # the request's end line (its K/V transfer line, logged just before it, carries the same ids)
    def summary() -> list[str]:
        return [line for path in logs.glob(f"replica_{APP}_{DECODE_NAME}_*.log")
                for line in path.read_text().splitlines()
                if "trace-e2e-1" in line and r.json()["id"] in line and ": length after" in line]

    lines = wait_until(summary, 10, "the decode replica's summary line for the request")
    assert re.search(r": length after [\d.]+ s; prompt \d+ tokens \(\d+ cached, prefill remote on this node, K/V via [\w-]+\), "
                     r"output 2 tokens, first token [\d.]+ s, [\d.]+ tok/s after it", lines[-1]), lines


def test_stored_responses_continue_and_can_be_read_and_deleted(http_port):
    """The ResponseStore deployment: a continuation (previous_response_id) is the same request as the whole
    conversation sent again (same input tokens, same greedy output), GET returns the stored response, DELETE
    drops it."""
    api = client(http_port)
    params = dict(model=CONFIG.served_model_name, temperature=0, max_output_tokens=6)
    first = api.responses.create(input="Hi there", **params)
    second = api.responses.create(input="Tell me more", previous_response_id=first.id, **params)
    whole = [{"role": "user", "content": "Hi there"}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "Tell me more"}]
    again = api.responses.create(input=whole, store=False, **params)
    assert second.usage.input_tokens == again.usage.input_tokens > first.usage.input_tokens
    assert [item.model_dump(exclude={"id"}) for item in second.output if item.type != "function_call"] == \
        [item.model_dump(exclude={"id"}) for item in again.output if item.type != "function_call"]
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
    api.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)
    store = serve.get_deployment_handle(RESPONSE_STORE_NAME, APP).stats.remote().result()
    assert store["responses"] >= 1 and store["max_responses"] == CONFIG.ingress.store_max_responses

    # A chat completion with store=true, on the same deployment (stored_chat.py): read, listed, updated, deleted.
    chat = api.chat.completions.create(**CHAT, temperature=0, max_tokens=6, store=True, metadata={"run": "e2e"})
    assert api.chat.completions.retrieve(chat.id).choices == chat.choices
    assert [c.id for c in api.chat.completions.list(metadata={"run": "e2e"})] == [chat.id]
    assert [m.role for m in api.chat.completions.messages.list(chat.id)] == [m["role"] for m in CHAT["messages"]]
    assert api.chat.completions.update(chat.id, metadata={"run": "done"}).metadata == {"run": "done"}
    assert serve.get_deployment_handle(RESPONSE_STORE_NAME, APP).stats.remote().result()["chat_completions"] == 1
    assert api.chat.completions.delete(chat.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.retrieve(chat.id)


def test_conversations_through_the_response_store(http_port):
    """/v1/conversations on the ResponseStore deployment: a second turn in a conversation is the same request as the
    conversation sent whole (same input tokens, same greedy output), and the conversation lists both turns."""
    api = client(http_port)
    params = dict(model=CONFIG.served_model_name, temperature=0, max_output_tokens=6)
    conv = api.conversations.create(items=[{"role": "developer", "content": "Be brief."}])
    first = api.responses.create(input="Hi there", conversation=conv.id, **params)
    second = api.responses.create(input="Tell me more", conversation=conv.id, **params)
    whole = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
             *[item.model_dump(exclude_none=True) for item in first.output], {"role": "user", "content": "Tell me more"}]
    again = api.responses.create(input=whole, store=False, **params)
    assert second.usage.input_tokens == again.usage.input_tokens > first.usage.input_tokens
    assert [item.model_dump(exclude={"id"}) for item in second.output if item.type != "function_call"] == \
        [item.model_dump(exclude={"id"}) for item in again.output if item.type != "function_call"]
    items = api.conversations.items.list(conv.id, order="asc", limit=100).data
    assert len(items) == 3 + len(first.output) + len(second.output) and items[-1].id == second.output[-1].id
    store = serve.get_deployment_handle(RESPONSE_STORE_NAME, APP).stats.remote().result()
    assert store["conversations"] >= 1
    api.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        api.conversations.retrieve(conv.id)


def test_a_batch_through_serve_gives_the_apis_answers(http_port):
    """/v1/files and /v1/batches on Ray Serve: the upload through Serve's proxy, the batch run by the ingress replica
    at batch priority through the prefill and decode deployments; each 2xx line's body is the answer the same request
    gets over HTTP (greedy), a refused line is in the error file."""
    api = client(http_port)
    bodies = {"hi": {**CHAT, "temperature": 0, "max_tokens": 6},
              "two": {**CHAT, "messages": [{"role": "user", "content": "Count to three."}], "temperature": 0,
                      "max_tokens": 5, "n": 2},
              "hot": {**CHAT, "temperature": 9}}
    text = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
                   for cid, body in bodies.items())
    source = api.files.create(file=("batch.jsonl", text.encode()), purpose="batch")
    assert api.files.content(source.id).text == text
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(lambda: (b := api.batches.retrieve(batch.id)).status not in ("validating", "in_progress",
                                                                                  "finalizing") and b, 60,
                      "the batch to end", interval_s=0.2)
    assert done.status == "completed" and done.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    out = {line["custom_id"]: line["response"] for line in map(json.loads, api.files.content(done.output_file_id)
                                                                .text.splitlines())}
    for cid in ("hi", "two"):
        want = api.chat.completions.create(**bodies[cid])
        got = out[cid]["body"]
        assert out[cid]["status_code"] == 200 and out[cid]["request_id"]
        assert [c["message"]["content"] for c in got["choices"]] == [c.message.content for c in want.choices], cid
        assert got["usage"]["completion_tokens"] == want.usage.completion_tokens, cid
    [refused] = map(json.loads, api.files.content(done.error_file_id).text.splitlines())
    assert refused["custom_id"] == "hot" and refused["response"]["status_code"] == 400
    stats = serve.get_deployment_handle(RESPONSE_STORE_NAME, APP).stats.remote().result()
    assert stats["files"] >= 3 and stats["batches_running"] == 0 and stats["file_bytes"] > len(text)


def test_a_batch_outlives_its_ingress_replica(http_port):
    """The ingress replica running a batch and a background response dies (killed) with the batch's short lines
    answered and its long ones, and the response, in flight: Serve replaces it, and the replacement adopts both at a
    health check once the store has gone ingress.store_orphan_s (6 s here) without word, running the lines that had no
    answer and the response again from the start. Each custom_id answers once; the short lines' answers are the dead
    replica's (not run again); the response ends, under its id and creation time. A streamed background response in
    flight too: its client's stream breaks with the replica, resumes from the replacement (starting_after), and the
    adopter goes on from the events stored: every event once, in order, each item's text its deltas."""
    api = client(http_port)
    params = dict(model=CONFIG.served_model_name, input="Hi there", temperature=0, max_output_tokens=900)
    response = api.responses.create(background=True, **params)
    streamed, seen = api.responses.create(background=True, stream=True, **params), []
    for ev in streamed:
        seen.append(ev)
        if ev.type in ("response.output_text.delta", "response.reasoning_text.delta") and len(seen) >= 8:
            break
    streamed.close()  # (the run goes on)

    def line(cid: str, max_tokens: int) -> str:
        body = {**CHAT, "messages": [{"role": "user", "content": f"Tell a story about {cid}."}], "temperature": 0,
                "max_tokens": max_tokens, "ignore_eos": True}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"

    short, long = [f"short{i}" for i in range(3)], [f"long{i}" for i in range(3)]
    text = "".join([line(cid, 2) for cid in short] + [line(cid, 900) for cid in long])
    source = api.files.create(file=("survive.jsonl", text.encode()), purpose="batch")
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    started = wait_until(lambda: (b := api.batches.retrieve(batch.id)).request_counts.completed >= 3 and b, 60,
                         "the short lines' answers in the store", interval_s=0.1)
    assert started.status == "in_progress" and started.request_counts.completed < 6, started
    assert api.responses.retrieve(response.id).status == "in_progress"
    [(old_name, old_actor)] = replica_actors(APP, INGRESS_NAME)
    ray.kill(old_actor, no_restart=True)

    def ended():
        try:
            found = api.batches.retrieve(batch.id)
        except (openai.APIStatusError, openai.APIConnectionError):  # no ingress replica serving yet
            return None
        return found if found.status not in ("validating", "in_progress", "finalizing") else None

    done = wait_until(ended, 150, "a replacement ingress replica to adopt and finish the batch", interval_s=1.0)
    assert [n for n, _ in replica_actors(APP, INGRESS_NAME)] != [old_name]
    assert done.status == "completed" and done.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    answers = [json.loads(raw) for raw in api.files.content(done.output_file_id).text.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == sorted(short + long)
    assert {a["custom_id"] for a in answers[:3]} == set(short)  # written by the dead replica, kept first
    assert all(a["response"]["body"]["usage"]["completion_tokens"] == 900 for a in answers[3:])
    again = wait_until(lambda: (r := api.responses.retrieve(response.id)).status not in ("queued", "in_progress") and r,
                       60, "the adopted background response to end", interval_s=0.5)
    # (killed in progress, it ended: another replica ran it; not compared token for token with a foreground run, as
    # the CPU model's greedy tokens may differ with the batch they run in)
    assert (again.id, again.created_at) == (response.id, response.created_at)
    assert again.status in ("completed", "incomplete") and again.output and again.usage.output_tokens > 0, again
    events = seen + list(api.responses.retrieve(seen[0].response.id, stream=True,
                                                starting_after=seen[-1].sequence_number))
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    final = api.responses.retrieve(seen[0].response.id)
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete"), final
    added = [ev.item.id for ev in events if ev.type == "response.output_item.added"]
    assert added == [item.id for item in final.output]
    for item in final.output:
        text = parts[0].text if (parts := getattr(item, "content", None)) else None
        assert text is None or text == "".join(ev.delta for ev in events if getattr(ev, "item_id", None) == item.id
                                               and ev.type.endswith("_text.delta")), item
    assert final.usage.output_tokens <= 900 and final.usage.input_tokens == again.usage.input_tokens
    stats = serve.get_deployment_handle(RESPONSE_STORE_NAME, APP).stats.remote().result()
    assert (stats["responses_adopted"], stats["batches_adopted"]) == (2, 1)  # each taken over once


def test_the_store_replica_restarts_with_what_it_had(http_port):
    """With ingress.store_path, a store replica that dies (killed here) is replaced by one that reads the file: the
    stored response and the conversation are still there, and the conversation goes on."""
    api = client(http_port)
    params = dict(model=CONFIG.served_model_name, temperature=0, max_output_tokens=4)
    first = api.responses.create(input="Hi there", **params)
    conv = api.conversations.create(items=[{"role": "user", "content": "Remember this."}])
    kept = api.files.create(file=("kept.jsonl", b'{"kept": 1}\n'), purpose="batch")
    [(old_name, old_actor)] = replica_actors(APP, RESPONSE_STORE_NAME)
    ray.kill(old_actor, no_restart=True)

    def restarted():
        if [n for n, _ in replica_actors(APP, RESPONSE_STORE_NAME)] in ([], [old_name]):
            return None
        try:
            return api.responses.retrieve(first.id)
        except openai.APIStatusError:  # the replacement is not serving yet: a 503 from the ingress
            return None

    again = wait_until(restarted, 90, "a replacement store replica")
    assert again.model_dump() == first.model_dump()
    assert api.conversations.retrieve(conv.id).id == conv.id
    assert api.files.content(kept.id).text == '{"kept": 1}\n' and api.files.retrieve(kept.id) == kept
    second = api.responses.create(input="And now?", conversation=conv.id, **params)
    assert second.conversation.id == conv.id
    assert len(api.conversations.items.list(conv.id).data) == 2 + len(second.output)


def test_background_responses_through_the_response_store(http_port):
    """background=true on real Ray: answered `queued` at once, the polled result is the foreground answer; streamed,
    its events read back through the store replica and resumed from the middle; a long one cancelled through the API
    stops in the decode engine and keeps what it generated."""
    api = client(http_port)
    params = dict(model=CONFIG.served_model_name, input="Hi there", temperature=0, max_output_tokens=6)
    queued = api.responses.create(background=True, **params)
    assert (queued.status, queued.background) == ("queued", True)
    deadline = time.monotonic() + 60
    while (done := api.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.05)
    foreground = api.responses.create(**params)
    assert done.status == foreground.status and done.usage.output_tokens == foreground.usage.output_tokens == 6
    assert [item.model_dump(exclude={"id", "call_id"}) for item in done.output] == \
        [item.model_dump(exclude={"id", "call_id"}) for item in foreground.output]
    # streamed: the events come back through the store replica; a resume from the middle continues them
    events = list(api.responses.create(background=True, stream=True, **params))
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[-1].type == f"response.{done.status}"  # incomplete: 6
    assert events[-1].response.usage.output_tokens == 6
    middle = len(events) // 2
    resumed = list(api.responses.retrieve(events[0].response.id, stream=True, starting_after=middle))
    assert [ev.model_dump() for ev in resumed] == [ev.model_dump() for ev in events[middle + 1:]]

    long = api.responses.create(background=True, **dict(params, max_output_tokens=900))
    while api.responses.retrieve(long.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = api.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 900
    wait_until(lambda: stats(DECODE_NAME)["num_running"] == 0, 10, "the cancelled request to leave the engine")
    assert api.responses.retrieve(long.id).status == "cancelled"


def test_refused_request_is_an_invalid_request_error(http_port):
    from engine.request import InvalidRequestError
    from serve_app.ingress import ServeTokenBackend

    backend = ServeTokenBackend(serve.get_deployment_handle(DECODE_NAME, APP), max_context=1024)
    bad = GenerateRequest("bad-1", [], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError) as err:
        run_async(collect(backend.generate(bad)))
    assert err.value.param == "prompt_ids"  # the engine's own error, not a wrapped RayTaskError


def test_client_disconnect_aborts_the_request_in_decode(http_port):
    import httpx

    before = stats(DECODE_NAME)["requests_finished_total"].get("abort", 0)
    body = dict(CHAT, temperature=0, max_tokens=900, stream=True)
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    break  # leave mid-stream: closing the connection must free the engine's slot

    def aborted() -> bool:
        s = stats(DECODE_NAME)
        return (s["requests_finished_total"].get("abort", 0) == before + 1 and s["num_running"] == 0
                and s["full_pages_free"] == s["full_pages_total"])

    wait_until(aborted, 8, "the decode engine to abort the abandoned request")  # 900 tokens would take longer


def test_a_full_decode_queue_refuses_at_once_with_503_and_retry_after(http_port):
    """decode.max_queued_requests: with the decode replica busy and its queue full, requests are refused before
    they run (OpenAI's error shape, Retry-After), the accepted ones finish, and nothing stays held. A second
    app on this Ray, below a route prefix, deleted afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    app = "overload"
    args = {"max_context": "1024", "kv_cache_memory_gib": "0.0625", "disaggregated": "false",
            "decode.num_replicas": "1", "decode.max_ongoing_requests": "1", "decode.max_queued_requests": "1",
            "decode.graceful_shutdown_timeout_s": "1", "ingress.conversation_start_date": "2026-11-29",
            "ingress.stream_keepalive_s": "0.3"}
    serve.run(build_app(args), name=app, route_prefix="/overload")
    try:
        url = f"http://127.0.0.1:{http_port}/overload/v1/chat/completions"
        body = dict(CHAT, temperature=0, max_tokens=400, ignore_eos=True)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: httpx.post(url, json=body, timeout=120), range(6)))
        refused = [r for r in answers if r.status_code == 503]
        done = [r for r in answers if r.status_code == 200]
        # at least the first is accepted; Ray counts a request as queued until a replica takes it, so with
        # all six arriving at once the waiting slot may be filled by the first itself (seen: 1 accepted, 5 refused)
        assert len(refused) + len(done) == 6 and done and refused, [r.status_code for r in answers]
        for r in refused:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
            assert "backpressure" in error["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in done)
        decode = serve.get_deployment_handle(DECODE_NAME, app)
        wait_until(lambda: (lambda s: s["num_running"] == 0 and s["full_pages_free"] == s["full_pages_total"])(
            decode.stats.remote().result()), 10, "the overload app's decode engine to hold nothing")
        assert decode.stats.remote().result()["requests_finished_total"].get("abort", 0) == 0  # refused, never run

        # ingress.stream_keepalive_s: a stream queued behind a running request starts (200) and sends keep-alive
        # comments through Serve's proxy until its first token
        def queued_stream() -> tuple[int, list[str], float]:
            with httpx.stream("POST", url, json=dict(CHAT, max_tokens=8, stream=True), timeout=120) as r:
                lines, first_keepalive = [], math.inf
                for line in filter(None, r.iter_lines()):
                    lines.append(line)
                    if line == ": keep-alive":
                        first_keepalive = min(first_keepalive, time.monotonic())
                return r.status_code, lines, first_keepalive

        # (decode's stats() would wait in the same queue: the long request's second chunk says it is running)
        with ThreadPoolExecutor(1) as pool, \
                httpx.stream("POST", url, json=dict(body, max_tokens=600, stream=True), timeout=120) as long:
            long_lines = (line for line in long.iter_lines() if line.startswith("data: "))
            next(long_lines), next(long_lines)
            queued = pool.submit(queued_stream)
            assert list(long_lines)[-1] == "data: [DONE]"
            long_done = time.monotonic()
            status, lines, first_keepalive = queued.result()
        assert status == 200 and lines[0].startswith("data: ") and lines[-1] == "data: [DONE]", lines
        assert first_keepalive < long_done  # passed on as sent, not held back until the answer
        second_data = next(i for i, line in enumerate(lines) if i > 0 and line.startswith("data: "))
        assert lines[1:second_data].count(": keep-alive") >= 2, lines  # waited through at least 0.9 s
    finally:
        serve.delete(app)


def test_a_full_prefill_queue_sends_prompts_to_decode(http_port):
    """prefill.max_queued_requests: prompts the prefill replica's queue refuses run on the decode replica
    (fallback reason `prefill_overloaded`); every request is answered. A second app, deleted afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    app = "prefill-overload"
    args = {"max_context": "1024", "kv_cache_memory_gib": "0.0625", "decode.num_replicas": "1",
            "prefill.num_replicas": "1", "prefill.max_ongoing_requests": "1", "prefill.max_queued_requests": "1",
            "decode.graceful_shutdown_timeout_s": "1", "prefill.graceful_shutdown_timeout_s": "1",
            "ingress.conversation_start_date": "2026-11-29"}
    serve.run(build_app(args), name=app, route_prefix="/prefill-overload")
    try:
        url = f"http://127.0.0.1:{http_port}/prefill-overload/v1/chat/completions"
        bodies = [dict(CHAT, temperature=0, max_tokens=4, ignore_eos=True,
                       messages=[{"role": "user", "content": f"Request {i}: " + "word " * 300}]) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda body: httpx.post(url, json=body, timeout=120), bodies))
        assert [r.status_code for r in answers] == [200] * 8
        s = serve.get_deployment_handle(DECODE_NAME, app).stats.remote().result()
        assert s["fallback_reasons"].get("prefill_overloaded", 0) >= 1, s
        assert s["transfers"] + s["fallbacks"] == 8 and s["transfers"] >= 1, s
    finally:
        serve.delete(app)


def test_two_models_behind_one_api(http_port):
    """`models`: two models (here the same tiny weights under two names and contexts), one endpoint; each request
    runs on its model's decode deployment, /v1/models lists both, a stored response of one continues on the other.
    A second app, deleted after."""
    app = "two"
    args = {"models": [{"served_model_name": "small"}, {"served_model_name": "large", "max_context": 512}],
            "max_context": "1024", "kv_cache_memory_gib": "0.0625", "disaggregated": "false",
            "decode.num_replicas": "1", "decode.graceful_shutdown_timeout_s": "1",
            "ingress.conversation_start_date": "2026-11-29"}
    serve.run(build_app(args), name=app, route_prefix="/two")
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/two/v1", api_key="unused", max_retries=0,
                            timeout=60)
        assert [(m.id, m.model_extra["max_model_len"]) for m in api.models.list().data] == \
            [("small", 1024), ("large", 512)]
        chat = dict(messages=CHAT["messages"], temperature=0, max_tokens=8)
        answers = {name: api.chat.completions.create(model=name, **chat) for name in ("small", "large", "large")}
        assert answers["small"].choices[0].message == answers["large"].choices[0].message  # same weights, greedy
        # the same weights and numerics (the context limit is capacity, not numerics): one fingerprint
        assert answers["small"].system_fingerprint == answers["large"].system_fingerprint
        finished = {name: serve.get_deployment_handle(f"{DECODE_NAME}-{name}", app).stats.remote().result()
                    ["requests_finished_total"] for name in ("small", "large")}
        assert (sum(finished["small"].values()), sum(finished["large"].values())) == (1, 2), finished
        first = api.responses.create(model="small", input="Hi there", max_output_tokens=4, temperature=0)
        second = api.responses.create(model="large", input="More", previous_response_id=first.id,
                                      max_output_tokens=4, temperature=0)
        assert second.model == "large" and second.usage.input_tokens > first.usage.input_tokens
        with pytest.raises(openai.NotFoundError, match="'small', 'large'"):
            api.chat.completions.create(model="medium", **chat)
    finally:
        serve.delete(app)


POISON_TOKEN = 1234  # a prompt holding this token id makes SickDecode's injected device fault fire


class SickDecode(DecodeServer):
    """A decode replica whose forward fails as on a lost GPU (every CUDA call raises from then on) once a prompt
    holds POISON_TOKEN."""

    async def __init__(self, prefill, config):
        await super().__init__(prefill, config)
        runner = self.engine.engine.runner
        forward = runner.execute

        def execute(inputs):
            if POISON_TOKEN in inputs.input_ids.tolist():
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
            return forward(inputs)

        runner.execute = execute


def test_an_unhealthy_decode_replica_refuses_requests_and_serve_replaces_it(http_port):
    """check_health: after a device error the replica refuses requests (503 engine_unavailable, Retry-After),
    fails Serve's health checks and is replaced by a fresh replica that serves. A second app, deleted after."""
    from serve_app.ingress import HarmonyIngress

    app, name = "sick", "SickDecode"
    config = ServeAppConfig.from_args({"max_context": "1024", "kv_cache_memory_gib": "0.0625", "disaggregated": "false",
                                       "decode.num_replicas": "1", "decode.health_check_period_s": "4",
                                       "decode.graceful_shutdown_timeout_s": "1"})
    decode = serve.deployment(SickDecode, name=name, **deployment_options(config, config.decode, "cpu",
                                                                           "object_store")).bind(None, config)
    ingress = serve.deployment(HarmonyIngress, name="SickIngress", num_replicas=1, ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(decode, config.served_model_name, 1024, config.ingress, None), name=app,
              route_prefix="/sick")
    try:
        sick = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/sick/v1", api_key="unused", max_retries=0,
                             timeout=60)
        complete = lambda prompt: sick.completions.create(model=config.served_model_name, prompt=prompt,  # noqa: E731
                                                           max_tokens=3)
        assert complete([5, 6, 7]).choices[0].finish_reason == "length"
        [(old_name, _)] = replica_actors(app, name)
        with pytest.raises(openai.InternalServerError) as failed:
            complete([POISON_TOKEN, 8, 9])
        assert failed.value.status_code == 503 and "illegal memory access" in failed.value.message
        # Serve replaces a replica after 3 failed health checks in a row: 8-12 s from the fault with checks every
        # 4 s (every 1 s, a loaded 2-core CI machine once took longer than that to send the next request)
        with pytest.raises(openai.InternalServerError) as refused:
            complete([5, 6, 7])
        assert refused.value.body["code"] == "engine_unavailable"
        assert refused.value.response.headers["retry-after"] == "1"
        assert "AcceleratorError" in refused.value.message
        wait_until(lambda: running_replicas(app, name) == 1 and
                   [n for n, _ in replica_actors(app, name)] not in ([], [old_name]), 90, "a replacement replica")
        assert complete([5, 6, 7]).choices[0].finish_reason == "length"
    finally:
        serve.delete(app)


def test_decode_replica_killed_mid_stream(http_port, reference_port):
    request = dict(CHAT, temperature=0, max_tokens=600)
    want = client(reference_port).chat.completions.create(**request)
    assert want.choices[0].finish_reason == "length"  # long enough to be killed in the middle
    [(old_name, old_actor)] = replica_actors(APP, DECODE_NAME)
    stream = client(http_port).chat.completions.create(**request, stream=True)
    received, t0 = 0, time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 3:
                    ray.kill(old_actor, no_restart=True)
    assert time.monotonic() - t0 < 60 and received >= 3
    assert "engine failed" in str(failure.value).lower() or "retry" in str(failure.value).lower()

    # Serve starts a replacement; the next request succeeds and is still exact.
    wait_until(lambda: running_replicas(APP, DECODE_NAME) == 1 and
               [n for n, _ in replica_actors(APP, DECODE_NAME)] not in ([], [old_name]), 90,
               "a replacement decode replica")
    again = client(http_port).chat.completions.create(**CHAT, temperature=0, max_tokens=24)
    assert again.choices[0].message.content == client(reference_port).chat.completions.create(
        **CHAT, temperature=0, max_tokens=24).choices[0].message.content
