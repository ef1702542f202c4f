"""Running /v1/batches batches: each in a task of one ingress replica, first the one that created it.

A run reads the batch's input file from the store and checks every line (OpenAI's input lines, run_batch.parse_line,
each naming the batch's endpoint, custom_ids unique): any problem and the batch ends `failed` with one error per line
(code `invalid_request`, its line number), nothing run. Then `in_progress`: the lines go to the server's own app
in-process (run_batch.run_batch over ASGI: the same validation, rendering and answers as over HTTP, answers by
status into the output (2xx) and error files), at most `concurrency` at once on this replica (across all its
batches: the lines share one set of slots, so more batches do not take more of the decode replicas'
max_ongoing_requests, which interactive requests also need), each at the engine priority
`batch_priority` after the interactive requests (the engines' schedulers then run them when interactive ones leave
room, and preempt them for those). A line answered 503 (the engines' queues are full, an engine is being replaced)
is tried again, after Retry-After and then longer waits (at most 10 s), until the batch ends: a busy server slows a
batch, it does not fail its lines. Every `poll_s` the run writes its counts and the answers that ended since to the
store, which answers whether to go on (batch_store.batch_progress: a cancel, or another replica took it over).

A batch ends `completed`; `cancelled` after a cancel (POST /v1/batches/{id}/cancel, here or on another ingress
replica; requests in flight are aborted); `expired` when its completion window passes first. Each keeps the answers
it has in its output and error files (none when empty), written `finalizing` before the final state. A replica that
stops (scale-down, redeploy: `stop()`) gives its batches back with their answers, and one that dies leaves them
silent: either way another ingress replica adopts each (`adopt`, from its health check: at once for a batch given
back, after the store's orphan_after_s for a silent one) and runs the lines that have no answer yet; the lines that
were in flight run again (each custom_id still answers once in the files).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Iterator

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.openai_api.auth import BATCH_STATE
from serve_app.openai_api.background import detached
from serve_app.openai_api.batch_store import StoredFile, iter_jsonl
from serve_app.run_batch import (MAX_REPORTED_PROBLEMS, BatchLine, BatchSummary, kept_answers, line_problem, parse_line,
                                 run_batch)

log = logging.getLogger(__name__)

POLL_S = 1.0  # a run writes its counts and asks for cancels this often
DEFAULT_CONCURRENCY = 64


def check_lines(text: str, endpoint: str) -> tuple[int, set[Any], list[dict[str, Any]]]:
    """(the number of requests, the models their bodies name, []) or (0, set(), OpenAI's batch errors: one per bad
    line, the first MAX_REPORTED_PROBLEMS). Nothing parsed is kept: a run parses each line again as it sends it
    (batch_lines), so a 200 MB file is held once, as its text, not a second time as its bodies' objects."""
    count, models, problems, seen = 0, set(), [], {}
    for number, raw in iter_jsonl(text):
        try:
            line = parse_line(number, raw)
            problem = line_problem(line, seen, endpoint)
        except ValueError as err:
            problem = str(err)
        if problem:
            problems.append({"code": "invalid_request", "message": problem, "param": None, "line": number})
        else:
            count += 1
            models.add(line.body.get("model"))
    if not count and not problems:
        problems.append({"code": "empty_file", "message": "The input file has no requests.", "param": None,
                         "line": None})
    return (count, models, []) if not problems else (0, set(), problems[:MAX_REPORTED_PROBLEMS])


def batch_lines(text: str, skip: set[str]) -> Iterator[BatchLine]:
    """The requests of a file check_lines passed, parsed one at a time as they are sent, but those in `skip`."""
    for number, raw in iter_jsonl(text):
        line = parse_line(number, raw)
        if line.custom_id not in skip:
            yield line


def as_batch_line(app: ASGIApp, owner: str | None) -> ASGIApp:
    """`app` as a batch of `owner`'s key calls it: the key's id in the request's state, marked as a batch's line
    (the API key gate lets it through; the engines get it at batch priority)."""

    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        state = {**scope.get("state", {}), BATCH_STATE: True}
        if owner is not None:
            state["api_key_id"] = owner
        await app({**scope, "state": state}, receive, send)

    return call


