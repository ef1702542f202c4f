"""The store's files and batches (/v1/files, /v1/batches: batches.py): uploaded batch input files, the output and
error files batches write, and the batch objects with their states.

Unlike responses, nothing here leaves for room: files take at most `max_file_bytes` together, and an upload that
does not fit is refused (the client deletes files to make room). A file with an `expires_at` (its upload's
`expires_after`, a batch's `output_expires_after`) is deleted once that time passes: gone from reads and lists at
once, its room freed by the next upload or the store replica's sweep (sweep_expired_files). Each file and batch
belongs to the API key that made it (None where the app takes no keys); other keys do not see it.

A batch is run by one ingress replica at a time (batch_runs.BatchRuns), its runner: the replica that created it
claims it (claim_batch), and every second or so its run writes its progress here (batch_progress: counts, the
answers that ended since, and the answer to "go on?": run, cancel, or lost). Those writes tell the store the runner is
alive. The answers are kept here too (memory only, not in the store's file) so that another replica can take the
batch over: a batch its runner gave back (release_batch: the replica stops, for a scale-down or a redeploy) or
left silent `orphan_after_s` (the replica died) is adopted by the next ingress replica that asks (adopt_batch, each
replica's health check), which gets the answers so far and runs the lines without one. A runner whose batch was
taken over hears `lost` at its next write and stops without writing anything more (its writes carry its runner
token: only the batch's current runner's count). With the store's file (store_file.py) files and batches are
written through to it and read back at start like responses; a batch read back unfinished is adopted once it has
gone `orphan_after_s` without its runner's word (the answers it had then are not in the file: they run again).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

log = logging.getLogger(__name__)

UNFINISHED_BATCH = ("validating", "in_progress", "finalizing", "cancelling")


class _JsonEntry:
    def content(self) -> list:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.content(), ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class StoredFile(_JsonEntry):
    file: dict[str, Any]  # the file object as returned (id, object, bytes, created_at, filename, purpose, ...)
    text: str  # its content (UTF-8 JSONL)
    owner: str | None = None  # the API key (auth.key_id) that uploaded it, or whose batch wrote it

    def content(self) -> list:
        return [self.file, self.text]

    def size(self) -> int:
        """Its content's bytes (as uploaded or written; counted from the text only when the object says none)."""
        return self.file["bytes"] if "bytes" in self.file else len(self.text.encode())


@dataclass(frozen=True)
class StoredBatch(_JsonEntry):
    batch: dict[str, Any]  # the batch object as returned
    owner: str | None = None

    def content(self) -> list:
        return [self.batch]


