"""Stored responses for /v1/responses: `store`, `previous_response_id`, GET and DELETE by id.

A stored response is the response object as the client got it, the input items of its own request, and
the id of the response it continued. A request naming `previous_response_id` sees the conversation of that
chain: for each response from the first, its input items and then its output items (OpenAI's semantics;
`instructions` are not carried over). Each link is stored once, so a long chain costs its own size, not its
square.

`MemoryResponseStore` keeps them in this process, least recently used first out when a count or byte limit
is reached; a chain whose older link was dropped can no longer be continued (400
previous_response_not_found). Under Ray Serve one replica holds it for every ingress replica
(serve_app/response_store.py). Memory only unless it has a file (below): then a restart forgets nothing.

Background responses (background.py) are stored at once with status `queued`, then `in_progress`, then their
final state; the store also carries the request to cancel one to whichever ingress replica runs it, and hands one
over to another replica when its own stops or dies (background_store.py, BackgroundLeases).

A background response created with `stream: true` also keeps its stream events (append_events), so any ingress
replica can stream it and a client can resume (GET ?stream=true&starting_after=N, events_after); they count toward
the byte limit and go with the response.

The store also keeps /v1/conversations conversations (conversations.py): an object (id, created_at, metadata) and its
items, which grow as responses made in the conversation end. They share the count and byte limits and the least
recently used order with the responses; a conversation dropped for room is gone (404).

And it keeps the chat completions made with `store: true` (stored_chat.py): the completion object, the request's
messages and a creation time (the list order); same limits, same order.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Iterator, Protocol

from serve_app.openai_api.background_store import ADOPT_AT_ONCE, UNFINISHED, BackgroundLeases
from serve_app.openai_api.batch_store import MemoryBatchStore

log = logging.getLogger(__name__)


class _Entry:
    """A stored entry's JSON: its two content fields (a response and its input items; a conversation and its
    items), what the store's byte limit counts and its file holds (the short fields beside it)."""

    def content(self) -> list:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.content(), ensure_ascii=False, separators=(",", ":"))

    def size(self) -> int:
        return len(self.to_json())


@dataclass(frozen=True)
class StoredResponse(_Entry):
    response: dict[str, Any]  # the response object as returned (its `output` items included)
    input_items: list[dict[str, Any]]  # the request's own input items, each with an `id`
    previous_id: str | None = None  # the response it continued
    owner: str | None = None  # the API key (auth.key_id) that made it; only that key reads, continues or deletes it
    # An unfinished background response's request, for another ingress replica to run it again should this one's
    # stop (background_store.py): {"request": the ResponsesRequest's JSON, "model", "priority", "caller", "runs"}
    rerun: dict[str, Any] | None = None

    def content(self) -> list:
        return [self.response, self.input_items] + ([self.rerun] if self.rerun is not None else [])


@dataclass(frozen=True)
class StoredConversation(_Entry):
    conversation: dict[str, Any]  # the conversation object as returned (id, object, created_at, metadata)
    items: list[dict[str, Any]]  # its items, oldest first, each with an `id`
    owner: str | None = None  # as StoredResponse.owner

    def content(self) -> list:
        return [self.conversation, self.items]


@dataclass(frozen=True)
class StoredChatCompletion(_Entry):
    completion: dict[str, Any]  # the chat.completion object as a non-streamed request gets it, with its `metadata`
    messages: list[dict[str, Any]]  # the request's messages, each with an `id`
    owner: str | None = None  # as StoredResponse.owner
    created_ns: int = 0  # when the ingress made it (time.time_ns()): the list order, ties by id

    def content(self) -> list:
        return [self.completion, self.messages, self.created_ns]


Stored = StoredResponse | StoredConversation | StoredChatCompletion


class StoreFileLike(Protocol):
    """store_file.StoreFile's interface (it imports this module, so it is not imported here)."""

    def write(self, key: str, stored: Stored, body: str) -> None:
        """body: stored.to_json(), which the store has made already."""

    def remove(self, key: str) -> None: ...

    def entries(self) -> Iterator[tuple[str, Stored, int]]:
        """(key, entry, its size) of each entry, least recently written first."""




def is_unfinished(stored: StoredResponse) -> bool:
    return stored.response.get("status") in UNFINISHED


