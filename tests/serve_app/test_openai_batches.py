"""/v1/files and /v1/batches through the openai client against a live uvicorn server with a MemoryResponseStore: a
batch's lines run through the app (answers by status into the output and error files, at batch priority), bad input
files fail the batch by line, cancel, API keys, and the 4xx answers; the store's orphans and file round trip."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import openai
import pytest

from serve_app.openai_api.batch_store import StoredBatch
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ANSWER = "<|channel|>final<|message|>Hello there!<|return|>"
UPLOAD_LIMIT = 16 << 10
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live():
    backend, store = ScriptedBackend(), MemoryResponseStore(max_responses=100, max_file_bytes=64 << 10)
    with scripted_app(backend, response_store=store, api_keys=["sk-a", "sk-b"], max_upload_bytes=UPLOAD_LIMIT,
                      batch_concurrency=3) as server:
        yield backend, server, store


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


def client(live, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[1].url}/v1", api_key=key, max_retries=0, timeout=30)


def jsonl(*lines) -> io.BytesIO:
    return io.BytesIO("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode())


def chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": HI, **body}}


def wait_for(api: openai.OpenAI, batch_id: str, *statuses: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.05)


def lines_of(api: openai.OpenAI, file_id: str) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, api.files.content(file_id).text.splitlines())}

async def create_over_asgi(http: httpx.AsyncClient, *lines) -> dict:
    """Upload `lines` and create a chat batch of them through an app over ASGI: the batch object."""
    upload = await http.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("r.jsonl", jsonl(*lines).getvalue())})
    assert upload.status_code == 200, upload.text
    made = await http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                                                "endpoint": "/v1/chat/completions"})
    assert made.status_code == 200, made.text
    return made.json()



def test_a_batch_runs_its_lines_into_the_output_and_error_files(live, backend):
    api = client(live)
    for _ in range(4):
        backend.push(ANSWER)
    source = api.files.create(file=("requests.jsonl", jsonl(
        chat_line("a"), chat_line("b", max_tokens=2), chat_line("hot", temperature=9),
        chat_line("other-model") | {"body": {"model": "nope", "messages": HI}},
        {"custom_id": "text", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hey"}], "n": 2}},
    )), purpose="batch")
    assert (source.purpose, source.filename, source.status) == ("batch", "requests.jsonl", "processed")
    assert source.id.startswith("file-") and api.files.retrieve(source.id).bytes == source.bytes
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(api, batch.id, "completed", "failed")
    assert done.status == "completed", done.errors
    assert done.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at - done.created_at == 86400
    out, errors = lines_of(api, done.output_file_id), lines_of(api, done.error_file_id)
    assert set(out) == {"a", "b", "text"} and set(errors) == {"hot", "other-model"}
    for cid, line in out.items():
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["object"] == "chat.completion"
    assert out["a"]["response"]["body"]["choices"][0]["message"]["content"] == "Hello there!"
    assert out["b"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert len(out["text"]["response"]["body"]["choices"]) == 2
    usages = [line["response"]["body"]["usage"] for line in out.values()]
    assert done.usage.model_dump() == {  # the answered lines' usage, summed
        "input_tokens": sum(u["prompt_tokens"] for u in usages),
        "input_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)},
        "output_tokens": sum(u["completion_tokens"] for u in usages),
        "output_tokens_details": {"reasoning_tokens": sum(u["completion_tokens_details"]["reasoning_tokens"]
                                                          for u in usages)},
        "total_tokens": sum(u["total_tokens"] for u in usages)}
    assert done.usage.output_tokens > 0 and done.model is None  # two models named: no one model
    assert errors["hot"]["response"]["status_code"] == 400
    assert errors["hot"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors["other-model"]["response"]["status_code"] == 404
    # the engine ran the four generations at batch priority (1, after interactive requests' 0)
    assert len(backend.requests) == 4 and {r.priority for r in backend.requests} == {1}
    listed = api.files.list(purpose="batch_output")
    assert {done.output_file_id, done.error_file_id} <= {f.id for f in listed}
    assert api.files.retrieve(done.output_file_id).filename == f"{batch.id}_output.jsonl"
    assert batch.id in [b.id for b in api.batches.list(limit=100)]


def test_bad_lines_fail_the_batch_naming_each_line_and_nothing_runs(live, backend):
    api = client(live)
    source = api.files.create(file=("bad.jsonl", jsonl(
        chat_line("a"), "{not json", chat_line("a"),
        {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}},
        chat_line("s", stream=True))), purpose="batch")
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(api, batch.id, "failed", "completed")
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    problems = {e.line: e.message for e in failed.errors.data}
    assert set(problems) == {2, 3, 4, 5}, problems
    assert "not JSON" in problems[2] and "already used on line 1" in problems[3]
    assert "endpoint /v1/chat/completions" in problems[4] and "stream" in problems[5]
    assert all(e.code == "invalid_request" for e in failed.errors.data)
    assert backend.requests == []
    empty = api.files.create(file=("empty.jsonl", io.BytesIO(b"\n\n")), purpose="batch")
    nothing = wait_for(api, api.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id, "failed")
    assert [e.code for e in nothing.errors.data] == ["empty_file"]


def test_cancel_stops_a_running_batch_and_keeps_what_ended(live, backend):
    api = client(live)
    backend.push(ANSWER)  # the first line ends at once, the others take 30 s each unless aborted
    for _ in range(5):
        backend.push(ANSWER * 10, chunk=1, delay_s=0.5)
    source = api.files.create(file=("slow.jsonl", jsonl(*(chat_line(f"r{i}") for i in range(6)))), purpose="batch")
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    running = wait_for(api, batch.id, "in_progress")
    deadline = time.monotonic() + 20
    while api.batches.retrieve(batch.id).request_counts.completed < 1:  # counts reach the store every second
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert running.request_counts.total == 6
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    cancelled = wait_for(api, batch.id, "cancelled", timeout_s=15)
    assert cancelled.cancelled_at and cancelled.cancelling_at
    assert cancelled.request_counts.completed == 1 and cancelled.request_counts.total == 6
    assert list(lines_of(api, cancelled.output_file_id)) == ["r0"] and cancelled.error_file_id is None
    deadline = time.monotonic() + 10  # the requests in flight were aborted in the engine
    while len(backend.aborted) < 2:  # batch_concurrency = 3: r1, r2 were in flight
        assert time.monotonic() < deadline, backend.aborted
        time.sleep(0.05)
    assert api.batches.cancel(batch.id).status == "cancelled"  # cancelling a finished batch changes nothing


def test_files_and_batches_belong_to_their_key(live, backend):
    a, b = client(live, "sk-a"), client(live, "sk-b")
    backend.push(ANSWER)
    mine = a.files.create(file=("mine.jsonl", jsonl(chat_line("x"))), purpose="batch")
    batch = a.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(a, batch.id, "completed")
    for call in (lambda: b.files.retrieve(mine.id), lambda: b.files.content(mine.id), lambda: b.files.delete(mine.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.files.content(done.output_file_id),
                 lambda: b.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert mine.id not in {f.id for f in b.files.list()} and batch.id not in {x.id for x in b.batches.list()}
    assert a.files.delete(mine.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(mine.id)
    # the batch stays, its files too
    assert a.batches.retrieve(batch.id).status == "completed" and a.files.retrieve(done.output_file_id)
    httpx_headers = {"Authorization": "Bearer sk-a"}
    r = httpx.get(f"{live[1].url}/v1/files", params={"limit": 0}, headers=httpx_headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = httpx.get(f"{live[1].url}/v1/batches", params={"after": "batch_nope"}, headers=httpx_headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    assert httpx.get(f"{live[1].url}/v1/files").status_code == 401  # no key, no files


def test_refused_uploads_and_batches(live, backend):
    api = client(live)
    upload = ("r.jsonl", jsonl(chat_line("x")))
    with pytest.raises(openai.BadRequestError) as err:
        api.files.create(file=upload, purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as err:
        api.files.create(file=("big.jsonl", io.BytesIO(b"x" * (UPLOAD_LIMIT + 1))), purpose="batch")
    assert err.value.status_code == 413 and err.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as err:
        api.files.create(file=("latin1.jsonl", io.BytesIO("caf\xe9".encode("latin-1"))), purpose="batch")
    assert "UTF-8" in err.value.body["message"]
    r = httpx.post(f"{live[1].url}/v1/files", json={"purpose": "batch"}, headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    # sent chunked (no content-length): refused as the body passes the limit, taken below it
    for size, status in ((UPLOAD_LIMIT + (128 << 10), 413), (100, 200)):
        head = ('--b0\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b0\r\nContent-Disposition: '
                'form-data; name="file"; filename="c.jsonl"\r\n\r\n').encode()

        def chunks():
            yield head
            for start in range(0, size, 4096):
                yield b"z" * min(4096, size - start)
            yield b"\r\n--b0--\r\n"

        r = httpx.post(f"{live[1].url}/v1/files", content=chunks(), headers={
            "Authorization": "Bearer sk-a", "content-type": "multipart/form-data; boundary=b0"})
        assert r.status_code == status, r.text
        assert status == 413 or r.json()["bytes"] == size
    source = api.files.create(file=upload, purpose="batch")
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"},
                                                                         "completion_window")):
        with pytest.raises(openai.BadRequestError) as err:
            api.batches.create(**{"input_file_id": source.id, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", **kwargs})
        assert err.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        api.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_nope")
    # the store's room for files (64 KiB here): an upload past it is refused, deleting makes room
    kept = []
    with pytest.raises(openai.BadRequestError) as err:
        for _ in range(8):
            kept.append(api.files.create(file=("f.jsonl", io.BytesIO(b"y" * (UPLOAD_LIMIT - 10))), purpose="batch"))
    assert err.value.body["code"] == "file_storage_full" and kept
    for f in kept:
        api.files.delete(f.id)
    api.files.delete(api.files.create(file=("f.jsonl", io.BytesIO(b"y" * (UPLOAD_LIMIT - 10))), purpose="batch").id)


def test_without_a_store_the_routes_are_a_400():
    backend = ScriptedBackend()
    with scripted_app(backend) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as err:
            api.files.create(file=("r.jsonl", jsonl(chat_line("x"))), purpose="batch")
        assert "store" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            api.batches.list()


def test_the_store_hands_a_silent_or_given_back_batch_to_one_new_runner_with_its_answers(tmp_path):
    """batch_store's runner leases: the creator's claim, progress writes that keep the answers, adoption of a batch
    silent for orphan_after_s (at once when given back), a superseded runner told `lost` and refused, and the file
    round trip (a batch unfinished at a restart is adopted once silent, or taken back by its runner's next write)."""
    from serve_app.openai_api.batch_store import StoredFile
    from serve_app.openai_api.store_file import StoreFile

    now = [0.0]
    path = tmp_path / "store.sqlite"
    store = MemoryResponseStore(file=StoreFile(path), clock=lambda: now[0], orphan_after_s=30)
    batch = {"id": "batch_1", "status": "in_progress", "created_at": 1, "errors": None}
    counts = {"request_counts": {"total": 3, "completed": 1, "failed": 0}}

    async def go():
        await store.put_file("file-1", StoredFile({"id": "file-1", "purpose": "batch", "created_at": 1}, "{}\n", "k"))
        await store.put_batch("batch_1", StoredBatch(batch, "k"))
        await store.put_batch("batch_2", StoredBatch({**batch, "id": "batch_2"}, "k"))
        assert await store.claim_batch("batch_1", "r1") and not await store.claim_batch("batch_1", "r2")
        assert await store.claim_batch("batch_2", "q1")
        now[0] = 20
        assert await store.batch_progress("batch_1", "r1", counts, ["a\n"], []) == "run"
        now[0] = 40
        assert await store.batch_progress("batch_2", "q1", counts, [], []) == "run"
        now[0] = 45
        assert await store.adopt_batch("r2") is None  # batch_1 silent for 25 s, batch_2 for 5 s
        now[0] = 51
        adopted = await store.adopt_batch("r2")
        assert adopted[0]["id"] == "batch_1" and adopted[0]["request_counts"] == counts["request_counts"]
        assert adopted[1:] == ("k", ["a\n"], [])
        assert await store.adopt_batch("r3") is None  # adopted once
        assert await store.batch_progress("batch_1", "r1", counts, ["late\n"], []) == "lost"
        assert await store.update_batch("batch_1", {"status": "completed"}, "r1") is None
        assert await store.batch_progress("batch_1", "r2", counts, ["b\n"], ["e\n"]) == "run"
        assert (await store.request_batch_cancel("batch_1"))["status"] == "cancelling"
        assert await store.batch_progress("batch_1", "r2", counts, [], []) == "cancel"
        await store.release_batch("batch_1", "r2", ["c\n"], [])  # its replica stops
        assert await store.adopt_batch("r3") == ((await store.get_batch("batch_1")).batch, "k", ["a\n", "b\n", "c\n"],
                                                 ["e\n"])  # at once, with every answer
        ended = await store.update_batch("batch_1", {"status": "cancelled"}, "r3")
        assert ended["status"] == "cancelled" and await store.batch_progress("batch_1", "r3", counts, [], []) == "lost"
        assert await store.update_batch("batch_1", {"status": "completed"}, "r3") is None  # final stays final
        now[0] = 60
        assert await store.batch_progress("batch_2", "q1", {}, ["x\n"], []) == "run"  # batch_2's runner was slow
        again = MemoryResponseStore(file=StoreFile(path), clock=lambda: now[0], orphan_after_s=30)
        assert (await again.get_file("file-1", True)).text == "{}\n" and again.file_bytes == 3
        assert (await again.get_batch("batch_1")).batch["status"] == "cancelled"
        assert len(again) == 0  # files and batches are not responses (nor dropped for their room)
        assert await again.adopt_batch("s1") is None  # batch_2: read back unfinished, its runner may still write
        now[0] = 91
        assert await again.adopt_batch("s1") == ((await again.get_batch("batch_2")).batch, "k", [], [])
        assert await again.batch_progress("batch_2", "q1", {}, [], []) == "lost"

    asyncio.run(go())


def test_a_stopping_replica_gives_its_batch_back_and_another_finishes_it():
    """BatchRuns.stop() (the ingress replica's graceful shutdown): the running batch goes back to the store with the
    answers it had, its lines in flight aborted; another replica (a second app on the same store) adopts it at once
    and runs the lines without an answer. Each custom_id answers once, the first replica's answer kept."""
    from serve_app.openai_api.app import create_app

    backend, store = ScriptedBackend(), MemoryResponseStore()
    backend.push(ANSWER)
    for _ in range(2):
        backend.push(ANSWER * 10, chunk=1, delay_s=0.5)  # in flight when the replica stops
    for _ in range(3):
        backend.push(ANSWER)  # the second replica's
    first, second = (create_app(backend, model_name=MODEL, max_context=backend.max_context, response_store=store,
                                batch_concurrency=2) for _ in range(2))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://app") as http:
            made = await create_over_asgi(http, *(chat_line(f"r{i}") for i in range(4)))
            for _ in range(200):
                batch = (await http.get(f"/v1/batches/{made['id']}")).json()
                if batch["request_counts"]["completed"] == 1:
                    break
                await asyncio.sleep(0.05)
            assert batch["status"] == "in_progress" and len(first.state.batches) == 1
            assert await second.state.batches.adopt() is None  # its runner is alive
            await first.state.batches.stop()
            assert len(first.state.batches) == 0 and len(backend.aborted) == 2
            assert await first.state.batches.adopt() is None  # a stopping replica adopts nothing
            assert await second.state.batches.adopt() == made["id"]
            for _ in range(200):
                batch = (await http.get(f"/v1/batches/{made['id']}")).json()
                if batch["status"] == "completed":
                    break
                await asyncio.sleep(0.05)
            assert batch["status"] == "completed" and batch["errors"] is None, batch
            assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
            out = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
            ids = [json.loads(line)["custom_id"] for line in out.splitlines()]
            assert ids[0] == "r0" and sorted(ids) == ["r0", "r1", "r2", "r3"]
            assert len(backend.requests) == 6  # r0 once, r1 and r2 twice (aborted, then again), r3 once
            assert batch["output_file_id"] in {f["id"] for f in (await http.get("/v1/files")).json()["data"]}

    asyncio.run(go())


def test_a_runner_superseded_after_silence_stops_without_writing():
    """A replica whose writes did not reach the store for orphan_after_s (a partition, not a death) loses its batch to
    an adopter: its next write hears `lost` and it aborts its lines; only the adopter writes the batch's files."""
    from serve_app.openai_api.app import create_app

    now = [0.0]
    backend, store = ScriptedBackend(), MemoryResponseStore(clock=lambda: now[0], orphan_after_s=30)
    for _ in range(2):
        backend.push(ANSWER * 10, chunk=1, delay_s=0.3)  # the first replica's, in flight
    for _ in range(2):
        backend.push(ANSWER)  # the adopter's
    first, second = (create_app(backend, model_name=MODEL, max_context=backend.max_context, response_store=store,
                                batch_concurrency=2) for _ in range(2))
    first.state.batches.poll_s = 0.1

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://app") as http:
            made = await create_over_asgi(http, chat_line("a"), chat_line("b"))
            for _ in range(100):
                if len(backend.requests) == 2:
                    break
                await asyncio.sleep(0.02)
            now[0] = 31  # the store has not heard from the first replica for orphan_after_s
            assert await second.state.batches.adopt() == made["id"]
            for _ in range(200):
                batch = (await http.get(f"/v1/batches/{made['id']}")).json()
                if batch["status"] == "completed" and len(first.state.batches) == 0:
                    break
                await asyncio.sleep(0.05)
            assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2, batch
            assert len(first.state.batches) == 0 and len(backend.aborted) == 2  # it stopped, aborting its lines
            files = (await http.get("/v1/files")).json()["data"]
            assert [f["filename"] for f in files if f["purpose"] == "batch_output"] == [f"{made['id']}_output.jsonl"]

    asyncio.run(go())


def test_an_output_file_without_room_fails_the_batch_saying_so():
    backend = ScriptedBackend()
    for _ in range(3):
        backend.push(ANSWER)
    text = jsonl(*(chat_line(f"r{i}") for i in range(3))).getvalue()
    store = MemoryResponseStore(max_file_bytes=len(text) + 200)  # the input fits, its answers do not
    with scripted_app(backend, response_store=store) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        source = api.files.create(file=("r.jsonl", text), purpose="batch")
        batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        failed = wait_for(api, batch.id, "failed", "completed")
        assert failed.status == "failed" and failed.output_file_id is None
        assert failed.request_counts.completed == 3
        [error] = failed.errors.data
        assert error.code == "file_storage_full" and "output file" in error.message
        assert [f.id for f in api.files.list()] == [source.id]


def test_a_line_refused_for_full_queues_is_tried_again():
    """A 503 (full queues: BackendOverloaded) does not fail a batch line: it is sent again after Retry-After (1 s)."""
    from engine.request import BackendOverloaded

    backend, store = ScriptedBackend(), MemoryResponseStore()
    backend.push(ANSWER, error=BackendOverloaded("decode queue full"))
    backend.push(ANSWER)
    with scripted_app(backend, response_store=store) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        source = api.files.create(file=("r.jsonl", jsonl(chat_line("busy"))), purpose="batch")
        batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(api, batch.id, "completed", "failed")
        assert done.request_counts.model_dump() == {"total": 1, "completed": 1, "failed": 0}
        [line] = lines_of(api, done.output_file_id).values()
        assert line["response"]["body"]["choices"][0]["message"]["content"] == "Hello there!"
        assert len(backend.requests) == 2 and done.error_file_id is None


def test_a_store_that_fails_for_a_while_does_not_stop_a_batch():
    """The run's progress writes fail for a few polls (the store replica is away): the batch goes on and completes."""
    from serve_app.openai_api.app import create_app

    class FlakyStore(MemoryResponseStore):
        failures = 3

        async def batch_progress(self, batch_id, runner, changes, output, errors):
            if self.failures:
                self.failures -= 1
                raise TimeoutError("the store is away")
            return await super().batch_progress(batch_id, runner, changes, output, errors)

    backend, store = ScriptedBackend(), FlakyStore()
    for _ in range(2):
        backend.push(ANSWER * 4, chunk=1, delay_s=0.15)  # ~2.4 s each: several polls while they run
    app = create_app(backend, model_name=MODEL, max_context=backend.max_context, response_store=store)
    app.state.batches.poll_s = 0.2

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            made = await create_over_asgi(http, chat_line("a"), chat_line("b"))
            for _ in range(300):
                batch = (await http.get(f"/v1/batches/{made['id']}")).json()
                if batch["status"] not in ("validating", "in_progress", "finalizing"):
                    break
                await asyncio.sleep(0.05)
            assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2, batch
            assert store.failures == 0

    asyncio.run(go())


def test_a_batch_past_its_window_expires_keeping_what_ended(monkeypatch):
    from serve_app.openai_api import batches

    monkeypatch.setitem(batches.COMPLETION_WINDOWS, "24h", 2)  # a 2-second window for this test
    backend = ScriptedBackend()
    backend.push(ANSWER)
    for _ in range(3):
        backend.push(ANSWER * 20, chunk=1, delay_s=0.5)  # ~60 s each unless stopped
    with scripted_app(backend, response_store=MemoryResponseStore(), batch_concurrency=2) as server:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        source = api.files.create(file=("r.jsonl", jsonl(*(chat_line(f"r{i}") for i in range(4)))), purpose="batch")
        batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.expires_at - batch.created_at == 2
        expired = wait_for(api, batch.id, "expired", "completed", "failed", timeout_s=20)
        assert expired.status == "expired" and expired.expired_at and expired.errors is None
        assert expired.request_counts.completed == 1 and expired.request_counts.total == 4
        assert list(lines_of(api, expired.output_file_id)) == ["r0"]
    assert len(backend.aborted) == 2  # the two lines in flight


def test_the_replicas_batches_share_its_batch_concurrency():
    """batch_concurrency is the replica's, not each batch's: two batches of 3 slow lines at concurrency 2 never have
    more than 2 lines in the engine at once, and both complete (no slot lost between them)."""
    from serve_app.openai_api.app import create_app

    backend, store = ScriptedBackend(), MemoryResponseStore()
    for _ in range(6):
        backend.push(ANSWER * 2, chunk=1, delay_s=0.03)  # ~0.5 s each
    app = create_app(backend, model_name=MODEL, max_context=backend.max_context, response_store=store,
                     batch_concurrency=2)
    in_flight, most = 0, 0
    generate = backend.generate

    async def counted(request):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            async for delta in generate(request):
                yield delta
        finally:
            in_flight -= 1

    backend.generate = counted

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            made = []
            for name in ("a", "b"):
                made.append((await create_over_asgi(http, *(chat_line(f"{name}{i}") for i in range(3))))["id"])
            for _ in range(400):
                batches = [(await http.get(f"/v1/batches/{batch_id}")).json() for batch_id in made]
                if all(batch["status"] not in ("validating", "in_progress", "finalizing") for batch in batches):
                    break
                await asyncio.sleep(0.05)
            assert [batch["status"] for batch in batches] == ["completed", "completed"], batches
            assert [batch["request_counts"]["completed"] for batch in batches] == [3, 3]

    asyncio.run(go())
    assert len(backend.requests) == 6 and most == 2


def test_a_run_cancelled_before_its_lines_start_gives_back_their_shared_slots():
    """run_batch with a shared semaphore, cancelled while its lines' tasks have not run yet: every slot comes back."""
    from serve_app.run_batch import BatchSummary, parse_line, run_batch

    async def never_called(scope, receive, send):
        raise AssertionError("no line should reach the app")

    async def go():
        slots = asyncio.Semaphore(3)
        lines = [parse_line(i + 1, json.dumps(chat_line(f"r{i}"))) for i in range(3)]
        work = asyncio.ensure_future(run_batch(never_called, iter(lines), io.StringIO(), BatchSummary(3), slots,
                                               progress=None))
        for _ in range(100):  # until the run took every slot: its line tasks are made and have not started
            if not slots._value or work.done():
                break
            await asyncio.sleep(0)
        assert slots._value == 0 and not work.done()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        assert slots._value == 3

    asyncio.run(go())


def test_files_expire_after_what_the_upload_or_the_batch_asked(live, backend):
    """expires_after on an upload and output_expires_after on a batch set the files' expires_at (anchor created_at,
    1 hour to 30 days, else a 400 naming the field); a file past its expires_at is gone from reads and lists, and its
    room is freed for the next upload."""
    api = client(live)
    backend.push(ANSWER)
    source = api.files.create(file=("r.jsonl", jsonl(chat_line("a"))), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": 3600})
    assert source.expires_at == source.created_at + 3600
    assert api.files.retrieve(source.id).expires_at == source.expires_at
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 7200})
    done = wait_for(api, batch.id, "completed", "failed")
    output = api.files.retrieve(done.output_file_id)
    assert done.status == "completed" and output.expires_at == output.created_at + 7200
    assert done.model == MODEL and done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens > 0
    for bad, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.files.create(file=("r.jsonl", jsonl(chat_line("a"))), purpose="batch", expires_after=bad)
        assert refused.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:
        api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                           output_expires_after={"anchor": "created_at", "seconds": 31 * 24 * 3600})
    assert refused.value.body["param"] == "output_expires_after.seconds"


