"""The store's side of background responses (background.py): which ingress replica runs each unfinished one, the
cancels on their way to it, and handing a run over when its replica stops.

Each ingress replica has a runner token (BackgroundRuns.runner). Its runs' writes (put, append_events) and its cancel
polls (cancel_requested, every 0.5 s) carry it: the polls tell the store the replica is alive, and only the
response's current runner's writes count. A background response keeps what it takes to run it again
(StoredResponse.rerun: the request, its priority, the model) while it is unfinished, so it outlives its replica:
a replica that stops gracefully gives it back (release_response: status `queued` again; what it had generated is
dropped), one that dies falls silent, and the next ingress replica of the same model that asks (adopt_responses,
each replica's health check) runs it again from the start, at once when given back, after `orphan_after_s` of
silence otherwise. A run whose response was adopted elsewhere (its replica was cut off, not dead) hears a cancel at
its next poll and its final write is refused. A response adopted MAX_RUNS times without finishing, or adopted by no
one for ADOPT_PATIENCE x orphan_after_s (no ingress replica of its model is left), is marked failed.

A streamed background response (its client may have read part of its events) is not run again from the start: the
adopter continues it (responses.resume_response) from the events stored here, the output tokens that made them and
the prompt they followed (append_events keeps them, from one write each: a run cut off from the store loses only what it had not written,
and its writes stop counting once the response is adopted). One that cannot be continued (its request asked for
logprobs, whose state in waiting is not kept) has no `rerun` and is marked failed as before: when its
replica stops (background.BackgroundRuns.stop), or `orphan_after_s` after its replica's last poll (on a read, or by
sweep_orphans, which the store's Serve replica runs every few seconds). One whose events the store lost (memory
only: a restart) is adopted without them, and its adopter stores it failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

log = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")  # a background response still running (background.py)
MAX_RUNS = 3  # runs of one background response (its first included) before it is marked failed
ADOPT_PATIENCE = 4  # a response that can run again waits this many orphan_after_s for an adopter, then fails
# responses one ask adopts at most (a replica asks every health check, 10 s): a dead replica's hundreds of runs are
# taken in a few checks, well within ADOPT_PATIENCE, and one ask's prompts are rendered within the check's 5 s
ADOPT_AT_ONCE = 64


class BackgroundLeases:
    """Background runs' state in MemoryResponseStore (which provides _items, _response_entry, _write, _make_room,
    _events, _stream_output, _stream_prompt and append_events): when each unfinished response's replica was last heard from, its
    runner, the cancels asked for, the responses given back."""

    def __init__(self, orphan_after_s: float, clock=time.monotonic):
        self.orphan_after_s = orphan_after_s
        self._clock = clock
        self._seen: dict[str, float] = {}  # unfinished response -> when its replica last wrote it or polled
        self._runner_of: dict[str, str] = {}  # unfinished response -> the runner token of the replica running it
        self._released: set[str] = set()  # given back by a stopping replica: adopted at the next ask
        # Unfinished background responses asked to stop (cancelled, or deleted while running): the ingress replica
        # running one polls cancel_requested, and its final put clears the entry.
        self._cancel: set[str] = set()
        self.responses_adopted = 0  # runs taken over from a stopped or silent replica (the store's metrics)

    def _forget_run(self, response_id: str) -> None:
        self._seen.pop(response_id, None)
        self._runner_of.pop(response_id, None)
        self._released.discard(response_id)

    def _lost_by(self, response_id: str, runner: str | None) -> bool:
        """Whether a write or poll from `runner` comes from a run that no longer holds the response (adopted
        elsewhere); None (no runner: a cancel's own write, a foreground response) never is."""
        return runner is not None and self._runner_of.get(response_id, runner) != runner

    def _heard(self, response_id: str, runner: str | None) -> None:
        self._seen[response_id] = self._clock()
        if runner is not None:
            self._runner_of[response_id] = runner  # (after a store restart the first word names the runner again)

    def running(self) -> int:
        """Background responses stored as unfinished (queued or in progress), orphans not yet marked included."""
        return len(self._seen)

    async def request_cancel(self, response_id: str) -> bool:
        """Ask the replica running this background response to stop it; False if it is not stored or finished. One
        given back and not adopted yet (no replica runs it) is cancelled here at once."""
        entry = self._response_entry(response_id)
        if entry is None or entry[0].response.get("status") not in UNFINISHED:
            return False
        if response_id in self._released:
            self._restate(response_id, replace(entry[0], rerun=None,
                                               response={**entry[0].response, "status": "cancelled"}))
            self._forget_run(response_id)
            return True
        self._cancel.add(response_id)
        return True

    async def cancel_requested(self, response_ids: list[str], runner: str | None = None) -> list[str]:
        """Those of `response_ids` to stop: asked to (one call per poll for all of an ingress replica's runs) or, with
        `runner`, run by another replica now. The poll also says the replica running the others is alive."""
        for response_id in response_ids:
            if response_id in self._seen and not self._lost_by(response_id, runner):
                self._heard(response_id, runner)
        return [response_id for response_id in response_ids
                if response_id in self._cancel or (response_id in self._seen and self._lost_by(response_id, runner))]

    async def release_response(self, response_id: str, runner: str) -> bool:
        """A stopping replica gives back an unfinished response it can leave to another (one with `rerun`): status
        `queued` again, adopted at the next ask. False (the caller stores it failed): not stored, finished, not this
        runner's, cancelled meanwhile, or not one to run again."""
        entry = self._response_entry(response_id)
        if entry is None or entry[0].rerun is None or entry[0].response.get("status") not in UNFINISHED \
                or response_id in self._cancel or self._runner_of.get(response_id) != runner:
            return False
        self._restate(response_id, replace(entry[0], response={**entry[0].response, "status": "queued"}))
        self._runner_of.pop(response_id, None)
        self._released.add(response_id)
        return True

    async def adopt_responses(self, runner: str, model: str, limit: int = ADOPT_AT_ONCE) -> list[tuple[str, Any]]:
        """Take over, for `runner`, at most `limit` of `model`'s responses given back or silent for orphan_after_s
        (those that can run again): [(response id, its StoredResponse, status queued, rerun's run count raised)]."""
        now, taken = self._clock(), []
        for response_id in list(self._seen):
            entry = self._response_entry(response_id)
            if entry is None:
                continue
            stored = entry[0]
            if stored.rerun is None or stored.rerun.get("model") != model or response_id in self._cancel \
                    or stored.response.get("status") not in UNFINISHED:
                continue
            if response_id not in self._released and now - self._seen[response_id] <= self.orphan_after_s:
                continue  # its runner is alive
            runs = stored.rerun.get("runs", 1) + 1
            if runs > MAX_RUNS:
                await self._fail_orphan(response_id, stored, f"it was started {MAX_RUNS} times and its server "
                                        "replica stopped each time before it finished")
                continue
            adopted = replace(stored, response={**stored.response, "status": "queued"},
                              rerun={**stored.rerun, "runs": runs})
            self._restate(response_id, adopted)
            self._released.discard(response_id)
            self._heard(response_id, runner)
            self.responses_adopted += 1
            log.info("background response %s: adopted by runner %s (run %d)", response_id, runner, runs)
            if response_id in self._stream_output:  # a stream: the run goes on from its stored events (not kept here)
                adopted = replace(adopted, rerun={**adopted.rerun, "stream": {
                    "events": list(self._events[response_id][0]),
                    "output_ids": list(self._stream_output[response_id]),
                    "prompt_ids": self._stream_prompt.get(response_id)}})
            taken.append((response_id, adopted))
            if len(taken) >= limit:
                break
        return taken

    async def sweep_orphans(self) -> int:
        """Mark failed every unfinished response left without a runner too long (_orphaned), without waiting for a
        read (a dead replica's runs otherwise stay `in_progress` until someone asks); returns how many. Not a use of
        them: their places in the least-recently-used order stay."""
        orphans = [rid for rid in list(self._seen) if rid in self._items and self._orphaned(rid, self._items[rid][0])]
        for response_id in orphans:
            await self._fail_orphan(response_id, self._items[response_id][0])
        return len(orphans)

    def _orphaned(self, response_id: str, stored: Any) -> bool:
        """Unfinished and silent for orphan_after_s (ADOPT_PATIENCE times that for one another replica may run)."""
        if stored.response.get("status") not in UNFINISHED:
            return False
        wait = self.orphan_after_s * (ADOPT_PATIENCE if stored.rerun is not None else 1)
        return self._clock() - self._seen.get(response_id, self._clock()) > wait

    async def _fail_orphan(self, response_id: str, stored: Any, why: str | None = None) -> Any:
        """Store it as failed in its place; its stream, if it has one, ends with response.failed."""
        why = why or "its server replica stopped before it finished"
        log.warning("background response %s: marked failed (%s)", response_id, why)
        failed = replace(stored, rerun=None, response={**stored.response, "status": "failed", "error": {
            "code": "server_error", "message": f"This background response did not finish: {why}; create it again."}})
        self._cancel.discard(response_id)
        self._forget_run(response_id)
        if response_id in self._events:  # its stream ends as a failed response's does
            events = self._events[response_id][0]
            await self.append_events(response_id, [{"type": "response.failed", "sequence_number":
                                                    events[-1]["sequence_number"] + 1 if events else 0,
                                                    "response": failed.response}])
            if response_id not in self._items:  # that event made room by dropping the response itself
                return failed
        self._restate(response_id, failed)
        return failed

    def _restate(self, response_id: str, stored: Any) -> None:
        """Store `stored` at `response_id` in its place (OrderedDict assignment keeps the position)."""
        body = stored.to_json()
        self.bytes += len(body) - self._items[response_id][1]
        self._items[response_id] = (stored, len(body))
        self._write(response_id, stored, body)
        self._make_room()

