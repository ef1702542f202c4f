"""Background responses (`background: true`): answered at once as `queued`, generated detached from the HTTP
request, polled with GET, cancelled with POST .../cancel (also from another ingress replica, through the store),
failures stored as `failed`; through the openai client against live uvicorn servers."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from engine.request import BackendOverloaded
from serve_app.openai_api.app import create_app
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, START_DATE, LiveServer, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ANSWER = "<|channel|>analysis<|message|>Think a bit.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
LONG = "<|channel|>final<|message|>" + "word " * 200 + "<|return|>"


@pytest.fixture(scope="module")
def live():
    """Two apps (two ingress replicas) on one backend and one store, mounted at /a and /b of one server."""
    backend, store = ScriptedBackend(), MemoryResponseStore(max_responses=100)
    apps = [create_app(backend, model_name=MODEL, max_context=backend.max_context, conversation_start_date=START_DATE,
                       response_store=store) for _ in range(2)]
    with LiveServer(Starlette(routes=[Mount("/a", apps[0]), Mount("/b", apps[1])])) as server:
        yield backend, server, store


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


@pytest.fixture
def api(live) -> openai.OpenAI:
    return openai_client(f"{live[1].url}/a")


@pytest.fixture
def other(live) -> openai.OpenAI:
    """The second ingress replica: it shares only the store with the first."""
    return openai_client(f"{live[1].url}/b")


def wait_for(api: openai.OpenAI, response_id: str, statuses: tuple[str, ...], timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = api.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, f"{response_id} still {response.status}, waiting for {statuses}"
        time.sleep(0.02)


def test_answered_at_once_then_polled_to_the_same_response_as_in_the_foreground(api, other, backend):
    backend.push(ANSWER, first_delay_s=0.5)
    t0 = time.monotonic()
    queued = api.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=64)
    assert time.monotonic() - t0 < 0.4  # did not wait for the first token
    assert (queued.status, queued.background, queued.output, queued.usage) == ("queued", True, [], None)
    assert other.responses.retrieve(queued.id).status == "queued"  # every replica reads it from the store
    done = wait_for(other, queued.id, ("completed",))
    backend.push(ANSWER)
    foreground = api.responses.create(model=MODEL, input="Hi", max_output_tokens=64)
    assert done.output_text == foreground.output_text == "Done."
    assert [item.type for item in done.output] == [item.type for item in foreground.output] == ["reasoning", "message"]
    assert done.usage.model_dump() == foreground.usage.model_dump()
    assert backend.requests[0].prompt_ids == backend.requests[1].prompt_ids
    assert (done.background, foreground.background) == (True, False)


def test_every_state_validates_against_openai_types(live, backend):
    """The bodies of each state (queued, in_progress, cancelled, failed) parse as the openai package's Response."""
    from openai.types.responses import Response

    url = f"{live[1].url}/a/v1/responses"
    backend.push(LONG, delay_s=0.05)
    backend.push(LONG, fail_after=3, delay_s=0.05)
    running, failing = (httpx.post(url, json={"model": MODEL, "input": "Hi", "background": True}).json()
                        for _ in range(2))
    bodies = [running]
    deadline = time.monotonic() + 10
    while (body := httpx.get(f"{url}/{running['id']}").json())["status"] != "in_progress":
        assert time.monotonic() < deadline
    bodies.append(body)
    bodies.append(httpx.post(f"{url}/{running['id']}/cancel").json())
    while (body := httpx.get(f"{url}/{failing['id']}").json())["status"] != "failed":
        assert time.monotonic() < deadline
    bodies.append(body)
    assert [Response.model_validate(b).status for b in bodies] == ["queued", "in_progress", "cancelled", "failed"]
    assert Response.model_validate(bodies[-1]).error.code == "server_error"


