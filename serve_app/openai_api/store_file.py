"""The response store's file (`ingress.store_path`): every stored response and conversation, written through to SQLite
so that a restart of the store's replica (a redeploy, a crash, a node's reboot) finds them again.

The store's memory stays the truth; this file is its copy. Each change of an entry rewrites that entry's row (its
JSON and when it was written); a dropped entry's row is deleted. On start the store reads the rows back, least
recently written first, so the least-recently-used order it rebuilds is that of the writes (reads are not written:
a write per GET would cost more than the order is worth). Stream events of background responses are not written:
they are for the stream's lifetime, and after a restart a response's stream cannot be resumed (GET it instead).

SQLite in WAL mode with synchronous=NORMAL: a commit is a write to the log, not an fsync, so the store answers as fast
as before; a power loss may lose the last writes, never the file. One writer: the store's one replica.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from serve_app.openai_api.stored_responses import StoredConversation, StoredResponse

Stored = StoredResponse | StoredConversation
_KINDS = {"response": StoredResponse, "conversation": StoredConversation}


class StoreFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)  # autocommit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, kind TEXT NOT NULL, "
                         "body TEXT NOT NULL, written REAL NOT NULL)")
        self._tick = self._db.execute("SELECT COALESCE(MAX(written), 0) FROM entries").fetchone()[0]

    def write(self, key: str, stored: Stored) -> None:
        kind = "response" if isinstance(stored, StoredResponse) else "conversation"
        self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                         (key, kind, json.dumps(asdict(stored), ensure_ascii=False), self._now()))

    def remove(self, key: str) -> None:
        self._db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def entries(self) -> Iterator[tuple[str, Stored]]:
        """Every entry, least recently written first."""
        for key, kind, body in self._db.execute("SELECT key, kind, body FROM entries ORDER BY written, rowid"):
            yield key, _KINDS[kind](**json.loads(body))

    def close(self) -> None:
        self._db.close()

    def _now(self) -> float:
        """Wall time, never equal to or below the last write's (the order survives a clock that stands still)."""
        self._tick = max(time.time(), self._tick + 1e-6)
        return self._tick
