"""Background responses handed from one ingress replica to another through the store (background_store.py): a
response given back or left silent is adopted by a replica of its model, runs again, and a run that lost its
response can no longer write it; with a store clock the tests move by hand."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from serve_app.openai_api.app import create_app
from serve_app.openai_api.background_store import ADOPT_PATIENCE, MAX_RUNS
from serve_app.openai_api.stored_responses import MemoryResponseStore, StoredResponse
from tests.serve_app.conftest import MODEL, START_DATE
from tests.serve_app.stub_backend import ScriptedBackend

RERUN = {"request": {"model": MODEL, "input": "Hi", "background": True}, "model": MODEL, "priority": 0,
         "caller": {"endpoint": "responses", "key": None}, "runs": 1}


def response(rid: str, status: str = "in_progress", rerun: dict | None = RERUN) -> StoredResponse:
    return StoredResponse({"id": rid, "status": status, "output": [], "error": None, "created_at": 1.0}, [], None,
                          "owner", rerun if status in ("queued", "in_progress") else None)


def store_at(now: list[float], **options) -> MemoryResponseStore:
    return MemoryResponseStore(clock=lambda: now[0], **options)


def test_a_silent_runner_loses_its_response_to_an_adopter():
    now = [0.0]
    store = store_at(now)

    async def main():
        assert await store.put("resp_1", response("resp_1"), "run-a")
        other_model = response("resp_other_model", rerun={**RERUN, "model": "m2"})
        assert await store.put("resp_other_model", other_model, "run-a")
        assert await store.put("resp_streamed", response("resp_streamed", rerun=None), "run-a")
        now[0] = 29.0
        assert await store.adopt_responses("run-b", MODEL) == []  # run-a was heard from 29 s ago
        now[0] = 31.0
        [(rid, adopted)] = await store.adopt_responses("run-b", MODEL)
        assert rid == "resp_1" and adopted.response["status"] == "queued" and adopted.rerun["runs"] == 2
        assert store.responses_adopted == 1
        assert await store.adopt_responses("run-c", MODEL) == []  # run-b holds it now
        # run-a comes back (it was cut off, not dead): its poll says stop, its writes are refused
        assert await store.cancel_requested(["resp_1"], "run-a") == ["resp_1"]
        assert not await store.put("resp_1", response("resp_1", "completed"), "run-a")
        assert (await store.get("resp_1")).response["status"] == "queued"
        assert await store.cancel_requested(["resp_1"], "run-b") == []
        assert await store.put("resp_1", response("resp_1", "in_progress"), "run-b")
        assert await store.put("resp_1", response("resp_1", "completed"), "run-b")
        done = await store.get("resp_1")
        assert done.response["status"] == "completed" and done.rerun is None and "resp_1" not in store._runner_of
        assert not await store.put("resp_1", response("resp_1", "cancelled"), "run-a")  # the lost run's late last word
        assert not await store.put("resp_1", response("resp_1", "completed"), "run-b")  # ended: nothing more
        assert (await store.get("resp_1")) == done
        # the other model's response waits for its own replicas; the streamed one cannot run again: it fails at once
        assert [rid for rid, _ in await store.adopt_responses("run-m2", "m2")] == ["resp_other_model"]
        assert (await store.get("resp_streamed")).response["status"] == "failed"

    asyncio.run(main())


def test_release_then_adopt_at_once_and_what_cannot_be_released():
    now = [0.0]
    store = store_at(now)

    async def main():
        for rid in ("resp_1", "resp_cancelled", "resp_streamed"):
            await store.put(rid, response(rid, rerun=None if rid == "resp_streamed" else RERUN), "run-a")
        assert not await store.release_response("resp_1", "run-x")  # not its runner
        assert not await store.release_response("resp_streamed", "run-a")  # no rerun: the caller stores it failed
        assert not await store.release_response("resp_missing", "run-a")
        assert await store.request_cancel("resp_cancelled")
        assert not await store.release_response("resp_cancelled", "run-a")  # its run stores `cancelled`
        assert await store.release_response("resp_1", "run-a")
        assert (await store.get("resp_1")).response["status"] == "queued"
        await store.put("resp_2", response("resp_2"), "run-a")
        assert await store.release_response("resp_2", "run-a")
        assert await store.request_cancel("resp_2")  # no replica runs it: cancelled at once, never adopted
        assert (await store.get("resp_2")).response["status"] == "cancelled" and store.running() == 3
        [(rid, _)] = await store.adopt_responses("run-b", MODEL)  # at once, no silence needed
        assert rid == "resp_1"
        await store.put("resp_3", response("resp_3"), "run-a")
        assert await store.release_response("resp_3", "run-a") and await store.delete("resp_3")
        assert "resp_3" not in store._cancel and await store.adopt_responses("run-b", MODEL) == [] and \
            await store.get("resp_3") is None  # deleted while given back: gone, nothing left to stop
        assert await store.put("resp_1", response("resp_1", "in_progress"), "run-b")

    asyncio.run(main())


def test_a_response_run_too_often_or_adopted_by_no_one_fails():
    now = [0.0]
    store = store_at(now)

    async def main():
        await store.put("resp_loop", response("resp_loop"), "run-0")
        for n in range(1, MAX_RUNS):
            assert await store.release_response("resp_loop", f"run-{n - 1}")
            [(_, adopted)] = await store.adopt_responses(f"run-{n}", MODEL)
            assert adopted.rerun["runs"] == n + 1
        assert await store.release_response("resp_loop", f"run-{MAX_RUNS - 1}")
        assert await store.adopt_responses("run-last", MODEL) == []
        failed = await store.get("resp_loop")
        assert failed.response["status"] == "failed"
        assert f"started {MAX_RUNS} times" in failed.response["error"]["message"]
        assert failed.rerun is None and store.running() == 0
        # no replica of its model asks: failed after ADOPT_PATIENCE x orphan_after_s; one that cannot run again after 1x
        await store.put("resp_waits", response("resp_waits"), "run-a")
        await store.put("resp_streamed", response("resp_streamed", rerun=None), "run-a")
        now[0] = 31.0
        assert await store.sweep_orphans() == 1 and (await store.get("resp_streamed")).response["status"] == "failed"
        now[0] = 30.0 * ADOPT_PATIENCE - 1
        assert await store.sweep_orphans() == 0 and (await store.get("resp_waits")).response["status"] == "in_progress"
        now[0] = 30.0 * ADOPT_PATIENCE + 1
        assert await store.sweep_orphans() == 1 and (await store.get("resp_waits")).response["status"] == "failed"

    asyncio.run(main())


def test_the_request_to_run_again_survives_a_store_restart(tmp_path):
    from serve_app.openai_api.store_file import StoreFile

    now = [0.0]
    path = tmp_path / "store.db"

    async def main():
        first = store_at(now, file=StoreFile(str(path)))
        await first.put("resp_1", response("resp_1"), "run-a")
        await first.put("resp_done", response("resp_done", "completed"), "run-a")
        second = store_at(now, file=StoreFile(str(path)))  # a restart: read back, watched afresh
        back = await second.get("resp_1")
        assert back.rerun == RERUN and (await second.get("resp_done")).rerun is None
        assert await second.cancel_requested(["resp_1"], "run-a") == []  # run-a's first word names it again
        assert await second.adopt_responses("run-b", MODEL) == []
        now[0] = 31.0
        assert [rid for rid, _ in await second.adopt_responses("run-b", MODEL)] == ["resp_1"]

    asyncio.run(main())


def test_a_response_whose_request_no_longer_runs_is_failed_by_its_adopter():
    """The response it continued was deleted while it waited: the adopter stores it failed (invalid_prompt)."""
    backend, store = ScriptedBackend(), MemoryResponseStore()
    first, second = (create_app(backend, model_name=MODEL, max_context=backend.max_context,
                                conversation_start_date=START_DATE, response_store=store) for _ in range(2))
    answer = "<|channel|>final<|message|>Done.<|return|>"

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://a") as a:
            backend.push(answer)
            head = (await a.post("/v1/responses", json={"model": MODEL, "input": "Hi"})).json()
            backend.push("<|channel|>final<|message|>" + "word " * 200 + "<|return|>", delay_s=0.05)
            created = (await a.post("/v1/responses", json={"model": MODEL, "input": "More", "background": True,
                                                           "previous_response_id": head["id"]})).json()
            await first.state.background.stop(wait_s=0.2)
            assert (await a.delete(f"/v1/responses/{head['id']}")).status_code == 200
        assert await second.state.background.adopt() == [created["id"]]
        for _ in range(200):  # (the adopted run is set up in a task of its own)
            if (stored := await store.get(created["id"])).response["status"] != "queued":
                break
            await asyncio.sleep(0.01)
        return stored.response

    failed = asyncio.run(main())
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_prompt"
    assert "running it again failed" in failed["error"]["message"] and "not found" in failed["error"]["message"]


def test_the_kept_request_reads_back_as_the_same_request():
    """What a response keeps to run again (its request's JSON, as the client set it) validates to the same request,
    for input items of every kind, tools, a schema format and sampling options."""
    from serve_app.openai_api.protocol import ResponsesRequest

    body = {"model": MODEL, "background": True, "instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "max_output_tokens": 50, "metadata": {"a": "b"}, "temperature": 0.5,
        "top_logprobs": 2, "include": ["message.output_text.logprobs"], "tool_choice": {"type": "function", "name": "f"},
        "truncation": "auto", "cache_salt": "s1"}
    req = ResponsesRequest.model_validate(body)
    kept = req.model_dump(mode="json", exclude_unset=True)
    assert ResponsesRequest.model_validate(kept) == req
    assert "stream" not in kept and kept["input"][0] == {"role": "user", "content": "hi"}  # only what was set


def test_stream_tokens_are_kept_without_gap_or_repeat_and_go_with_an_adoption():
    """append_events keeps the output tokens beside the events (a retried write adds nothing twice, one that would
    leave a gap adds nothing), refuses a runner that lost the response, and adopt_responses hands both to the
    adopter of a streamed response; they go when the response goes."""
    now = [0.0]
    store = store_at(now)
    events = [{"type": "e", "sequence_number": n} for n in range(5)]

    async def main():
        await store.put("resp_s", response("resp_s", rerun={**RERUN, "request": {**RERUN["request"], "stream": True}}),
                        "run-a")
        assert await store.append_events("resp_s", events[:2], "run-a", [7, 8, 9], 0, prompt_ids=[1, 2])
        assert await store.append_events("resp_s", events[1:3], "run-a", [8, 9, 10], 1, prompt_ids=[5])  # retried
        assert await store.append_events("resp_s", events[3:4], "run-a", [99], 5)  # a gap: the tokens are left out
        assert store._stream_output["resp_s"] == [7, 8, 9, 10]
        assert await store.release_response("resp_s", "run-a")
        [(rid, adopted)] = await store.adopt_responses("run-b", MODEL)
        assert rid == "resp_s" and adopted.rerun["stream"] == {"events": events[:4], "output_ids": [7, 8, 9, 10],
                                                               "prompt_ids": [1, 2]}  # the first write's
        assert "stream" not in (await store.get("resp_s")).rerun  # handed over, not kept in the stored response
        assert not await store.append_events("resp_s", events[4:], "run-a", [11], 4)  # run-a lost it
        assert await store.append_events("resp_s", events[4:], "run-b", [11], 4)
        assert (await store.events_after("resp_s", -1))[0] == events and store._stream_output["resp_s"][-1] == 11
        await store.delete("resp_s")
        assert "resp_s" not in store._stream_output and "resp_s" not in store._stream_prompt and store.bytes == 0

    asyncio.run(main())


THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>" + "think " * 30 + "<|end|><|start|>assistant<|channel|>final"
                     "<|message|>" + "word " * 60 + "<|return|>")


def _sse_events(body: str) -> list[dict]:
    import json

    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


SCHEMA_FORMAT = {"type": "json_schema", "name": "words", "strict": True,
                 "schema": {"type": "object", "properties": {"w": {"type": "string"}}, "required": ["w"]}}


@pytest.mark.parametrize("cut_after,text_format", [(12, None), (50, None), (50, SCHEMA_FORMAT)])
def test_a_streamed_run_goes_on_at_another_replica_from_its_stored_events(cut_after, text_format):
    """A streamed background run whose replica stops (BackgroundRuns.stop) is given back with its events and output
    tokens so far; another replica continues it (its engine request: the prompt and that output, for the tokens left,
    a constraint started past that output) and the client's stream, still open on the first replica, reads on: every
    event once, in order, each item added once, the text whole, usage counting the first prompt as input and every
    token as output. The prompt is the first run's, not the one the request makes now (the second replica's date
    differs here). (Cut at 12 tokens: in the reasoning; at 50: in the answer. The scripted backend does not apply the
    constraint; test_harmony_constrain.py holds the constraint's state past an output.)"""
    backend, store = ScriptedBackend(), MemoryResponseStore()
    first, second = (create_app(backend, model_name=MODEL, max_context=backend.max_context,
                                conversation_start_date=date, response_store=store)
                     for date in (START_DATE, "2031-01-02"))
    tokens = backend.tokens(THINK_THEN_ANSWER)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://a", timeout=60) as a:
            backend.push(THINK_THEN_ANSWER, delay_s=0.02)
            body = {"model": MODEL, "input": "Hi", "background": True, "stream": True}
            post = asyncio.ensure_future(a.post("/v1/responses", json=body if text_format is None else {
                **body, "text": {"format": text_format}}))
            for _ in range(1000):
                if any(len(out) >= cut_after for out in store._stream_output.values()):
                    break
                await asyncio.sleep(0.005)
            await first.state.background.stop(wait_s=0)
            [(rid, done)] = [(rid, list(out)) for rid, out in store._stream_output.items()]
            assert (await store.get(rid)).response["status"] == "queued" and rid in backend.aborted
            assert done == tokens[:len(done)] and cut_after <= len(done) < len(tokens) - 5
            backend.push(backend.encoding.decode(tokens[len(done):]), delay_s=0.005)
            assert await second.state.background.adopt() == [rid]
            body = (await post).text
            replay = (await a.get(f"/v1/responses/{rid}", params={"stream": "true"})).text
            return rid, done, _sse_events(body), _sse_events(replay), (await store.get(rid)).response

    rid, done, events, replay, final = asyncio.run(main())
    assert [ev["sequence_number"] for ev in events] == list(range(len(events))) and events == replay
    assert [ev["type"] for ev in events][:3] == ["response.created", "response.queued", "response.in_progress"]
    assert [ev["type"] for ev in events].count("response.in_progress") == 1
    assert events[-1]["type"] == "response.completed" and events[-1]["response"] == final
    assert [ev["item"]["type"] for ev in events if ev["type"] == "response.output_item.added"] == ["reasoning",
                                                                                                   "message"]
    assert "".join(ev["delta"] for ev in events if ev["type"] == "response.reasoning_text.delta") == "think " * 30
    assert "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta") == "word " * 60
    assert [item["content"][0]["text"] for item in final["output"]] == ["think " * 30, "word " * 60]
    added = {ev["item"]["id"] for ev in events if ev["type"] == "response.output_item.added"}
    assert {item["id"] for item in final["output"]} == added  # the items the client saw added, finished
    [run1, run2] = backend.requests
    assert run2.request_id == f"{rid}-run2" and run2.prompt_ids == run1.prompt_ids + done
    assert run2.sampling.max_tokens == run1.sampling.max_tokens - len(done)
    if text_format is not None:
        assert run1.sampling.constraint.after == () and run2.sampling.constraint.after == tuple(done)
        assert replace(run2.sampling.constraint, after=()) == run1.sampling.constraint
    else:
        assert run1.sampling.constraint is None and run2.sampling.constraint is None
    assert final["usage"]["input_tokens"] == len(run1.prompt_ids) and final["usage"]["output_tokens"] == len(tokens)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 30