def test_in_progress_once_the_engine_has_it_and_a_length_cut_is_incomplete(api, backend):
    backend.push(LONG, delay_s=0.05)
    created = api.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=40)
    wait_for(api, created.id, ("in_progress",))
    done = wait_for(api, created.id, ("incomplete",))
    assert done.incomplete_details.reason == "max_output_tokens" and done.usage.output_tokens == 40


def test_cancel_stops_the_engine_request_and_keeps_what_was_generated(api, backend):
    backend.push(LONG, delay_s=0.05)
    created = api.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(api, created.id, ("in_progress",))
    time.sleep(0.3)
    cancelled = api.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    assert backend.abort_seen.wait(5) and created.id in backend.aborted
    text = cancelled.output[0].content[0].text
    assert text.startswith("word") and len(text) < len("word " * 200)
    assert api.responses.retrieve(created.id).status == "cancelled"
    assert api.responses.cancel(created.id).status == "cancelled"  # again: the same answer


def test_a_cancel_sent_to_another_replica_reaches_the_run(api, other, backend):
    backend.push(LONG, delay_s=0.05)
    created = api.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(api, created.id, ("in_progress",))
    t0 = time.monotonic()
    cancelled = other.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and time.monotonic() - t0 < 5  # the run's replica polls every 0.5 s
    assert created.id in backend.aborted and cancelled.output


def test_delete_while_running_stops_it_and_it_stays_deleted(api, other, backend, live):
    backend.push(LONG, delay_s=0.05)
    created = api.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(api, created.id, ("in_progress",))
    assert other.responses.delete(created.id) is None
    assert backend.abort_seen.wait(5) and created.id in backend.aborted
    time.sleep(0.3)  # the stopped run's final state must not bring it back
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(created.id)
    assert not live[2]._cancel  # nothing left behind in the store


@pytest.mark.parametrize("script, code", [
    (dict(fail_after=2), "server_error"),
    (dict(error=BackendOverloaded("decode queue full")), "server_error"),
])
def test_a_run_that_fails_is_stored_as_failed_with_the_error(api, backend, script, code):
    backend.push(LONG, **script)
    created = api.responses.create(model=MODEL, input="Hi", background=True)
    failed = wait_for(api, created.id, ("failed",))
    assert failed.error.code == code and failed.error.message
    if "error" in script:
        assert "overloaded" in failed.error.message and "(server_overloaded)" in failed.error.message


