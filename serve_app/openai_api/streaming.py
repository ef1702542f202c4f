"""Server-sent events and client-disconnect handling.

A client that goes away must free its slot in the engine. Both paths watch the ASGI `http.disconnect`
message while they work and cancel the work when it arrives; the work's `finally` (Generation.close)
then aborts the backend request. The stream path also closes the body iterator explicitly, so the
abort runs even when the disconnect shows up as a failed send rather than a message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: str | None = None) -> bytes:
    """One SSE frame; `data` is JSON-encoded unless it is already a string (`[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    """An SSE stream that ends its work when the client leaves, and, given `keepalive_s`, sends the comment
    `: keep-alive` whenever it has sent nothing for that long (clients skip comments: the SSE spec, and the
    openai client does), so proxies and load balancers with idle timeouts keep a waiting request open."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None, keepalive_s: float | None = None,
                 **kwargs: Any):
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})}, **kwargs)
        self.keepalive_s = keepalive_s  # (checked positive where it is configured: create_app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = _KeepAliveSend(send) if self.keepalive_s is not None else None
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(out.send if out is not None else send)
                    except OSError:  # the client is gone; the iterator is closed below
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                if out is not None:
                    group.start_soon(out.keep_alive, self.keepalive_s)
                if await _until_disconnect(receive):
                    group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


KEEPALIVE = b": keep-alive\n\n"


class _KeepAliveSend:
    """The response's `send`, one message at a time, noting when it last sent; `keep_alive` adds a comment
    after each idle period, from the response start until the last body message."""

    def __init__(self, send: Send):
        self._send = send
        self._lock = asyncio.Lock()  # acquired without a trip through the event loop when free (anyio's yields)
        self._last = 0.0
        self._open = False  # the response started and its last body message is not sent yet

    async def send(self, message: dict) -> None:
        async with self._lock:
            await self._send(message)
            self._last = anyio.current_time()
            if message["type"] == "http.response.start":
                self._open = True
            elif not message.get("more_body", False):
                self._open = False

    async def keep_alive(self, every_s: float) -> None:
        while True:
            await anyio.sleep(max(self._last + every_s - anyio.current_time(), 0.0) if self._open else 0.05)
            async with self._lock:  # checked under the lock: nothing may follow the last body message
                if self._open and anyio.current_time() - self._last >= every_s:
                    await self._send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                    self._last = anyio.current_time()

async def _until_disconnect(receive: Receive) -> bool:
    """True once the client disconnects; False if the server cannot tell us (then nothing is cancelled)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a proxying server's receive failed: keep serving, the work ends on its own
        log.warning("cannot watch for client disconnects on this request", exc_info=True)
        return False
    return True


class ClientGone(Exception):
    """The client disconnected before the answer was ready; nobody reads the reply."""


async def run_unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()`, cancelled (and ClientGone raised) if the client disconnects first."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            if await _until_disconnect(request.receive):
                group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work())
        except Exception as err:  # re-raised below, outside the group, so it is not wrapped in a group
            failure.append(err)
        finally:
            group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise ClientGone()
    return result[0]


async def interleave(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of several streams as they come, each stream's in its order; the first error wins.
    One stream is passed through as is."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(it: AsyncIterator[bytes]) -> None:
        try:
            async for item in it:
                await queue.put(item)
            await queue.put(done)
        except BaseException as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(it)) for it in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        # the readers must have stopped before anyone closes the streams they read (closing a running async
        # generator raises), so cancel them and wait, shielded from the cancellation that may have brought us here
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
