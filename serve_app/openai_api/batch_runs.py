"""Running /v1/batches batches: each in a task of the ingress replica that created it.

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
batch, it does not fail its lines. The request counts go to the store every `poll_s`, with a poll for cancels.

A batch ends `completed`; `cancelled` after a cancel (POST /v1/batches/{id}/cancel, here or on another ingress
replica; requests in flight are aborted); `expired` when its completion window passes first; `failed` when the
replica stops (scale-down, redeploy: `stop()`). Each keeps the answers it has in its output and error files (none
when empty), written `finalizing` before the final state. A replica that dies without stop() loses the run: the
store marks the batch failed once it has gone `orphan_after_s` without word (batch_store.py).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.openai_api.auth import BATCH_STATE
from serve_app.openai_api.batch_store import StoredFile, iter_jsonl
from serve_app.run_batch import MAX_REPORTED_PROBLEMS, BatchLine, BatchSummary, line_problem, parse_line, run_batch

log = logging.getLogger(__name__)

POLL_S = 1.0  # a run writes its counts and asks for cancels this often
DEFAULT_CONCURRENCY = 64


def check_lines(text: str, endpoint: str) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """(the lines, []) or ([], OpenAI's batch errors: one per bad line, the first MAX_REPORTED_PROBLEMS)."""
    lines, problems, seen = [], [], {}
    for number, raw in iter_jsonl(text):
        try:
            line = parse_line(number, raw)
            problem = line_problem(line, seen, endpoint)
        except ValueError as err:
            problem = str(err)
        if problem:
            problems.append({"code": "invalid_request", "message": problem, "param": None, "line": number})
        else:
            lines.append(line)
    if not lines and not problems:
        problems.append({"code": "empty_file", "message": "The input file has no requests.", "param": None,
                         "line": None})
    return (lines, []) if not problems else ([], problems[:MAX_REPORTED_PROBLEMS])


def as_batch_line(app: ASGIApp, owner: str | None) -> ASGIApp:
    """`app` as a batch of `owner`'s key calls it: the key's id in the request's state, marked as a batch's line
    (the API key gate lets it through; the engines get it at batch priority)."""

    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        state = {**scope.get("state", {}), BATCH_STATE: True}
        if owner is not None:
            state["api_key_id"] = owner
        await app({**scope, "state": state}, receive, send)

    return call


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
        self.stopping = False

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, batch: dict[str, Any], owner: str | None) -> None:
        work = asyncio.ensure_future(self._run(batch, owner))
        self._runs[batch["id"]] = work
        work.add_done_callback(lambda _: self._runs.pop(batch["id"], None))

    async def stop(self) -> None:
        """The replica is stopping: every run ends `failed`, with the answers it has in its files."""
        runs = set(self._runs.values())
        if not runs:
            return
        log.warning("stopping: %d batches still running; storing them as failed", len(runs))
        self.stopping = True
        for work in runs:
            work.cancel()
        await asyncio.wait(runs, timeout=10.0)

    async def _run(self, batch: dict[str, Any], owner: str | None) -> None:
        batch_id = batch["id"]
        try:
            await self._run_lines(batch, owner)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
        except Exception:
            log.exception("batch %s failed", batch_id)
            await self._end(batch_id, "failed", errors=[{"code": "server_error", "line": None, "param": None,
                                                         "message": "The batch's run failed on the server."}])

    async def _run_lines(self, batch: dict[str, Any], owner: str | None) -> None:
        batch_id = batch["id"]
        source = await self.store.get_file(batch["input_file_id"], True)
        if source is None:
            await self._end(batch_id, "failed", errors=[{"code": "file_not_found", "line": None,
                                                         "param": "input_file_id",
                                                         "message": "The input file was deleted before it was read."}])
            return
        lines, problems = check_lines(source.text, batch["endpoint"])
        if problems:
            await self._end(batch_id, "failed", errors=problems)
            return
        summary = BatchSummary(len(lines))
        if await self.store.batch_cancel_requested([batch_id]):  # cancelled while it was validated
            await self._finish(batch_id, owner, "cancelled", summary, "", "")
            return
        await self.store.update_batch(batch_id, {"status": "in_progress", "in_progress_at": int(time.time()),
                                                 "request_counts": counts(summary)})
        log.info("batch %s: %d requests to %s, %d at a time with this replica's other batches", batch_id, len(lines),
                 batch["endpoint"], self.concurrency)
        out, errors = io.StringIO(), io.StringIO()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        work = asyncio.ensure_future(run_batch(as_batch_line(self.target, owner), iter(lines), out, summary,
                                               self._slots, progress=None, errors=errors,
                                               retry_unavailable_s=float("inf")))
        end = "completed"
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.poll_s)
                if work.done():
                    break
                if await self._cancel_requested(batch_id, summary):
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
            why = None
            if not work.done():  # this run itself was cancelled (the replica stops)
                work.cancel()
                await asyncio.wait({work})
                end, why = "failed", "The server replica running this batch stopped"
            elif not work.cancelled() and work.exception() is not None:
                end, why = "failed", f"The batch's run failed on the server ({type(work.exception()).__name__})"
            await asyncio.shield(self._finish(batch_id, owner, end, summary, out.getvalue(), errors.getvalue(), why))

    async def _cancel_requested(self, batch_id: str, summary: BatchSummary) -> bool:
        """The run's poll: its counts to the store, and whether a cancel came. A store that does not answer leaves the
        run going (logged): the next poll tries again, and the store marks the batch failed only after
        orphan_after_s without one."""
        try:
            await self.store.update_batch(batch_id, {"request_counts": counts(summary)})
            return bool(await self.store.batch_cancel_requested([batch_id]))
        except Exception as err:
            log.warning("batch %s: the store did not take its progress (%s: %s); going on", batch_id,
                        type(err).__name__, err)
            return False

    async def _finish(self, batch_id: str, owner: str | None, end: str, summary: BatchSummary, out: str,
                      errors: str, why: str | None = None) -> None:
        """Write the answers' files (`finalizing`), then the final state (`why`: a failed one's reason)."""
        await self.store.update_batch(batch_id, {"status": "cancelling" if end == "cancelled" else "finalizing",
                                                 "finalizing_at": int(time.time()), "request_counts": counts(summary)})
        ids, failures = {}, []
        if why:
            failures.append({"code": "server_error", "line": None, "param": None, "message": f"{why}; the answers it "
                             "had are in its files. Create a batch of the rest again."})
        for field, text, kind in (("output_file_id", out, "output"), ("error_file_id", errors, "error")):
            if text:
                ids[field] = await self._write_file(batch_id, owner, kind, text)
                if ids[field] is None:
                    end = "failed"
                    failures.append({"code": "file_storage_full", "line": None, "param": None, "message": (
                        f"The batch's {kind} file ({len(text.encode())} bytes) did not fit in the server's room for "
                        "files (ingress.files_max_mib): its answers are lost. Delete files, then run the batch "
                        "again.")})
        await self._end(batch_id, end, errors=failures, request_counts=counts(summary), **ids)
        log.info("batch %s: %s, %s", batch_id, end, summary.line())

    async def _write_file(self, batch_id: str, owner: str | None, kind: str, text: str) -> str | None:
        """The id of the new file holding `text`, or None if it does not fit in the store's room for files."""
        file_id = new_file_id()
        stored = StoredFile(file_object(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", len(text.encode())),
                            text, owner)
        if await self.store.put_file(file_id, stored):
            return file_id
        log.error("batch %s: its %s file (%d bytes) does not fit in the file store; not kept", batch_id, kind,
                  stored.size())
        return None

    async def _end(self, batch_id: str, status: str, errors: list[dict[str, Any]] | None = None,
                   **changes: Any) -> None:
        now = int(time.time())
        if errors:
            changes["errors"] = {"object": "list", "data": errors}
        await self.store.update_batch(batch_id, {"status": status, f"{status}_at": now, **changes})


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"  # OpenAI's file ids: "file-" and letters


def counts(summary: BatchSummary) -> dict[str, int]:
    failed = sum(n for status, n in summary.by_status.items() if not 200 <= status < 300)
    return {"total": summary.total, "completed": summary.done - failed, "failed": failed}


def file_object(file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


def batch_object(batch_id: str, endpoint: str, input_file_id: str, completion_window_s: int,
                 metadata: dict[str, str] | None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": "24h", "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + completion_window_s, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
