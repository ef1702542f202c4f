"""The response store under Ray Serve: one replica holds the stored /v1/responses (and /v1/conversations, and the
chat completions made with `store: true`) of every ingress replica.

`ResponseStoreServer` is the deployment (a MemoryResponseStore in its process, so one replica: a second
would hold other responses); `ServeResponseStore` is the ResponseStore the ingress uses, over its handle.
A restart of that replica forgets every stored response and conversation (continuations of them then get 400
previous_response_not_found, the conversations 404), unless `ingress.store_path` gives it a file to keep them in
(store_file.py; the replica then runs on the head node, where that path is).
"""

from __future__ import annotations

import asyncio
from typing import Any

from serve_app.openai_api.background_store import ADOPT_AT_ONCE
from serve_app.openai_api.batch_store import StoredBatch, StoredFile
from serve_app.openai_api.stored_responses import (MemoryResponseStore, StoredChatCompletion, StoredConversation,
                                                   StoredResponse)

REPORT_INTERVAL_S = 2.0


class ResponseStoreServer(MemoryResponseStore):
    """The deployment: the store itself (its methods are the handle's), reporting `gptoss_response_store_responses`,
    `_conversations`, `_chat_completions`, `_bytes`, `_background_running` and the counter `_adopted` (Ray's
    Prometheus export prefixes `ray_`, and `_total` to counters) every few seconds,
    after marking the orphaned background responses failed (sweep_orphans). Periodically, not once per change: a gauge
    set once at start did not reach Ray's export in one CI run (the engines' gauges, reported periodically, did)."""

    async def __init__(self, max_responses: int, max_bytes: int, path: str | None = None,
                       max_file_bytes: int = 1 << 30, orphan_after_s: float = 30.0):
        """path: the SQLite file every entry is written through to and read back from at start (store_file.py);
        None: memory only, a restart forgets everything. max_file_bytes: the room of /v1/files' files.
        orphan_after_s: silence after which a background response's or a batch's ingress replica counts as dead."""
        from ray.util import metrics

        from serve_app.metrics import replica_tags
        from serve_app.openai_api.store_file import StoreFile

        MemoryResponseStore.__init__(self, max_responses, max_bytes, file=StoreFile(path) if path else None,
                                     max_file_bytes=max_file_bytes, orphan_after_s=orphan_after_s)
        tags = replica_tags("response_store")
        count = metrics.Gauge("gptoss_response_store_responses", "Stored /v1/responses responses",
                              tag_keys=tuple(tags))
        conversations = metrics.Gauge("gptoss_response_store_conversations", "Stored /v1/conversations conversations",
                                      tag_keys=tuple(tags))
        chats = metrics.Gauge("gptoss_response_store_chat_completions", "Stored chat completions (store: true)",
                              tag_keys=tuple(tags))
        size = metrics.Gauge("gptoss_response_store_bytes", "Bytes (JSON) of everything stored",
                             tag_keys=tuple(tags))
        running = metrics.Gauge("gptoss_response_store_background_running",
                                "Background responses stored as queued or in progress", tag_keys=tuple(tags))
        files = metrics.Gauge("gptoss_response_store_file_bytes", "Bytes of the /v1/files files",
                              tag_keys=tuple(tags))
        batches = metrics.Gauge("gptoss_response_store_batches_running", "/v1/batches batches not yet ended",
                                tag_keys=tuple(tags))
        adopted = metrics.Counter("gptoss_response_store_adopted",
                                  "Background responses and batches another ingress replica took over (kind)",
                                  tag_keys=(*tags, "kind"))
        reported = {"response": 0, "batch": 0}

        async def report_forever() -> None:
            while True:
                await self.sweep_orphans()  # a dead ingress replica's runs: failed now, not when someone reads them
                await self.sweep_expired_files()
                counts = self.counts()
                count.set(counts["responses"], tags=tags)
                conversations.set(counts["conversations"], tags=tags)
                chats.set(counts["chat_completions"], tags=tags)
                size.set(self.bytes, tags=tags)
                running.set(self.running(), tags=tags)
                files.set(self.file_bytes, tags=tags)
                batches.set(self.batch_counts()["batches_running"], tags=tags)
                for kind, total in (("response", self.responses_adopted), ("batch", self.batches_adopted)):
                    if total > reported[kind]:
                        adopted.inc(total - reported[kind], tags={**tags, "kind": kind})
                        reported[kind] = total
                await asyncio.sleep(REPORT_INTERVAL_S)

        self._reporter = asyncio.get_running_loop().create_task(report_forever())

    def stats(self) -> dict[str, int]:
        return {**self.counts(), "bytes": self.bytes, "max_responses": self.max_responses, "max_bytes": self.max_bytes,
                "background_running": self.running(), **self.batch_counts(), "file_bytes": self.file_bytes,
                "responses_adopted": self.responses_adopted, "batches_adopted": self.batches_adopted,
                "max_file_bytes": self.max_file_bytes}