class AnswerLines:
    """The answer lines of a run (run_batch writes each whole line with one `write`), and how many of them the store
    has (`sent`): a run's progress writes send the rest."""

    def __init__(self, lines: list[str] = ()):
        self.lines = list(lines)
        self.sent = len(self.lines)

    def write(self, text: str) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        pass

    def unsent(self) -> list[str]:
        return self.lines[self.sent:]

    def text(self) -> str:
        return "".join(self.lines)


def earlier_answers(output: list[str], errors: list[str], summary: BatchSummary
                    ) -> tuple[AnswerLines, AnswerLines, set[str]]:
    """An adopted batch's answers so far (each custom_id once: a progress write the store took but did not answer
    in time was sent again), counted into `summary`: (output, errors, their custom_ids)."""
    seen: set[str] = set()
    kept = [kept_answers(lines, summary, seen) for lines in (output, errors)]
    return AnswerLines(kept[0]), AnswerLines(kept[1]), seen


class BatchRuns:
    """The batches this ingress replica runs: batch id -> its task. `target`: the ASGI app the lines go to (the
    whole app, so a line naming another served model reaches it); set once the app is built."""

    def __init__(self, store, concurrency: int = DEFAULT_CONCURRENCY, poll_s: float = POLL_S):
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, not {concurrency}")
        self.store, self.concurrency, self.poll_s = store, concurrency, poll_s
        self.target: ASGIApp | None = None
        self._runs: dict[str, asyncio.Task] = {}
        self._slots: asyncio.Semaphore | None = None  # made in the event loop, by the first run
        self._released: set[str] = set()  # the runs that gave their batch back
        self.stopping = False

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, batch: dict[str, Any], owner: str | None) -> None:
        """Run a batch this replica just created (once it has claimed it)."""
        self._launch(batch, owner, [], [], claim=True)

    async def adopt(self) -> str | None:
        """Take over one batch whose runner gave it back or went silent (the ingress' health check asks every
        period): the id of the batch now run here, or None."""
        if self.stopping or self.target is None:
            return None
        runner = new_runner()
        found = await self.store.adopt_batch(runner)
        if found is None:
            return None
        batch, owner, output, errors = found
        self._launch(batch, owner, output, errors, runner=runner)
        return batch["id"]

    def _launch(self, batch: dict[str, Any], owner: str | None, output: list[str], errors: list[str],
                claim: bool = False, runner: str | None = None) -> None:
        work = detached(self._run(batch, owner, output, errors, runner or new_runner(), claim))
        self._runs[batch["id"]] = work
        # (a run that lost its batch may end after this replica adopted the batch again: only its own entry goes)
        work.add_done_callback(lambda done: self._runs.pop(batch["id"]) if self._runs.get(batch["id"]) is done
                               else None)

    async def stop(self) -> None:
        """The replica is stopping: every run gives its batch back to the store with the answers it has (another
        ingress replica adopts it and runs the lines without an answer; the lines in flight here are aborted)."""
        runs = set(self._runs.values())
        self.stopping = True
        if not runs:
            return
        log.warning("stopping: giving %d running batches back for another replica to finish", len(runs))
        for work in runs:
            work.cancel()
        await asyncio.wait(runs, timeout=10.0)

    async def _run(self, batch: dict[str, Any], owner: str | None, output: list[str], errors: list[str], runner: str,
                   claim: bool) -> None:
        batch_id = batch["id"]
        try:
            if claim and not await self.store.claim_batch(batch_id, runner):
                return  # another replica adopted it first
            await self._run_lines(batch, owner, output, errors, runner)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            if runner not in self._released:  # stopped before its lines ran: given back as it was
                await asyncio.shield(self._release(batch_id, runner, AnswerLines(), AnswerLines()))
        except Exception:
            log.exception("batch %s failed", batch_id)
            await self._end(batch_id, runner, "failed", errors=[{"code": "server_error", "line": None, "param": None,
                                                                 "message": "The batch's run failed on the server."}])

    async def _run_lines(self, batch: dict[str, Any], owner: str | None, earlier_output: list[str],
                         earlier_errors: list[str], runner: str) -> None:
        batch_id = batch["id"]
        source = await self.store.get_file(batch["input_file_id"], True)
        if source is None:
            await self._end(batch_id, runner, "failed", errors=[{
                "code": "file_not_found", "line": None, "param": "input_file_id",
                "message": "The input file was deleted before it was read."}])
            return
        total, models, problems = check_lines(source.text, batch["endpoint"])
        if problems:
            await self._end(batch_id, runner, "failed", errors=problems)
            return
        summary = BatchSummary(total)
        out, errors, answered = earlier_answers(earlier_output, earlier_errors, summary)
        verdict = await self._progress(batch_id, runner, summary, out, errors)
        if verdict == "lost":
            return
        if verdict == "cancel" or batch["status"] == "cancelling":  # cancelled while it was validated, or orphaned
            await self._finish(batch, runner, owner, "cancelled", summary, out, errors)
            return
        if time.time() >= batch["expires_at"]:
            await self._finish(batch, runner, owner, "expired", summary, out, errors)
            return
        if batch["status"] == "validating":
            await self.store.update_batch(batch_id, {"status": "in_progress", "in_progress_at": int(time.time()),
                                                     # the batch's `model`: the one its lines name
                                                     "model": models.pop() if len(models) == 1 else None}, runner)
        log.info("batch %s: %d requests to %s (%d answered before), %d at a time with this replica's other batches",
                 batch_id, total - len(answered), batch["endpoint"], len(answered), self.concurrency)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        work = asyncio.ensure_future(run_batch(as_batch_line(self.target, owner), batch_lines(source.text, answered),
                                               out, summary, self._slots, progress=None, errors=errors,
                                               retry_unavailable_s=float("inf")))
        end = "completed"
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.poll_s)
                if work.done():
                    break
                verdict = await self._progress(batch_id, runner, summary, out, errors)
                if verdict == "lost":
                    end = None
                elif verdict == "cancel":
                    end = "cancelled"
                elif time.time() >= batch["expires_at"]:
                    end = "expired"
                else:
                    continue
                work.cancel()
                await asyncio.wait({work})
            if not work.cancelled():
                work.result()
        finally:
            if not work.done():  # this run itself was cancelled: the replica stops
                work.cancel()
                await asyncio.wait({work})
                await asyncio.shield(self._release(batch_id, runner, out, errors))
            elif end is None:
                log.warning("batch %s: another ingress replica took it over; stopping its run here", batch_id)
            else:
                why = None
                if not work.cancelled() and work.exception() is not None:
                    end, why = "failed", f"The batch's run failed on the server ({type(work.exception()).__name__})"
                await asyncio.shield(self._finish(batch, runner, owner, end, summary, out, errors, why))

    async def _progress(self, batch_id: str, runner: str, summary: BatchSummary, out: AnswerLines,
                        errors: AnswerLines) -> str:
        """The run's periodic write: its counts and new answers to the store; "run", "cancel" or "lost"
        (batch_store.batch_progress). A store that does not answer leaves the run going (logged): the next write
        sends those answers again, and the store lets another replica adopt the batch only after orphan_after_s
        without one."""
        output, failed = out.unsent(), errors.unsent()
        try:
            verdict = await self.store.batch_progress(batch_id, runner, progress_fields(summary), output,
                                                      failed)
        except Exception as err:
            log.warning("batch %s: the store did not take its progress (%s: %s); going on", batch_id,
                        type(err).__name__, err)
            return "run"
        out.sent += len(output)
        errors.sent += len(failed)
        return verdict

    async def _release(self, batch_id: str, runner: str, out: AnswerLines, errors: AnswerLines) -> None:
        self._released.add(runner)
        try:
            await self.store.release_batch(batch_id, runner, out.unsent(), errors.unsent())
            log.warning("batch %s: given back with %d answers for another replica to finish", batch_id,
                        len(out.lines) + len(errors.lines))
        except Exception:
            log.exception("batch %s: giving it back failed; another replica adopts it once the store has not heard "
                          "from this one for a while", batch_id)

    async def _finish(self, batch: dict[str, Any], runner: str, owner: str | None, end: str, summary: BatchSummary,
                      out: AnswerLines, errors: AnswerLines, why: str | None = None) -> None:
        """Write the answers' files (`finalizing`), then the final state (`why`: a failed one's reason). Nothing if
        another replica has taken the batch over meanwhile."""
        batch_id = batch["id"]
        if await self.store.update_batch(batch_id, {"status": "cancelling" if end == "cancelled" else "finalizing",
                                                    "finalizing_at": int(time.time()),
                                                    **progress_fields(summary)}, runner) is None:
            return
        ids, failures = {}, []
        if why:
            failures.append({"code": "server_error", "line": None, "param": None, "message": f"{why}; the answers it "
                             "had are in its files. Create a batch of the rest again."})
        for field, lines, kind in (("output_file_id", out, "output"), ("error_file_id", errors, "error")):
            if lines.lines:
                text = lines.text()
                ids[field] = await self._write_file(batch, owner, kind, text)
                if ids[field] is None:
                    end = "failed"
                    failures.append({"code": "file_storage_full", "line": None, "param": None, "message": (
                        f"The batch's {kind} file ({len(text.encode())} bytes) did not fit in the server's room for "
                        "files (ingress.files_max_mib): its answers are lost. Delete files, then run the batch "
                        "again.")})
        if not await self._end(batch_id, runner, end, errors=failures, **progress_fields(summary), **ids):
            for file_id in filter(None, ids.values()):  # another replica took it over while they were written
                await self.store.delete_file(file_id)
            return
        log.info("batch %s: %s, %s", batch_id, end, summary.line())

    async def _write_file(self, batch: dict[str, Any], owner: str | None, kind: str, text: str) -> str | None:
        """The id of the new file holding `text`, or None if it does not fit in the store's room for files."""
        file_id, batch_id = new_file_id(), batch["id"]
        expires_s = (batch.get("output_expires_after") or {}).get("seconds")
        stored = StoredFile(file_object(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", len(text.encode()),
                                        expires_s), text, owner)
        if await self.store.put_file(file_id, stored):
            return file_id
        log.error("batch %s: its %s file (%d bytes) does not fit in the file store; not kept", batch_id, kind,
                  stored.size())
        return None

    async def _end(self, batch_id: str, runner: str, status: str, errors: list[dict[str, Any]] | None = None,
                   **changes: Any) -> bool:
        """The batch's final state; False if another runner has it."""
        now = int(time.time())
        if errors:
            changes["errors"] = {"object": "list", "data": errors}
        return await self.store.update_batch(batch_id, {"status": status, f"{status}_at": now, **changes},
                                             runner) is not None


def new_runner() -> str:
    return f"run-{uuid.uuid4().hex}"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"  # OpenAI's file ids: "file-" and letters


def counts(summary: BatchSummary) -> dict[str, int]:
    failed = sum(n for status, n in summary.by_status.items() if not 200 <= status < 300)
    return {"total": summary.total, "completed": summary.done - failed, "failed": failed}


def progress_fields(summary: BatchSummary) -> dict[str, Any]:
    """The batch object's fields a run keeps current: `request_counts` and the lines' token `usage`."""
    return {"request_counts": counts(summary), "usage": summary.usage()}


def file_object(file_id: str, filename: str, purpose: str, size: int, expires_s: int | None = None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": file_id, "object": "file", "bytes": size, "created_at": now, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None if expires_s is None else now + expires_s,
            "status_details": None}


def batch_object(batch_id: str, endpoint: str, input_file_id: str, completion_window_s: int,
                 metadata: dict[str, str] | None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": "24h", "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + completion_window_s, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
            "usage": None}