def test_an_expired_file_is_gone_and_its_room_freed():
    from serve_app.openai_api.batch_store import StoredFile

    store = MemoryResponseStore(max_file_bytes=10)
    now = int(time.time())

    def file(file_id: str, expires_at) -> StoredFile:
        return StoredFile({"id": file_id, "purpose": "batch", "created_at": now, "bytes": 6,
                           "expires_at": expires_at}, "{}\n{}\n", "k")

    async def go():
        assert await store.put_file("file-old", file("file-old", now - 1))  # past already (a clock that moved on)
        assert await store.get_file("file-old") is None and store.file_bytes == 0  # read: deleted
        assert await store.put_file("file-a", file("file-a", now - 1)) and store.file_bytes == 6
        assert (await store.list_files("k", None, "desc", 10, None)) == ([], False)
        assert await store.put_file("file-b", file("file-b", now + 3600))  # fits once file-a's room is freed
        assert store.file_bytes == 6 and [f["id"] for f in (await store.list_files("k", None, "desc", 10, None))[0]] \
            == ["file-b"]
        assert not await store.put_file("file-c", file("file-c", None))  # file-b has not expired: no room
        assert await store.sweep_expired_files() == 0

    asyncio.run(go())


def test_lines_end_at_newlines_only():
    """A JSONL line may hold U+2028 / U+2029 / U+0085 raw inside a JSON string (json.dumps with ensure_ascii=False
    writes them so); they do not end the line (str.splitlines would have cut it and failed the batch as "not JSON").
    CRLF line ends work too."""
    from serve_app.openai_api.batch_runs import batch_lines, check_lines

    lines = [chat_line(f"r{i}", messages=[{"role": "user", "content": f"a{sep}b"}])
             for i, sep in enumerate(("\u2028", "\u2029", "\u0085", "\x0b"))]
    text = "\r\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\r\n\r\n"
    assert check_lines(text, "/v1/chat/completions") == (4, {MODEL}, [])
    parsed = list(batch_lines(text, skip={"r1"}))
    assert [(line.number, line.custom_id) for line in parsed] == [(1, "r0"), (3, "r2"), (4, "r3")]
    assert parsed[0].body["messages"][0]["content"] == "a\u2028b"