class MemoryBatchStore:
    """Files and batches in this process's memory (with the response store's file, when it has one: `_file`)."""

    def __init__(self, max_file_bytes: int = 1 << 30, orphan_after_s: float = 30.0, clock=time.monotonic,
                 file=None):
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be positive, not {max_file_bytes}")
        self.max_file_bytes = max_file_bytes
        self.file_bytes = 0
        self._files: dict[str, StoredFile] = {}
        self._batches: dict[str, StoredBatch] = {}
        self._batch_seen: dict[str, float] = {}  # unfinished batch -> when its runner last wrote (-inf: given back)
        self._batch_runner: dict[str, str] = {}  # unfinished batch -> its runner's token
        self._batch_answers: dict[str, tuple[list[str], list[str]]] = {}  # -> (output lines, error lines) so far
        self._batch_cancel: set[str] = set()
        self._batch_clock = clock
        self._batch_orphan_s = orphan_after_s
        self.batches_adopted = 0  # batches taken over from a stopped or silent runner (the store's metrics)
        self._batch_file = file
        if file is not None:
            for key, stored, _ in file.entries():
                self._take(key, stored)

    def _take(self, key: str, stored: Any) -> None:
        """An entry read back from the file (entries of other kinds are the response store's)."""
        if isinstance(stored, StoredFile):
            self._files[key] = stored
            self.file_bytes += stored.size()
        elif isinstance(stored, StoredBatch):
            self._batches[key] = stored
            if stored.batch["status"] in UNFINISHED_BATCH:
                self._batch_seen[key] = self._batch_clock()

    def _save(self, key: str, stored: StoredFile | StoredBatch | None) -> None:
        """The store file's copy of `key` (as the response store's: a file that fails is logged, memory stays the
        truth)."""
        if self._batch_file is None:
            return
        try:
            self._batch_file.write(key, stored, stored.to_json()) if stored is not None else \
                self._batch_file.remove(key)
        except Exception:
            log.exception("response store: writing %s to its file failed", key)

    # files

    async def put_file(self, file_id: str, stored: StoredFile) -> bool:
        """Keep a new file; False if it does not fit in what is left of max_file_bytes (nothing kept)."""
        if self.file_bytes + stored.size() > self.max_file_bytes:
            await self.sweep_expired_files()
        if self.file_bytes + stored.size() > self.max_file_bytes:
            return False
        self._files[file_id] = stored
        self.file_bytes += stored.size()
        self._save(file_id, stored)
        return True

    async def get_file(self, file_id: str, with_text: bool = False) -> StoredFile | None:
        """The file (its text left empty unless with_text: a retrieve need not carry megabytes)."""
        stored = self._files.get(file_id)
        if stored is not None and _expired(stored):
            await self.delete_file(file_id)
            return None
        return stored if stored is None or with_text else replace(stored, text="")

    async def delete_file(self, file_id: str) -> bool:
        stored = self._files.pop(file_id, None)
        if stored is None:
            return False
        self.file_bytes -= stored.size()
        self._save(file_id, None)
        return True

    async def list_files(self, owner: str | None, purpose: str | None, order: str, limit: int,
                         after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        """(a page of `owner`'s file objects, whether more follow): of `purpose` (None: any), newest first ("desc")
        or oldest first, `limit` after the one with id `after` (None if it is not among them)."""
        found = [s.file for s in self._files.values()
                 if s.owner == owner and purpose in (None, s.file["purpose"]) and not _expired(s)]
        return _page(found, order, limit, after)

    async def sweep_expired_files(self) -> int:
        """Delete every file past its expires_at; how many."""
        gone = [file_id for file_id, stored in self._files.items() if _expired(stored)]
        for file_id in gone:
            await self.delete_file(file_id)
        return len(gone)

    # batches

    async def put_batch(self, batch_id: str, stored: StoredBatch) -> None:
        self._batches[batch_id] = stored
        if stored.batch["status"] in UNFINISHED_BATCH:
            self._batch_seen.setdefault(batch_id, self._batch_clock())  # its runner's writes renew it
        else:
            for held in (self._batch_seen, self._batch_runner, self._batch_answers):
                held.pop(batch_id, None)
            self._batch_cancel.discard(batch_id)
        self._save(batch_id, stored)

    async def get_batch(self, batch_id: str) -> StoredBatch | None:
        return self._batches.get(batch_id)

    def _unfinished(self, batch_id: str) -> bool:
        stored = self._batches.get(batch_id)
        return stored is not None and stored.batch["status"] in UNFINISHED_BATCH

    def _runs_it(self, batch_id: str, runner: str) -> bool:
        """Whether `runner` may write the batch: it is unfinished and `runner` is its runner (or it has none: the
        store restarted under a run that goes on, which takes it back)."""
        return self._unfinished(batch_id) and self._batch_runner.get(batch_id, runner) == runner

    def _heard_from(self, batch_id: str, runner: str) -> None:
        self._batch_runner[batch_id] = runner
        self._batch_seen[batch_id] = self._batch_clock()

    async def update_batch(self, batch_id: str, changes: dict[str, Any], runner: str) -> dict[str, Any] | None:
        """Its runner's write: `changes` into the batch object (a state, counts, file ids); the batch after it, or
        None if it is not stored, already final, or run by another runner than `runner`."""
        if not self._runs_it(batch_id, runner):
            return None
        self._heard_from(batch_id, runner)
        await self.put_batch(batch_id, replace(self._batches[batch_id], batch={**self._batches[batch_id].batch,
                                                                                 **changes}))
        return self._batches[batch_id].batch

    async def claim_batch(self, batch_id: str, runner: str) -> bool:
        """The creating replica's claim of a new batch: True unless another runner has it (an adopter was first)."""
        if not self._unfinished(batch_id) or batch_id in self._batch_runner:
            return False
        self._heard_from(batch_id, runner)
        return True

    async def batch_progress(self, batch_id: str, runner: str, changes: dict[str, Any], output: list[str],
                             errors: list[str]) -> str:
        """A run's periodic write: `changes` (counts) into the batch, its answers that ended since the last write
        (output and error lines) kept for an adopter. "run" (go on), "cancel" (a cancel was asked), or "lost" (the
        batch is final or another runner has it: stop, write nothing more)."""
        if not self._runs_it(batch_id, runner):
            return "lost"
        kept = self._batch_answers.setdefault(batch_id, ([], []))
        kept[0].extend(output)
        kept[1].extend(errors)
        if changes:
            await self.update_batch(batch_id, changes, runner)
        else:  # (a give-back: nothing of the batch object changes, nothing to write to the store's file)
            self._heard_from(batch_id, runner)
        return "cancel" if batch_id in self._batch_cancel else "run"

    async def release_batch(self, batch_id: str, runner: str, output: list[str], errors: list[str]) -> None:
        """The runner gives the batch back (its replica stops), with its answers since its last write: the next
        replica that asks adopts it at once."""
        if await self.batch_progress(batch_id, runner, {}, output, errors) == "lost":
            return
        self._batch_runner.pop(batch_id, None)
        self._batch_seen[batch_id] = float("-inf")

    async def adopt_batch(self, runner: str) -> tuple[dict[str, Any], str | None, list[str], list[str]] | None:
        """Take over one batch given back or silent for orphan_after_s: (the batch, its owner, its output and error
        lines so far), now run by `runner`; None if there is none."""
        now = self._batch_clock()
        for batch_id, seen in sorted(self._batch_seen.items(), key=lambda item: item[1]):
            if now - seen <= self._batch_orphan_s:
                break
            stored = self._batches.get(batch_id)
            if stored is None or stored.batch["status"] not in UNFINISHED_BATCH:
                continue
            log.warning("batch %s: adopted by another ingress replica (its runner %s)", batch_id,
                        "gave it back" if seen == float("-inf") else f"was silent for {now - seen:.0f} s")
            self._heard_from(batch_id, runner)
            self.batches_adopted += 1
            output, errors = self._batch_answers.get(batch_id, ([], []))
            return stored.batch, stored.owner, list(output), list(errors)
        return None

    async def request_batch_cancel(self, batch_id: str) -> dict[str, Any] | None:
        """Mark an unfinished batch `cancelling` and ask its replica to stop it; the batch after that (None: not
        stored). A finished one is returned as it is."""
        stored = await self.get_batch(batch_id)
        if stored is None or stored.batch["status"] not in UNFINISHED_BATCH:
            return stored.batch if stored is not None else None
        self._batch_cancel.add(batch_id)
        if stored.batch["status"] != "cancelling":
            await self.put_batch(batch_id, replace(stored, batch={**stored.batch, "status": "cancelling",
                                                                  "cancelling_at": int(time.time())}))
        return self._batches[batch_id].batch

    async def list_batches(self, owner: str | None, limit: int, after: str | None
                           ) -> tuple[list[dict[str, Any]], bool] | None:
        """(a page of `owner`'s batches, newest first, whether more follow), as list_files."""
        found = [(await self.get_batch(key)).batch for key, s in list(self._batches.items()) if s.owner == owner]
        return _page(found, "desc", limit, after)

    def batch_counts(self) -> dict[str, int]:
        return {"files": len(self._files), "batches": len(self._batches), "batches_running": len(self._batch_seen)}


def _expired(stored: StoredFile) -> bool:
    expires_at = stored.file.get("expires_at")
    return expires_at is not None and expires_at <= time.time()


def _page(objects: list[dict[str, Any]], order: str, limit: int, after: str | None
          ) -> tuple[list[dict[str, Any]], bool] | None:
    """Objects (each with `id` and `created_at`, in insertion order) sorted by creation, a page of `limit` after
    `after`'s."""
    ordered = [o for _, o in sorted(enumerate(objects), key=lambda io: (io[1]["created_at"], io[0]),
                                    reverse=order == "desc")]  # ties: in the order they were made
    ids = [o["id"] for o in ordered]
    if after is not None:
        if after not in ids:
            return None
        ordered = ordered[ids.index(after) + 1:]
    return ordered[:limit], len(ordered) > limit


def iter_jsonl(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of each non-blank line, one at a time (no copy of the whole text). Lines end at
    "\n" (a "\r" before it goes too), as JSONL's do: not at the other breaks str.splitlines knows, which a JSON
    string may hold raw (U+2028, U+2029, U+0085)."""
    start, number = 0, 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        number += 1
        line = text[start:end].removesuffix("\r")
        if line.strip():
            yield number, line
        start = end + 1