class ResponseStore(Protocol):
    async def put(self, response_id: str, stored: StoredResponse, runner: str | None = None) -> bool: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def conversation(self, response_id: str) -> list[dict[str, Any]] | None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def request_cancel(self, response_id: str) -> bool: ...

    async def cancel_requested(self, response_ids: list[str], runner: str | None = None) -> list[str]: ...

    async def release_response(self, response_id: str, runner: str) -> bool: ...

    async def adopt_responses(self, runner: str, model: str, limit: int = ADOPT_AT_ONCE) -> list[tuple[str, StoredResponse]]: ...

    async def append_events(self, response_id: str, events: list[dict[str, Any]], runner: str | None = None,
                            output_ids: list[int] = (), output_from: int = 0,
                            prompt_ids: list[int] | None = None) -> bool: ...

    async def events_after(self, response_id: str, after: int) -> tuple[list[dict[str, Any]], bool] | None: ...

    async def put_conversation(self, conversation_id: str, stored: StoredConversation) -> bool: ...

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None: ...

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None: ...

    async def delete_conversation(self, conversation_id: str) -> bool: ...

    async def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> str: ...

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None: ...

    async def put_chat_completion(self, completion_id: str, stored: StoredChatCompletion) -> bool: ...

    async def get_chat_completion(self, completion_id: str) -> StoredChatCompletion | None: ...

    async def update_chat_completion(self, completion_id: str, metadata: dict[str, str]) -> StoredChatCompletion | None: ...

    async def delete_chat_completion(self, completion_id: str) -> bool: ...

    async def list_chat_completions(self, owner: str | None, model: str | None, metadata: dict[str, str], order: str,
                                    limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool] | None: ...

    # and /v1/files and /v1/batches: batch_store.MemoryBatchStore's put_file, get_file, delete_file, list_files,
    # put_batch, get_batch, update_batch, request_batch_cancel, list_batches, and the runners' claim_batch,
    # batch_progress, release_batch, adopt_batch