class ServeResponseStore:
    """ResponseStore over a ResponseStoreServer DeploymentHandle; a call that takes longer than `timeout_s`
    (the replica is gone and not back yet) raises TimeoutError, which the API answers with a 503."""

    def __init__(self, handle, timeout_s: float = 10.0):
        self._handle = handle
        self.timeout_s = timeout_s

    async def _call(self, method: str, *args: Any) -> Any:
        return await asyncio.wait_for(getattr(self._handle, method).remote(*args), self.timeout_s)

    async def put(self, response_id: str, stored: StoredResponse, runner: str | None = None) -> bool:
        return await self._call("put", response_id, stored, runner)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._call("get", response_id)

    async def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        return await self._call("conversation", response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)

    async def request_cancel(self, response_id: str) -> bool:
        return await self._call("request_cancel", response_id)

    async def cancel_requested(self, response_ids: list[str], runner: str | None = None) -> list[str]:
        return await self._call("cancel_requested", response_ids, runner)

    async def release_response(self, response_id: str, runner: str) -> bool:
        return await self._call("release_response", response_id, runner)

    async def adopt_responses(self, runner: str, model: str, limit: int = ADOPT_AT_ONCE) -> list[tuple[str, StoredResponse]]:
        return await self._call("adopt_responses", runner, model, limit)

    async def append_events(self, response_id: str, events: list[dict[str, Any]], runner: str | None = None,
                            output_ids: list[int] = (), output_from: int = 0,
                            prompt_ids: list[int] | None = None) -> bool:
        return await self._call("append_events", response_id, events, runner, list(output_ids), output_from,
                                prompt_ids)

    async def events_after(self, response_id: str, after: int) -> tuple[list[dict[str, Any]], bool] | None:
        return await self._call("events_after", response_id, after)

    async def put_conversation(self, conversation_id: str, stored: StoredConversation) -> bool:
        return await self._call("put_conversation", conversation_id, stored)

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        return await self._call("get_conversation", conversation_id)

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        return await self._call("update_conversation", conversation_id, metadata)

    async def delete_conversation(self, conversation_id: str) -> bool:
        return await self._call("delete_conversation", conversation_id)

    async def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> str:
        return await self._call("add_conversation_items", conversation_id, items)

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        return await self._call("delete_conversation_item", conversation_id, item_id)

    async def put_chat_completion(self, completion_id: str, stored: StoredChatCompletion) -> bool:
        return await self._call("put_chat_completion", completion_id, stored)

    async def get_chat_completion(self, completion_id: str) -> StoredChatCompletion | None:
        return await self._call("get_chat_completion", completion_id)

    async def update_chat_completion(self, completion_id: str, metadata: dict[str, str]) -> StoredChatCompletion | None:
        return await self._call("update_chat_completion", completion_id, metadata)

    async def delete_chat_completion(self, completion_id: str) -> bool:
        return await self._call("delete_chat_completion", completion_id)

    async def list_chat_completions(self, owner: str | None, model: str | None, metadata: dict[str, str], order: str,
                                    limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        return await self._call("list_chat_completions", owner, model, metadata, order, limit, after)

    # /v1/files and /v1/batches (batch_store.MemoryBatchStore)

    async def put_file(self, file_id: str, stored: StoredFile) -> bool:
        return await self._call("put_file", file_id, stored)

    async def get_file(self, file_id: str, with_text: bool = False) -> StoredFile | None:
        return await self._call("get_file", file_id, with_text)

    async def delete_file(self, file_id: str) -> bool:
        return await self._call("delete_file", file_id)

    async def list_files(self, owner: str | None, purpose: str | None, order: str, limit: int,
                         after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        return await self._call("list_files", owner, purpose, order, limit, after)

    async def put_batch(self, batch_id: str, stored: StoredBatch) -> None:
        return await self._call("put_batch", batch_id, stored)

    async def get_batch(self, batch_id: str) -> StoredBatch | None:
        return await self._call("get_batch", batch_id)

    async def update_batch(self, batch_id: str, changes: dict[str, Any], runner: str) -> dict[str, Any] | None:
        return await self._call("update_batch", batch_id, changes, runner)

    async def claim_batch(self, batch_id: str, runner: str) -> bool:
        return await self._call("claim_batch", batch_id, runner)

    async def batch_progress(self, batch_id: str, runner: str, changes: dict[str, Any], output: list[str],
                             errors: list[str]) -> str:
        return await self._call("batch_progress", batch_id, runner, changes, output, errors)

    async def release_batch(self, batch_id: str, runner: str, output: list[str], errors: list[str]) -> None:
        return await self._call("release_batch", batch_id, runner, output, errors)

    async def adopt_batch(self, runner: str) -> tuple[dict[str, Any], str | None, list[str], list[str]] | None:
        return await self._call("adopt_batch", runner)

    async def request_batch_cancel(self, batch_id: str) -> dict[str, Any] | None:
        return await self._call("request_batch_cancel", batch_id)

    async def list_batches(self, owner: str | None, limit: int, after: str | None
                           ) -> tuple[list[dict[str, Any]], bool] | None:
        return await self._call("list_batches", owner, limit, after)
