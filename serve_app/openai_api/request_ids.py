"""Every answer carries an `x-request-id`, as OpenAI's do (the openai client's `_request_id`, a Batch API output
line's `request_id`).

Generated answers already name theirs (the body's `id`, generation.respond); this fills in the rest (errors, lists,
retrievals, /health) with `req_` and 32 hex digits. A request that came with an `x-request-id` header is left
alone: under Serve the proxy gives every request one (or keeps the client's) and returns it itself, and a second
value would only be appended to it.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class RequestIdHeader:
    """ASGI middleware: an `x-request-id` on each HTTP answer to a request that sent none, unless the app set one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or any(name == HEADER for name, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == HEADER for name, _ in headers):
                    headers.append((HEADER, new_request_id().encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