def test_a_stream_that_cannot_go_on_is_failed_by_its_adopter_and_its_stream_ends():
    """Given back with output that had already ended (its last token a stop token: the replica stopped between its
    last events and its final state), or with no stream record (the store restarted and lost its events): the
    adopter stores it failed, and a stream it has ends with response.failed after the events it had."""
    backend, store = ScriptedBackend(), MemoryResponseStore()
    app = create_app(backend, model_name=MODEL, max_context=backend.max_context, conversation_start_date=START_DATE,
                     response_store=store)
    streamed = {**RERUN, "request": {**RERUN["request"], "stream": True}}
    ended = backend.tokens("<|channel|>final<|message|>Done.<|return|>")

    async def main():
        events = [{"type": "response.created", "sequence_number": 0}, {"type": "response.queued", "sequence_number": 1}]
        for rid, output in (("resp_ended", ended), ("resp_lost", None)):
            await store.put(rid, response(rid, rerun=streamed), "run-a")
            if output is not None:
                await store.append_events(rid, events, "run-a", output, 0)
            assert await store.release_response(rid, "run-a")
        assert sorted(await app.state.background.adopt()) == ["resp_ended", "resp_lost"]
        for _ in range(200):
            got = {rid: (await store.get(rid)).response for rid in ("resp_ended", "resp_lost")}
            if all(r["status"] == "failed" for r in got.values()):
                break
            await asyncio.sleep(0.01)
        return got, (await store.events_after("resp_ended", 1))[0], await store.events_after("resp_lost", -1)

    got, tail, lost_events = asyncio.run(main())
    assert "output ended" in got["resp_ended"]["error"]["message"]
    assert "events are gone" in got["resp_lost"]["error"]["message"]
    assert [(ev["type"], ev["sequence_number"]) for ev in tail] == [("response.failed", 2)]
    assert tail[0]["response"]["status"] == "failed" and lost_events is None and backend.requests == []


