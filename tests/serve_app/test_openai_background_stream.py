"""Streamed background responses (`background: true, stream: true`): the POST's stream is the response's events read
back from the store; a client that drops it resumes from any ingress replica with GET ?stream=true&starting_after=N
(no gap, no repeat, the run going on meanwhile); cancelled and orphaned runs end their streams; bad resumes are
400s; the store keeps the events within its byte limit. Through the openai client against live uvicorn servers."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from serve_app.openai_api.stored_responses import MemoryResponseStore, StoredResponse
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend
from tests.serve_app.test_openai_background import ANSWER, LONG, api, backend, live, other, wait_for  # noqa: F401


def text_of(events) -> str:
    return "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")


def test_the_stream_is_the_foreground_stream_with_queued_first(api, backend):
    backend.push(ANSWER)
    events = list(api.responses.create(model=MODEL, input="Hi", background=True, stream=True, max_output_tokens=64))
    backend.push(ANSWER)
    foreground = list(api.responses.create(model=MODEL, input="Hi", stream=True, max_output_tokens=64))
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert [ev.type for ev in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background is True
    assert [ev.type for ev in events[3:]] == [ev.type for ev in foreground[2:]]  # after created / in_progress
    assert events[-1].type == "response.completed" and text_of(events) == text_of(foreground) == "Done."
    stored = api.responses.retrieve(events[0].response.id)
    assert stored.status == "completed" and stored.output_text == "Done."
    assert events[-1].response.model_dump() == stored.model_dump()


def test_a_dropped_stream_resumes_on_another_replica_without_gap_or_repeat(api, other, backend):
    backend.push(LONG, delay_s=0.01)
    stream = api.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    first = []
    for ev in stream:
        first.append(ev)
        if len(first) == 12:
            break
    stream.close()  # the connection drops: the run goes on
    response_id, last = first[0].response.id, first[-1].sequence_number
    rest = list(other.responses.retrieve(response_id, stream=True, starting_after=last))
    assert rest[0].sequence_number == last + 1
    assert [ev.sequence_number for ev in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type == "response.completed"
    assert text_of(first + rest) == "word " * 200 and response_id not in backend.aborted
    # a later read replays every event, and one past the end ends at once (the response has finished)
    replay = list(api.responses.retrieve(response_id, stream=True))
    assert [ev.sequence_number for ev in replay] == list(range(len(first) + len(rest)))
    assert list(api.responses.retrieve(response_id, stream=True, starting_after=rest[-1].sequence_number)) == []


def test_a_cancelled_stream_ends_and_get_says_cancelled(api, backend):
    backend.push(LONG, delay_s=0.02)
    stream = api.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    seen = []
    for ev in stream:
        seen.append(ev)
        if ev.type == "response.output_text.delta":
            assert api.responses.cancel(seen[0].response.id).status == "cancelled"
            break
    rest = list(api.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert all(ev.type not in ("response.completed", "response.failed", "response.incomplete") for ev in rest)
    final = api.responses.retrieve(seen[0].response.id)
    assert final.status == "cancelled" and len(text_of(seen + rest)) < len("word " * 200)


def test_bad_resumes_are_clear_errors(api, backend, live):
    backend.push(ANSWER)
    events = list(api.responses.create(model=MODEL, input="Hi", background=True, stream=True))
    url = f"{live[1].url}/a/v1/responses/{events[0].response.id}"
    for query, param in [("stream=true&starting_after=abc", "starting_after"),
                         ("stream=true&starting_after=-5", "starting_after"), ("stream=maybe", "stream")]:
        response = httpx.get(f"{url}?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(openai.NotFoundError):
        list(api.responses.retrieve("resp_nothing_here", stream=True))


def test_the_store_counts_events_drops_them_with_the_response_and_ends_an_orphan_with_failed():
    now = [0.0]
    store = MemoryResponseStore(clock=lambda: now[0])
    running = {"id": "resp_1", "status": "in_progress", "output": [], "error": None}
    events = [{"type": "response.created", "sequence_number": 0}, {"type": "response.in_progress", "sequence_number": 1}]

    async def main():
        assert not await store.append_events("resp_1", events)  # not stored: nothing to add to
        await store.put("resp_1", StoredResponse(running, [], None, "owner"))
        alone = store.bytes
        assert await store.append_events("resp_1", events) and store.bytes > alone
        assert await store.events_after("resp_1", 0) == ([events[1]], False)
        await store.put("resp_1", StoredResponse(running, [], None, "owner"))  # a state change keeps the events
        assert (await store.events_after("resp_1", -1))[0] == events
        now[0] = 31.0  # its replica fell silent: the stream ends as a failed response's does
        got, finished = await store.events_after("resp_1", 1)
        assert finished and [ev["type"] for ev in got] == ["response.failed"] and got[0]["sequence_number"] == 2
        assert got[0]["response"]["status"] == "failed"
        await store.delete("resp_1")
        assert store.bytes == 0 and await store.events_after("resp_1", -1) is None

    asyncio.run(main())


class LandedThenTimedOutStore(MemoryResponseStore):
    """A store whose event writes fail now and then: every third raises before it lands, every fifth lands and then
    raises (a Serve call that timed out after the replica had done it)."""

    def __init__(self):
        super().__init__(max_responses=100)
        self.writes = 0

    async def append_events(self, response_id, events, *more, **named):
        self.writes += 1
        if self.writes > 1 and self.writes % 3 == 0:  # the first, the POST's own, must land
            raise TimeoutError()
        landed = await super().append_events(response_id, events, *more, **named)
        if self.writes % 5 == 0:
            raise TimeoutError()
        return landed


def test_failed_event_writes_are_retried_without_gap_or_repeat(caplog):
    stub, store = ScriptedBackend(), LandedThenTimedOutStore()
    with scripted_app(stub, response_store=store) as server:
        stub.push(LONG, delay_s=0.005)  # ~1 s: ~20 writes, one per 50 ms
        events = list(openai_client(server.url).responses.create(model=MODEL, input="Hi", background=True,
                                                                 stream=True))
    assert store.writes >= 6  # some writes failed before landing, some after
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and text_of(events) == "word " * 200
    assert "not stored yet" in caplog.text


def test_the_store_ignores_events_it_already_has():
    store = MemoryResponseStore()
    events = [{"type": "a", "sequence_number": n} for n in range(4)]

    async def main():
        await store.put("resp_1", StoredResponse({"id": "resp_1", "status": "in_progress", "output": []}, []))
        await store.append_events("resp_1", events[:3])
        size = store.bytes
        await store.append_events("resp_1", events[1:3])  # a retried write that had landed
        assert store.bytes == size
        await store.append_events("resp_1", events[2:])  # a retried write that had landed in part
        assert (await store.events_after("resp_1", -1))[0] == events

    asyncio.run(main())
