"""The response store's file (`ingress.store_path`): every stored response, conversation and chat completion (and
the files and batches of /v1/files and /v1/batches, batch_store.py), written
through to SQLite so that a restart of the store's replica (a redeploy, a crash, a node's reboot) finds them again.

The store's memory stays the truth; this file is its copy. Each change of an entry rewrites that entry's row (its
JSON, its row then the newest); a dropped entry's row is deleted. On start the store reads the rows back, least
recently written first, so the least-recently-used order it rebuilds is that of the writes (reads are not written:
a write per GET would cost more than the order is worth). Stream events of background responses are not written:
they are for the stream's lifetime, and after a restart a response's stream cannot be resumed (GET it instead).

SQLite in WAL mode with synchronous=NORMAL: a commit is a write to the log, not an fsync, so the store answers as fast
as before; a power loss may lose the last writes, never the file. One writer: the store's one replica.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterator

from serve_app.openai_api.batch_store import StoredBatch, StoredFile
from serve_app.openai_api.stored_responses import Stored, StoredChatCompletion, StoredConversation, StoredResponse


class StoreFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)  # autocommit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # A rewritten row is deleted and inserted again with a rowid above every other (SQLite gives a new row the
        # largest rowid + 1), so rowid order is write order.
        self._db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, kind TEXT NOT NULL, "
                         "body TEXT NOT NULL, previous_id TEXT, owner TEXT)")

    def write(self, key: str, stored: Stored | StoredFile | StoredBatch, body: str) -> None:
        """`stored` under `key`; body: the JSON of its content (stored.to_json())."""
        if isinstance(stored, StoredResponse):
            row = (key, "response", body, stored.previous_id, stored.owner)
        elif isinstance(stored, StoredChatCompletion):
            row = (key, "chat_completion", body, None, stored.owner)
        elif isinstance(stored, StoredFile):
            row = (key, "file", body, None, stored.owner)
        elif isinstance(stored, StoredBatch):
            row = (key, "batch", body, None, stored.owner)
        else:
            row = (key, "conversation", body, None, stored.owner)
        self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?)", row)

    def remove(self, key: str) -> None:
        self._db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def entries(self) -> Iterator[tuple[str, Stored, int]]:
        """(key, entry, the size of its JSON) of every entry, least recently written first."""
        rows = self._db.execute("SELECT key, kind, body, previous_id, owner FROM entries ORDER BY rowid")
        for key, kind, body, previous_id, owner in rows:
            content = json.loads(body)
            if kind == "response":
                stored = StoredResponse(content[0], content[1], previous_id, owner,
                                        content[2] if len(content) > 2 else None)
            elif kind == "chat_completion":
                stored = StoredChatCompletion(content[0], content[1], owner, content[2])
            elif kind == "file":
                stored = StoredFile(content[0], content[1], owner)
            elif kind == "batch":
                stored = StoredBatch(content[0], owner)
            else:
                stored = StoredConversation(content[0], content[1], owner)
            yield key, stored, len(body)