def test_cancel_errors(api, backend):
    backend.push(ANSWER)
    foreground = api.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError, match="background=true"):
        api.responses.cancel(foreground.id)
    backend.push(ANSWER)
    finished = wait_for(api, api.responses.create(model=MODEL, input="Hi", background=True).id, ("completed",))
    with pytest.raises(openai.BadRequestError, match="already finished"):
        api.responses.cancel(finished.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.cancel("resp_unknown")


def test_continuing_a_running_response_waits_for_it_to_finish(api, backend):
    backend.push(ANSWER, first_delay_s=0.4)
    created = api.responses.create(model=MODEL, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError, match="still queued") as err:
        api.responses.create(model=MODEL, input="And?", previous_response_id=created.id)
    assert err.value.body["param"] == "previous_response_id"
    wait_for(api, created.id, ("completed",))
    backend.push(ANSWER)
    continued = api.responses.create(model=MODEL, input="And?", previous_response_id=created.id)
    assert continued.status == "completed" and "Done." in backend.encoding.decode(backend.requests[-1].prompt_ids)


def test_streaming_a_response_created_without_stream_is_a_clear_400(api, backend):
    backend.push(ANSWER)
    done = wait_for(api, api.responses.create(model=MODEL, input="Hi", background=True).id, ("completed",))
    with pytest.raises(openai.BadRequestError, match="no event stream") as err:
        list(api.responses.retrieve(done.id, stream=True, starting_after=0))
    assert err.value.body["param"] == "stream"
    assert api.responses.retrieve(done.id, stream=False).status == "completed"


def test_requests_a_background_run_cannot_serve_are_400(api, live):
    for extra, param in [({"store": False}, "store")]:
        response = httpx.post(f"{live[1].url}/a/v1/responses",
                              json={"model": MODEL, "input": "Hi", "background": True, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with scripted_app(ScriptedBackend()) as stateless:  # no store: nothing to poll
        response = httpx.post(f"{stateless.url}/v1/responses", json={"model": MODEL, "input": "Hi", "background": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "background"


def test_a_stopping_replica_lets_short_runs_finish_and_gives_the_rest_to_another():
    """BackgroundRuns.stop (HarmonyIngress.__del__ under Serve): runs that end within the wait complete; the others'
    engine requests are aborted and their responses given back (`queued` again); another ingress replica's adopt
    (its health check) runs them again from the start under the same id and creation time, to completion; the
    stopping replica adopts nothing."""
    import asyncio

    backend, store = ScriptedBackend(), MemoryResponseStore()
    first, second = (create_app(backend, model_name=MODEL, max_context=backend.max_context,
                                conversation_start_date=START_DATE, response_store=store) for _ in range(2))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://a") as a, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://b") as b:
            created = []
            for script in (dict(text=ANSWER), dict(text=LONG, delay_s=0.05)):
                backend.push(**script)
                created.append((await a.post("/v1/responses", json={
                    "model": MODEL, "input": "Hi", "background": True, "metadata": {"k": "v"}})).json())
            await first.state.background.stop(wait_s=0.5)
            assert len(first.state.background) == 0
            short, given_back = [(await b.get(f"/v1/responses/{c['id']}")).json() for c in created]
            assert await first.state.background.adopt() == []  # stopping: adopts nothing
            backend.push(LONG)
            assert await second.state.background.adopt() == [created[1]["id"]]
            assert await second.state.background.adopt() == []  # once
            for _ in range(500):
                again = (await b.get(f"/v1/responses/{created[1]['id']}")).json()
                if again["status"] not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.01)
            return created, short, given_back, again

    created, short, given_back, again = asyncio.run(main())
    assert short["status"] == "completed"
    assert given_back["status"] == "queued" and given_back["output"] == [] and created[1]["id"] in backend.aborted
    assert again["status"] == "completed", again
    assert (again["id"], again["created_at"], again["metadata"]) == (created[1]["id"], created[1]["created_at"],
                                                                     {"k": "v"})
    assert again["output"][-1]["content"][0]["text"] == "word " * 200  # the whole answer, from the start
    assert backend.requests[-1].request_id == created[1]["id"] + "-run2"  # the second run's own engine request
    assert store._items[created[1]["id"]][0].rerun is None  # finished: its request is not kept


def test_a_stopping_replica_stores_streamed_runs_it_cannot_continue_as_failed():
    """A streamed background run that asked for logprobs cannot be continued elsewhere (the logprobs in waiting are
    not kept) and its client may have read part of its events: stop() stores it failed (code server_error, the
    message says the replica stopped), its stream ends with response.failed and its engine request is aborted. (One
    that can be continued: test_background_handover.py.)"""
    import asyncio

    backend, store = ScriptedBackend(), MemoryResponseStore()
    app = create_app(backend, model_name=MODEL, max_context=backend.max_context, conversation_start_date=START_DATE,
                     response_store=store)
    with LiveServer(app) as server:
        backend.push(LONG, delay_s=0.05)
        stream = openai_client(server.url).responses.create(model=MODEL, input="Hi", background=True, stream=True,
                                                            include=["message.output_text.logprobs"])
        events = iter(stream)
        response_id = next(events).response.id
        assert next(e for e in events if e.type == "response.output_text.delta")
        loop = app.state.background._watcher.get_loop()  # the server's loop, where the run is
        asyncio.run_coroutine_threadsafe(app.state.background.stop(wait_s=0.1), loop).result(timeout=20)
        assert [e.type for e in events][-1] == "response.failed"
        stored = asyncio.run_coroutine_threadsafe(store.get(response_id), loop).result(timeout=5)
    assert stored.response["status"] == "failed" and stored.response["error"]["code"] == "server_error"
    assert "stopped before it finished" in stored.response["error"]["message"]
    assert stored.response["output"] and response_id in backend.aborted and stored.rerun is None


def test_a_run_whose_replica_died_is_failed_once_its_polls_stop():
    """The store hears from a run's replica at every cancel poll (every 0.5 s); a response still unfinished 30 s after
    the last one (its replica died without stop()) is failed when read, with its conversation kept."""
    import asyncio

    from serve_app.openai_api.stored_responses import StoredResponse

    now = [0.0]
    store = MemoryResponseStore(clock=lambda: now[0])
    queued = {"id": "resp_1", "status": "queued", "output": [], "error": None}

    async def main():
        await store.put("resp_1", StoredResponse(queued, [{"id": "msg_1", "type": "message"}], None, "owner"))
        now[0] = 20.0
        assert await store.cancel_requested(["resp_1"]) == []  # a poll: its replica is alive
        now[0] = 49.0
        assert (await store.get("resp_1")).response["status"] == "queued"  # 29 s since that poll
        now[0] = 51.0
        failed = await store.get("resp_1")
        assert failed.response["status"] == "failed" and "stopped before it finished" in \
            failed.response["error"]["message"]
        assert (failed.input_items, failed.owner) == ([{"id": "msg_1", "type": "message"}], "owner")
        assert (await store.get("resp_1")).response["status"] == "failed" and not store._seen

    asyncio.run(main())


def test_the_sweep_fails_orphans_without_a_read_and_keeps_their_place():
    """sweep_orphans (the store replica runs it every few seconds) marks a silent replica's runs failed before anyone
    reads them, leaves runs whose replica polls alone, keeps the least-recently-used order, and running() counts."""
    import asyncio

    from serve_app.openai_api.stored_responses import StoredResponse

    now = [0.0]
    store = MemoryResponseStore(clock=lambda: now[0])

    def resp(rid: str, status: str) -> StoredResponse:
        return StoredResponse({"id": rid, "status": status, "output": [], "error": None}, [], None, "owner")

    async def main():
        await store.put("resp_old", resp("resp_old", "completed"))
        await store.put("resp_dead", resp("resp_dead", "in_progress"))
        await store.put("resp_live", resp("resp_live", "queued"))
        assert store.running() == 2
        now[0] = 25.0
        assert await store.cancel_requested(["resp_live"]) == []  # resp_live's replica polls; resp_dead's is gone
        now[0] = 31.0
        assert await store.sweep_orphans() == 1
        assert store.running() == 1 and list(store._items) == ["resp_old", "resp_dead", "resp_live"]
        dead = store._items["resp_dead"][0]
        assert dead.response["status"] == "failed" and dead.response["error"]["code"] == "server_error"
        assert store.bytes == sum(size for _, size in store._items.values())
        assert await store.sweep_orphans() == 0  # nothing twice
        now[0] = 56.0
        assert await store.sweep_orphans() == 1 and store.running() == 0  # resp_live's replica fell silent too
        assert (await store.get("resp_live")).response["status"] == "failed"

    asyncio.run(main())


def test_a_long_run_stays_alive_through_its_polls(backend):
    """A run longer than orphan_after_s is not failed while its replica polls (a store with a short limit)."""
    store = MemoryResponseStore(orphan_after_s=1.2)
    with scripted_app(backend, response_store=store) as server:
        client = openai_client(server.url)
        backend.push(LONG, delay_s=0.05)  # ~67 deltas: ~3.4 s
        created = client.responses.create(model=MODEL, input="Hi", background=True)
        t0 = time.monotonic()
        done = wait_for(client, created.id, ("completed", "failed"))
        assert done.status == "completed" and time.monotonic() - t0 > 2.4, (done.status, done.error)