def test_a_stream_given_back_before_its_first_token_goes_on_with_in_progress_once():
    """Given back while its engine request still waited (its stream: created and queued, no token): the adopter's
    run says in_progress and streams the whole answer; one given back after in_progress does not say it again
    (test_a_streamed_run_goes_on_at_another_replica_from_its_stored_events)."""
    backend, store = ScriptedBackend(), MemoryResponseStore()
    app = create_app(backend, model_name=MODEL, max_context=backend.max_context, conversation_start_date=START_DATE,
                     response_store=store)
    streamed = {**RERUN, "request": {**RERUN["request"], "stream": True}}

    async def main():
        await store.put("resp_w", response("resp_w", "queued", rerun=streamed), "run-a")
        await store.append_events("resp_w", [{"type": "response.created", "sequence_number": 0},
                                             {"type": "response.queued", "sequence_number": 1}], "run-a")
        assert await store.release_response("resp_w", "run-a")
        backend.push("<|channel|>final<|message|>All of it.<|return|>")
        assert await app.state.background.adopt() == ["resp_w"]
        for _ in range(500):
            if (await store.get("resp_w")).response["status"] == "completed":
                break
            await asyncio.sleep(0.01)
        return (await store.events_after("resp_w", -1))[0]

    events = asyncio.run(main())
    types = [ev["type"] for ev in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types.count("response.in_progress") == 1 and types[-1] == "response.completed"
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    assert "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta") == "All of it."
