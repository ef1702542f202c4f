"""Background responses handed from one ingress replica to another through the store (background_store.py): a
response given back or left silent is adopted by a replica of its model, runs again, and a run that lost its
response can no longer write it; with a store clock the tests move by hand."""

from __future__ import annotations

import asyncio

import httpx

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
