"""`gptoss run-batch` (serve_app/run_batch.py): an OpenAI Batch API file through the app in-process. Its answers are
the HTTP server's for the same bodies (a real tiny Harmony checkpoint, greedy); a bad file is refused whole, naming
its lines, before anything runs; an app that fails a request is counted and the exit status says so."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.async_engine import AsyncEngine
from engine.cli import build_parser, engine_config_of, main
from engine.fingerprint import checkpoint_identity, system_fingerprint
from engine.llm_engine import LLMEngine
from model.tiny import make_tiny
from serve_app.openai_api.app import create_app
from serve_app.run_batch import BatchLine, BatchSummary, run_batch
from tests.serve_app.conftest import LiveServer

DATE = "2026-01-02"
ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-mb", "16", "--max-num-seqs", "4", "--max-num-batched-tokens",
                "256", "--conversation-start-date", DATE]
CHAT = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
BODIES = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-n2": ("/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 6, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about KV caches."}]}),
    "text": ("/v1/completions", {"model": "gpt-oss", "prompt": "Hello there", "max_tokens": 7, "temperature": 0}),
    "resp": ("/v1/responses", {"model": "gpt-oss", "input": "Hi", "max_output_tokens": 9, "temperature": 0}),
    "wrong-model": ("/v1/chat/completions", {**CHAT, "model": "gpt-5"}),
    "bad-value": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    "continues": ("/v1/responses", {"model": "gpt-oss", "input": "More", "previous_response_id": "resp_1"}),
}
VOLATILE = ("id", "created", "created_at", "completed_at")


def write_batch(path, bodies=BODIES) -> None:
    path.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                            for cid, (url, body) in bodies.items()))


def stable(body: dict) -> dict:
    """The body without what differs between two runs of one request (ids, times)."""
    out = {k: v for k, v in body.items() if k not in VOLATILE}
    if "output" in out:  # Responses: item ids
        out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-batch")
    make_tiny(folder, dtype="float32", seed=5)
    return folder


def test_results_are_the_http_servers_answers(checkpoint, tmp_path, capsys):
    source, target = tmp_path / "in.jsonl", tmp_path / "out" / "results.jsonl"
    write_batch(source)
    assert main(["run-batch", str(source), str(target), str(checkpoint), "--dtype", "float32", "--concurrency", "3",
                 *ENGINE_FLAGS]) == 0
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    results = {line["custom_id"]: line for line in lines}
    assert len(lines) == len(results) == len(BODIES) and all(line["id"].startswith("batch_req_") for line in lines)
    assert {cid: r["response"]["status_code"] for cid, r in results.items()} == {
        "chat": 200, "chat-n2": 200, "text": 200, "resp": 200, "wrong-model": 404, "bad-value": 400, "continues": 400}
    assert all(r["error"] is None for r in results.values())
    ids = [r["response"]["request_id"] for r in results.values()]  # refusals carry one too, all distinct
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
    assert results["bad-value"]["response"]["body"]["error"]["param"] == "temperature"
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "7/7 requests (4 x 200, 2 x 400, 1 x 404)" in summary and str(target) in summary

    # The same bodies over HTTP to the server's app on an engine of the same settings give the same answers.
    args = build_parser().parse_args(["generate", str(checkpoint), "--dtype", "float32",
                                      *[f for f in ENGINE_FLAGS if f != "--conversation-start-date" and f != DATE]])
    config = engine_config_of(args, 512, seed=0)
    engine = LLMEngine.from_checkpoint(checkpoint, config)
    backend = AsyncEngine(engine)
    fingerprint = system_fingerprint(config, engine.model.config, checkpoint_identity(checkpoint), "cpu")
    try:
        import httpx

        with LiveServer(create_app(backend, model_name="gpt-oss", max_context=512, conversation_start_date=DATE,
                                   system_fingerprint=fingerprint)) as s:
            for cid in ("chat", "chat-n2", "text", "resp"):
                url, body = BODIES[cid]
                want = httpx.post(f"{s.url}{url}", json=body, timeout=60).json()
                got = results[cid]["response"]["body"]
                assert stable(got) == stable(want), cid
                assert results[cid]["response"]["request_id"] == got["id"]
    finally:
        backend.shutdown()
        engine.close()
    assert results["chat"]["response"]["body"]["usage"]["completion_tokens"] > 0


def test_a_bad_file_is_refused_whole_before_anything_runs(tmp_path, capsys):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    source.write_text("\n".join([
        json.dumps(good),
        "{not json",
        json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings"}),
        json.dumps({**good, "custom_id": "a"}),
        json.dumps({**good, "custom_id": "c", "method": "GET"}),
        json.dumps({**good, "custom_id": "d", "body": {**CHAT, "stream": True}}),
        json.dumps({**good, "custom_id": ""}),
        "",  # blank lines are skipped
        json.dumps([1, 2]),
    ]) + "\n")
    assert main(["run-batch", str(source), str(target)]) == 2
    err = capsys.readouterr().err
    for line, why in ((2, "not JSON"), (3, "url must be one of"), (4, "custom_id 'a' is already used on line 1"),
                      (5, "method must be POST"), (6, "stream is not supported"), (7, "custom_id must be"),
                      (9, "not a JSON object")):
        assert f"line {line}: {why}" in err, (line, err)
    assert "7 line(s) cannot be run" in err and not target.exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["run-batch", str(empty), str(target)]) == 2 and "no requests" in capsys.readouterr().err
    assert main(["run-batch", str(tmp_path / "missing.jsonl"), str(target)]) == 2


def test_a_request_the_app_fails_is_a_server_failure():
    """run_batch over a stand-in ASGI app: a 500 (an exception in the app) is written as its answer and counted; the
    concurrency bound holds."""
    active, peak = [0], [0]

    async def answer(request):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.01)
        active[0] -= 1
        if (await request.json()).get("fail"):
            raise RuntimeError("boom")
        return JSONResponse({"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    app = Starlette(routes=[Route("/v1/completions", answer, methods=["POST"])])
    lines = [BatchLine(i + 1, f"r{i}", "/v1/completions", {"fail": i == 4}) for i in range(10)]
    out = io.StringIO()
    summary = asyncio.run(run_batch(app, iter(lines), out, BatchSummary(10), concurrency=3, progress=None))
    records = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert records["r4"]["response"]["status_code"] == 500 and summary.server_failures == 1
    assert summary.by_status == {200: 9, 500: 1} and (summary.input_tokens, summary.output_tokens) == (27, 18)
    assert peak[0] == 3


def test_resume_keeps_the_answers_written_and_runs_the_rest(checkpoint, tmp_path, capsys):
    """--resume after a run that stopped: its 2xx / 4xx answers are kept as written (not run again), its server
    failure, a repeated line, a line of another file's custom_id and a last line cut short are dropped, and only the
    requests without a kept answer run; the summary counts both."""
    bodies = {cid: BODIES[cid] for cid in ("chat", "text", "resp", "bad-value")}
    source, target = tmp_path / "in.jsonl", tmp_path / "results.jsonl"
    write_batch(source, bodies)
    kept = {"id": "batch_req_kept", "custom_id": "chat", "error": None, "response": {
        "status_code": 200, "request_id": "chatcmpl-kept", "body": {"usage": {"prompt_tokens": 5,
                                                                             "completion_tokens": 3}}}}
    refused = {"id": "batch_req_400", "custom_id": "bad-value", "error": None,
               "response": {"status_code": 400, "request_id": "r", "body": {"error": {"param": "temperature"}}}}
    failed = {"id": "batch_req_500", "custom_id": "text", "error": None,
              "response": {"status_code": 500, "request_id": "r", "body": {"error": {"message": "boom"}}}}
    lost = {"id": "batch_req_lost", "custom_id": "resp", "response": None,
            "error": {"code": "batch_request_failed", "message": "ConnectError"}}
    target.write_text("".join(json.dumps(line) + "\n" for line in (kept, refused, failed, lost, kept,
                                                                   {**kept, "custom_id": "elsewhere"}))
                      + json.dumps(kept)[:25])
    assert main(["run-batch", str(source), str(target), str(checkpoint), "--dtype", "float32", "--resume",
                 *ENGINE_FLAGS]) == 0
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert lines[:2] == [kept, refused]  # kept as written, first
    assert sorted(line["custom_id"] for line in lines[2:]) == ["resp", "text"]
    assert all(line["response"]["status_code"] == 200 for line in lines[2:])
    err = capsys.readouterr().err
    assert "resuming with 2 answers" in err and "4/4 requests (3 x 200, 1 x 400)" in err.strip().splitlines()[-1]
    assert not (tmp_path / "results.jsonl.resume").exists()