class MemoryResponseStore(MemoryBatchStore, BackgroundLeases):
    """ResponseStore in this process's memory: at most `max_responses` responses and `max_bytes` of them; and the
    files and batches of /v1/files and /v1/batches (MemoryBatchStore: `max_file_bytes` of files)."""

    def __init__(self, max_responses: int = 10_000, max_bytes: int = 512 << 20, orphan_after_s: float = 30.0,
                 clock=time.monotonic, file: "StoreFileLike | None" = None, max_file_bytes: int = 1 << 30):
        """file: where every entry is also written (store_file.StoreFile), read back here; None: memory only."""
        MemoryBatchStore.__init__(self, max_file_bytes, orphan_after_s, clock, file)
        BackgroundLeases.__init__(self, orphan_after_s, clock)
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"max_responses ({max_responses}) and max_bytes ({max_bytes}) must be positive")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        # responses, conversations and chat completions, oldest use first
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()
        self.bytes = 0
        self._events: dict[str, tuple[list[dict[str, Any]], int]] = {}  # response -> (its stream events, their bytes)
        self._stream_output: dict[str, list[int]] = {}  # response -> the output tokens of its stored events
        self._stream_prompt: dict[str, list[int]] = {}  # response -> its run's prompt (what that output followed)
        self._file = file
        if file is not None:
            self._load(file)

    def __len__(self) -> int:
        return len(self._items)

    def _load(self, file: "StoreFileLike") -> None:
        """The file's entries, least recently written first; unfinished background responses are watched again (an
        ingress replica still running one tells the store so with its next cancel poll, else it becomes an orphan)."""
        for key, stored, size in file.entries():
            if not isinstance(stored, (StoredResponse, StoredConversation, StoredChatCompletion)):
                continue  # files and batches: batch_store.MemoryBatchStore's
            self._items[key] = (stored, size)
            self.bytes += size
            if isinstance(stored, StoredResponse) and is_unfinished(stored):
                self._seen[key] = self._clock()
        self._make_room()  # the limits may be lower than when they were written
        if self._items:
            log.info("response store: %d entries (%d bytes) read from its file", len(self._items), self.bytes)

    def _write(self, key: str, stored: Stored | None, body: str = "") -> None:
        """The file's copy of `key`: `stored` (its JSON: `body`), or none. A file that fails is logged; memory stays
        the truth."""
        if self._file is None:
            return
        try:
            self._file.write(key, stored, body) if stored is not None else self._file.remove(key)
        except Exception:
            log.exception("response store: writing %s to its file failed", key)

    async def put(self, response_id: str, stored: StoredResponse, runner: str | None = None) -> bool:
        """Store it (False: larger than the whole store, not kept), dropping the least recently used. `runner`: a
        background run's write, refused (False) once another replica runs the response (background_store.py) or once
        the response has ended (cancelled or failed without this run, finished by another)."""
        if self._lost_by(response_id, runner):
            return False
        if runner is not None and (entry := self._response_entry(response_id)) is not None \
                and not is_unfinished(entry[0]):
            return False
        if not is_unfinished(stored) and response_id in self._cancel:  # the final state of a stopped run
            self._cancel.discard(response_id)
            if response_id not in self._items:  # deleted while it ran: stays deleted
                return False
        if not self._keep(response_id, stored):
            return False
        if is_unfinished(stored):
            self._heard(response_id, runner)
        else:
            self._forget_run(response_id)
        return True

    def _keep(self, key: str, stored: Stored) -> bool:
        """Put `stored` at `key` as the most recently used (its stream events stay), then make room; False if it is
        larger than the whole store (not kept; what `key` held stays)."""
        body = stored.to_json()
        size = len(body)
        if size > self.max_bytes:
            log.warning("%s: %d bytes is more than the store holds (%d); not stored", key, size, self.max_bytes)
            return False
        self._drop(key, keep_events=True, in_file=True)
        self._items[key] = (stored, size)
        self.bytes += size
        self._write(key, stored, body)
        self._make_room()
        return True

    def _entry(self, key: str, kind: type) -> tuple[Any, int] | None:
        """The entry at `key` if it holds a `kind` (a response id never names a conversation, nor the reverse)."""
        entry = self._items.get(key)
        return entry if entry is not None and isinstance(entry[0], kind) else None

    def _response_entry(self, response_id: str) -> tuple[StoredResponse, int] | None:
        return self._entry(response_id, StoredResponse)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entry(response_id, StoredResponse)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        stored = entry[0]
        if self._orphaned(response_id, stored):
            stored = await self._fail_orphan(response_id, stored)
        return stored

    def counts(self) -> dict[str, int]:
        """Entries stored by kind: responses, conversations and chat completions."""
        kinds = Counter(type(entry[0]) for entry in self._items.values())
        return {"responses": kinds[StoredResponse], "conversations": kinds[StoredConversation],
                "chat_completions": kinds[StoredChatCompletion]}

    async def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items a continuation of `response_id` follows (module docstring), or None when it or any
        response before it is gone. Every link counts as used."""
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            stored = await self.get(next_id)
            if stored is None:
                return None
            chain.append(stored)
            next_id = stored.previous_id
        return [item for stored in reversed(chain) for item in stored.input_items + stored.response["output"]]

    async def delete(self, response_id: str) -> bool:
        """Drop it; a background response still running is also stopped (request_cancel) and not stored again."""
        entry = self._entry(response_id, StoredResponse)
        if entry is None:
            return False
        if is_unfinished(entry[0]) and response_id not in self._released:  # (one given back: no run to stop)
            self._cancel.add(response_id)
        return self._drop(response_id)

    async def append_events(self, response_id: str, events: list[dict[str, Any]], runner: str | None = None,
                            output_ids: list[int] = (), output_from: int = 0,
                            prompt_ids: list[int] | None = None) -> bool:
        """Add stream events (each with its `sequence_number`, in order) to a stored response's event log; False if
        the response is not stored (deleted, or dropped for room) or, with `runner`, another replica runs it now.
        Events it already has (a sequence number not past its last one: a write retried after a timeout that had
        landed) are left out. `output_ids`: the run's output tokens from its `output_from`-th on, those that made
        these events and the ones before (kept, likewise without repeats, for a run that continues the stream:
        adopt_responses); `prompt_ids`: the prompt they follow (the first write's; kept for that run too)."""
        if self._entry(response_id, StoredResponse) is None or self._lost_by(response_id, runner):
            return False
        tokens = self._stream_output.setdefault(response_id, [])
        log_, size = self._events.get(response_id, ([], 0))
        added = 0
        if prompt_ids is not None and response_id not in self._stream_prompt:
            self._stream_prompt[response_id] = list(prompt_ids)
            added += 7 * len(prompt_ids)
        if output_from <= len(tokens) < output_from + len(output_ids):
            new_tokens = output_ids[len(tokens) - output_from:]
            tokens.extend(new_tokens)
            added += 7 * len(new_tokens)  # (about their JSON's bytes: the byte limit counts them too)
        if log_:
            events = [ev for ev in events if ev["sequence_number"] > log_[-1]["sequence_number"]]
        if events:
            log_.extend(events)
            added += len(json.dumps(events, ensure_ascii=False, separators=(",", ":")))
        self._events[response_id] = (log_, size + added)
        self.bytes += added
        self._make_room()
        return True

    async def events_after(self, response_id: str, after: int) -> tuple[list[dict[str, Any]], bool] | None:
        """(its stream events with sequence_number > after, whether the response has finished), or None if it is
        not stored or keeps no events (it was not created with background and stream). The events and the state
        come from one moment: a run stores its last events before its final state."""
        entry = self._entry(response_id, StoredResponse)
        if entry is None or response_id not in self._events:
            return None
        stored = entry[0]
        if self._orphaned(response_id, stored):
            stored = await self._fail_orphan(response_id, stored)
        if response_id not in self._events:  # dropped for room by the orphan's failed event
            return None
        log_ = self._events[response_id][0]  # in sequence order: a follower's poll slices, it does not scan
        return log_[bisect.bisect_right(log_, after, key=lambda ev: ev["sequence_number"]):], not is_unfinished(stored)

    async def put_conversation(self, conversation_id: str, stored: StoredConversation) -> bool:
        """Store a new conversation (False: larger than the whole store, not kept)."""
        return self._keep(conversation_id, stored)

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        return self._use(conversation_id, StoredConversation)

    def _use(self, key: str, kind: type) -> Any:
        """The `kind` entry at `key`, now the most recently used; None if there is none."""
        entry = self._entry(key, kind)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return entry[0]

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        """Replace its metadata; None if it is not stored."""
        return self._new_metadata(conversation_id, StoredConversation, "conversation", metadata)

    def _new_metadata(self, key: str, kind: type, field: str, metadata: dict[str, str]) -> Any:
        """The `kind` entry at `key` stored again with `metadata` in its object (its `field`); None if not stored."""
        entry = self._entry(key, kind)
        if entry is None:
            return None
        updated = replace(entry[0], **{field: {**getattr(entry[0], field), "metadata": metadata}})
        return updated if self._keep(key, updated) else None

    async def delete_conversation(self, conversation_id: str) -> bool:
        return self._entry(conversation_id, StoredConversation) is not None and self._drop(conversation_id)

    async def add_conversation_items(self, conversation_id: str, items: list[dict[str, Any]]) -> str:
        """Append items (each with its `id`) in one step, so turns that end at once do not lose each other's:
        "added", "not_found", or "too_large" (the conversation would outgrow the whole store; nothing added)."""
        entry = self._entry(conversation_id, StoredConversation)
        if entry is None:
            return "not_found"
        return "added" if self._keep(conversation_id, replace(entry[0], items=entry[0].items + items)) else "too_large"

    async def delete_conversation_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        """Remove one item; the conversation after it, or None if the conversation or the item is not stored."""
        entry = self._entry(conversation_id, StoredConversation)
        if entry is None or all(item["id"] != item_id for item in entry[0].items):
            return None
        shrunk = replace(entry[0], items=[item for item in entry[0].items if item["id"] != item_id])
        self._keep(conversation_id, shrunk)
        return shrunk

    async def put_chat_completion(self, completion_id: str, stored: StoredChatCompletion) -> bool:
        """Store a chat completion (False: larger than the whole store, not kept)."""
        return self._keep(completion_id, stored)

    async def get_chat_completion(self, completion_id: str) -> StoredChatCompletion | None:
        return self._use(completion_id, StoredChatCompletion)

    async def update_chat_completion(self, completion_id: str, metadata: dict[str, str]) -> StoredChatCompletion | None:
        """Replace its metadata; None if it is not stored."""
        return self._new_metadata(completion_id, StoredChatCompletion, "completion", metadata)

    async def delete_chat_completion(self, completion_id: str) -> bool:
        return self._entry(completion_id, StoredChatCompletion) is not None and self._drop(completion_id)

    async def list_chat_completions(self, owner: str | None, model: str | None, metadata: dict[str, str], order: str,
                                    limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        """(a page of `owner`'s stored chat completions, whether more follow): those of `model` (None: any) whose
        metadata holds every pair of `metadata`, oldest first ("asc") or newest first ("desc"), `limit` of them
        after the one with id `after`; None if `after` is not among them. Listing is not a use."""
        found = sorted((stored.created_ns, key) for key, (stored, _) in self._items.items()
                       if isinstance(stored, StoredChatCompletion) and stored.owner == owner
                       and (model is None or stored.completion.get("model") == model)
                       and all((stored.completion.get("metadata") or {}).get(k) == v for k, v in metadata.items()))
        keys = [key for _, key in (found if order == "asc" else found[::-1])]
        if after is not None:
            if after not in keys:
                return None
            keys = keys[keys.index(after) + 1:]
        return [self._items[key][0].completion for key in keys[:limit]], len(keys) > limit

    def _make_room(self) -> None:
        """Drop the least recently used entries (responses with their events, conversations, chat completions) until
        the count and byte limits hold."""
        while self._items and (len(self._items) > self.max_responses or self.bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str, keep_events: bool = False, in_file: bool = False) -> bool:
        """Forget the entry (and, unless keep_events, its stream events); in_file: its row stays (about to be
        rewritten)."""
        if not in_file:
            self._forget_run(response_id)
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry[1]
            if not in_file:
                self._write(response_id, None)
        if not keep_events and response_id in self._events:
            self.bytes -= self._events.pop(response_id)[1]
        if not keep_events:
            self._stream_output.pop(response_id, None)
            self._stream_prompt.pop(response_id, None)
        return entry is not None
