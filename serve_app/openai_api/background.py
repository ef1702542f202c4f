"""Background responses: `background: true` on POST /v1/responses returns at once (status `queued`) while the
response is generated in a task of the ingress replica that took it; clients poll GET /v1/responses/{id} and may
POST /v1/responses/{id}/cancel.

The task is not tied to the HTTP request, so a client that leaves, or a load balancer's idle timeout, does not
stop it. Its states go to the response store (`queued` when accepted, `in_progress` once the engine has taken
it, then `completed`, `incomplete`, `failed` or `cancelled`), so every ingress replica answers GET and cancel.
A cancel that reaches another ingress replica is passed on through the store: the running replica polls it
(`poll_s`) and stops the task, which stores `cancelled` with what was generated so far.

With `stream: true` too, the run records its stream events in the store (EventRecorder: a write every
FLUSH_S at most) and the client reads them from there (follow_events, a read every FOLLOW_POLL_S): on the
POST that created it, or on GET /v1/responses/{id}?stream=true&starting_after=N from any ingress replica, after a
dropped connection. A follower that leaves stops nothing. A cancelled run's events end without a terminal event
(OpenAI's stream events have none for `cancelled`; GET says so); an orphaned one's end with `response.failed`.

An ingress replica that stops (scale-down, redeploy) gives its runs `stop()`'s few seconds to finish. The rest are
given back to the store (status `queued` again) and another ingress replica of the same model takes them up
(`adopt`, from each replica's health check); so are those of a replica that died, once the store has heard nothing
from it for `orphan_after_s` (30 s). One created without `stream` runs again from the start. A streamed one (its
client may have read part of its events) goes on from where its stored events end: each event write also carries
the output tokens that made the events (EventRecorder; the first write, the prompt), and the adopter's run feeds them
to a fresh parser, takes up the stored items and sequence numbers, and asks the engine for the rest with that prompt
followed by that output
(response_run.ResponseRun's `resume`; a constraint starts past that output). A streamed one that asked for logprobs
cannot go on (the logprobs in waiting are not kept): it is stored `failed` (code `server_error`, the message says
why; the client may create it again), or marked so by the store after that silence. background_store.py has the
store's side.

Runs are started detached (`detached`): with empty context variables, so that under Ray Serve their engine calls
are not child requests of the POST that created them (Serve cancels those when the POST is cancelled: a streamed
POST's client that leaves).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable

from serve_app.openai_api.stored_responses import ResponseStore, StoredResponse, is_unfinished
from serve_app.openai_api.streaming import sse

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5  # how often a running background response asks the store whether it was cancelled
CANCEL_WAIT_S = 10.0  # how long a cancel waits for the run to store its final state
FLUSH_S = 0.05  # a streamed background run writes its new events to the store at most this often
FOLLOW_POLL_S = 0.05  # a follower asks the store for new events this often while there are none


class EventRecorder:
    """A streamed background run's events on their way to the store, written in batches (one store call per
    FLUSH_S, not per token). A write that fails keeps its events for the next one (logged), so a store that is
    away for a while delays the followers but leaves no gap; the store ignores events it already has, so a write
    that timed out after it landed repeats nothing. Each write also carries the run's output tokens not yet
    written (`output_ids`: the generation's list, growing; the first `written` of them are stored already), those
    that made its events: where another replica's run goes on if this one stops. `runner`: this replica's token
    (once another replica runs the response, the store refuses the writes)."""

    def __init__(self, store: ResponseStore, response_id: str, runner: str | None = None,
                 output_ids: list[int] | None = None, written: int = 0, flush_s: float = FLUSH_S):
        self.store, self.response_id, self.runner, self.flush_s = store, response_id, runner, flush_s
        self.output_ids = output_ids if output_ids is not None else []
        self._written = written
        self._pending: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()

    async def add(self, events: list[dict[str, Any]]) -> None:
        """Queue events; write the queue when FLUSH_S has passed since the last write."""
        self._pending.extend(events)
        if time.monotonic() - self._last_flush >= self.flush_s:
            await self.flush()

    async def flush(self) -> bool:
        """Write the queued events; False if the store failed (they stay queued for the next write)."""
        self._last_flush = time.monotonic()
        tokens = self.output_ids[self._written:]
        if not self._pending and not tokens:
            return True
        try:
            await self.store.append_events(self.response_id, self._pending, self.runner, tokens, self._written)
        except Exception as err:
            log.warning("background response %s: %d stream events not stored yet (%s: %s); retrying with the next "
                        "write", self.response_id, len(self._pending), type(err).__name__, err)
            return False
        self._pending = []
        self._written += len(tokens)
        return True

    async def close(self, tries: int = 3, wait_s: float = 0.2) -> None:
        """The run's last write (its final events, before its final state): tried `tries` times."""
        for attempt in range(tries):
            if await self.flush():
                return
            if attempt + 1 < tries:
                await asyncio.sleep(wait_s)
        log.error("background response %s: its last %d stream events were not stored; its stream ends without them",
                  self.response_id, len(self._pending))


async def follow_events(store: ResponseStore, response_id: str, after: int,
                        poll_s: float = FOLLOW_POLL_S) -> AsyncIterator[bytes]:
    """SSE frames of a streamed background response's events after sequence number `after`, as they are stored,
    until it has finished and every event is out (or it is deleted). A store that fails ends the stream with an
    `error` event; the response goes on, and the client can resume."""
    last = after
    while True:
        try:
            got = await store.events_after(response_id, last)
        except Exception as err:
            log.warning("background response %s: reading its events failed (%s: %s)", response_id,
                        type(err).__name__, err)
            yield sse({"type": "error", "sequence_number": last + 1, "code": "server_error", "param": None,
                       "message": f"The response store did not answer ({type(err).__name__}); resume with "
                                  f"starting_after={last}."}, event="error")
            return
        if got is None:  # deleted (or dropped for room) meanwhile
            return
        events, finished = got
        for ev in events:
            last = ev["sequence_number"]
            yield sse(ev, event=ev["type"])
        if finished and not events:
            return
        if not events:
            await asyncio.sleep(poll_s)


Resume = Callable[[str, StoredResponse], Awaitable[None]]


def detached(work: Awaitable[Any]) -> asyncio.Task:
    """A task that belongs to no request: started with empty context variables, not a copy of the caller's. Under
    Ray Serve the request context is one (serve.context): handle calls made in a copy of it are the request's child
    requests, which Serve cancels when the request is cancelled, as when the client of a streamed POST leaves. A
    background run or a batch must outlive the request that created it."""
    return asyncio.get_running_loop().create_task(work, context=contextvars.Context())


class BackgroundRuns:
    """The background responses this app (one ingress replica) runs: response id -> its task. `runner`: this
    replica's token on its writes and polls; `model`: the model whose given-back responses it adopts; `resume`
    (set by the app, responses.resume_response): starts an adopted response's run here."""

    def __init__(self, store: ResponseStore, poll_s: float = CANCEL_POLL_S, model: str = ""):
        self.store = store
        self.poll_s = poll_s
        self.model = model
        self.runner = f"bg-{uuid.uuid4().hex}"
        self.resume: Resume | None = None
        self._runs: dict[str, asyncio.Task] = {}
        self._watcher: asyncio.Task | None = None  # one poll of the store for all runs, while there are any
        self.stopping = False  # set by stop(): a run cancelled now is given back or stored as failed, not cancelled
        self.closing = False  # set as stop() begins: nothing more is adopted here
        self._starting: set[asyncio.Task] = set()  # adopted responses whose runs are being set up (resume)

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, response_id: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run `run()` (which stores the response's states itself, `cancelled` when cancelled) until it ends
        or a cancel for `response_id` arrives, here or through the store."""
        work = detached(run())
        self._runs[response_id] = work
        work.add_done_callback(lambda done: self._runs.pop(response_id) if self._runs.get(response_id) is done
                               else None)
        if self._watcher is None or self._watcher.done():
            self._watcher = detached(self._watch())

    async def adopt(self) -> list[str]:
        """Run here the responses of this app's model that the store says were given back or left silent (the
        ingress' health check asks every period); their ids."""
        if self.closing or self.resume is None:
            return []
        adopted = await self.store.adopt_responses(self.runner, self.model)
        for response_id, stored in adopted:  # (each in its own task: a slow prompt does not hold the health check)
            starting = detached(self.resume(response_id, stored))
            self._starting.add(starting)
            starting.add_done_callback(self._started)
        return [response_id for response_id, _ in adopted]

    def _started(self, task: asyncio.Task) -> None:
        self._starting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background responses: starting an adopted one failed", exc_info=task.exception())

    async def give_back(self, response_id: str) -> bool:
        """A run cancelled by stop(): hand its response to another replica (True), if the store takes it (it can run
        again or go on: it keeps its request; not cancelled meanwhile). A store that fails: False (the run stores
        itself failed)."""
        try:
            return await self.store.release_response(response_id, self.runner)
        except Exception as err:
            log.warning("background response %s: giving it back failed (%s: %s)", response_id, type(err).__name__,
                        err)
            return False

    async def _watch(self) -> None:
        """Cancel the runs whose cancel came through the store (from another ingress replica, or a DELETE)."""
        while self._runs:
            await asyncio.sleep(self.poll_s)
            try:
                cancelled = await self.store.cancel_requested(list(self._runs), self.runner)
            except Exception as err:  # the store is away for now: the runs go on, and so does the watch
                log.warning("background responses: cancel check failed (%s: %s)", type(err).__name__, err)
                continue
            for response_id in cancelled:
                work = self._runs.get(response_id)
                if work is not None:
                    work.cancel()

    async def stop(self, wait_s: float) -> None:
        """The replica is stopping: adopt nothing more, give the runs `wait_s` to finish, then cancel the rest with
        `stopping` set (each gives its response back or stores itself as failed) and wait for them to have done that
        (CANCEL_WAIT_S at most)."""
        self.closing = True
        if self._starting:  # adopted runs being set up: let them start, then they are stopped as the others
            await asyncio.wait(set(self._starting), timeout=CANCEL_WAIT_S)
        runs = set(self._runs.values())
        if runs and wait_s > 0:
            _, runs = await asyncio.wait(runs, timeout=wait_s)
        if not runs:
            return
        log.warning("stopping: %d background responses still running; giving them back (or, those that cannot go on "
                    "elsewhere, storing them as failed)", len(runs))
        self.stopping = True
        for work in runs:
            work.cancel()
        await asyncio.wait(runs, timeout=CANCEL_WAIT_S)

    async def cancel(self, response_id: str) -> StoredResponse | None:
        """Stop the background response and return its stored final state (None: not stored). A run on another
        ingress replica is asked through the store and has CANCEL_WAIT_S to store its final state; a run that
        did not (its replica is gone, or it was cancelled before it began) is marked cancelled here."""
        work = self._runs.get(response_id)
        if work is not None:
            work.cancel()
            await asyncio.wait({work}, timeout=CANCEL_WAIT_S)
            deadline = time.monotonic()  # it has ended here: whatever it stored is final
        else:
            await self.store.request_cancel(response_id)
            deadline = time.monotonic() + CANCEL_WAIT_S
        while True:
            stored = await self.store.get(response_id)
            if stored is None or not is_unfinished(stored):
                return stored
            if time.monotonic() >= deadline:
                if work is None:
                    log.warning("background response %s: no final state %g s after its cancel; marking it "
                                "cancelled", response_id, CANCEL_WAIT_S)
                stopped = replace(stored, response={**stored.response, "status": "cancelled"}, rerun=None)
                await self.store.put(response_id, stopped)
                return stopped
            await asyncio.sleep(0.05)
