"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and their handlers.

Every failure a client can cause is a 4xx with a message that says what to change; the official
`openai` client turns these into BadRequestError / NotFoundError / ... with the same fields.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.request import InvalidRequestError
from serve_app.openai_api.streaming import ClientGone

log = logging.getLogger(__name__)
T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=BaseModel)


class APIError(Exception):
    """An error returned to the client as-is."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def headers(self) -> dict[str, str] | None:
        return None


class BadRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str, served: str | list[str]):
        names = ", ".join(repr(name) for name in ([served] if isinstance(served, str) else served))
        super().__init__(f"The model {model!r} does not exist; this server serves {names}.",
                         param="model", code="model_not_found")


class NotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="not_found")


class ResponseNotFound(NotFound):
    def __init__(self, response_id: str):
        super().__init__(f"No response found with id {response_id!r} (responses with store=false are not kept, "
                         "and the oldest are dropped when the store is full).")


class InvalidApiKey(APIError):
    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, sent: bool):
        super().__init__(
            "Incorrect API key provided." if sent else
            "You didn't provide an API key: send it in an Authorization header (Authorization: Bearer KEY; "
            "the openai client's api_key).", code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PayloadTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than {limit} bytes; send a shorter conversation.",
                         code="request_too_large")


class EngineFailure(APIError):
    """The backend failed or dropped a request the client did not cancel."""

    status_code = 503
    error_type = "server_error"


class ServerOverloaded(APIError):
    """The backend's queues are full (`max_queued_requests`, code `server_overloaded`) or its engine cannot serve
    (`engine_unavailable`): refused before anything ran; retry shortly. The openai client retries 503s by
    itself, after the Retry-After seconds."""

    status_code = 503
    error_type = "server_error"
    retry_after_s = 1

    def __init__(self, message: str, code: str = "server_overloaded"):
        super().__init__(message, code=code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


async def ask_store(call: Awaitable[T]) -> T:
    """A response store call's answer; a store that fails or does not answer is a 503 (the request may be retried)."""
    try:
        return await call
    except Exception as err:
        log.exception("the response store failed")
        raise EngineFailure(f"The response store did not answer ({type(err).__name__}); retry.") from err


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Pydantic names the members of a union in error locations ("str", "list[...]", "function-after[...]",
# our "message-item" tags); they are not request fields, so they are left out of `param`.
_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


# FastAPI's first location of a request error names the part of the request (body, query string, path, headers)
_REQUEST_PARTS = {"body", "query", "path", "header"}


def _param_path(loc: tuple) -> list[str]:
    if loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    return [str(part) for part in loc if part != "body"
            and not (isinstance(part, str) and (not part.isidentifier() or part in _TYPE_LABELS))]


def _specificity(error: dict) -> tuple[int, bool]:
    """Deeper first; at one depth a wrong `type` first, as it explains the rest (a Responses `web_search` tool lacks
    the `name` a function tool needs: the complaint is its type)."""
    path = _param_path(error.get("loc", ()))
    return len(path), path[-1:] == ["type"]


def bad_request_from_validation(err: ValidationError | RequestValidationError) -> BadRequest:
    """The most specific complaint (deepest location) as `param` (e.g. `messages.0.content.0`); when a
    union failed every way, its alternatives are joined with "or"."""
    errors = err.errors()
    best = max(errors, key=_specificity)
    path = _param_path(best.get("loc", ()))
    param = ".".join(path) or None
    if best.get("type") == "extra_forbidden":
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if best.get("type") == "json_invalid":
        return BadRequest(f"The request body is not valid JSON: {best.get('msg')}")
    reasons = []
    for e in errors:
        reason = str(e.get("msg", "")).removeprefix("Value error, ")
        if _param_path(e.get("loc", ())) == path and reason not in reasons:
            reasons.append(reason)
    message = " or ".join(reasons)
    return BadRequest(f"{param}: {message}" if param else message, param=param)


# Containers inside containers a body may hold (a JSON schema takes two levels per nested object: `properties`, then
# the property). Before this check, deeper bodies were 500s: Harmony's renderer refused a tool schema of 64 nested
# objects (serde_json's recursion limit, 128 levels), Python's parser a body ~1,000 levels deep (RecursionError).
MAX_JSON_DEPTH = 64


def parse_json(raw: bytes) -> Any:
    """The body as JSON, strictly (RFC 8259): `NaN` and `Infinity`, which Python's parser takes, are a 400 too (an
    echoed field holding one could not be written back as JSON: found by fuzzing, a 500 on `text.format`), and so are
    a string holding half of a UTF-16 surrogate pair, containers nested deeper than MAX_JSON_DEPTH and integers of more
    digits than Python converts (4,300)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
        if "integer string conversion" in str(err):
            raise BadRequest("The request body holds an integer of more than 4,300 digits.") from None
        raise BadRequest(f"The request body is not valid JSON ({err}); send a JSON object.") from err
    _check_tree(body, text=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


# A `\uD800`-`\uDFFF` escape: half of a UTF-16 pair. Python's parser joins a whole pair into one character and keeps
# a lone half as a string no encoder takes (Harmony's renderer failed on one: a 500 before this check).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


_CONTAINERS = {dict, list}


def _check_tree(body: Any, text: bool) -> None:
    """MAX_JSON_DEPTH, and with `text` every string (keys too) encodable, else a 400 naming the place."""
    stack = [(body, ())] if isinstance(body, (dict, list, str)) else []
    while stack:  # a loop, not recursion: the parser's own limit is deeper than Python's for our walkers
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                param = ".".join(str(part) for part in path) or None
                raise BadRequest(f"{param or 'The request body'}: holds a lone UTF-16 surrogate "
                                 f"({value[err.start]!a}, one half of a \\uD800-\\uDFFF pair), which is not text; "
                                 "send valid Unicode.", param=param) from None
            continue
        if len(path) >= MAX_JSON_DEPTH:  # a container (the stack holds only those and strings)
            param = str(path[0])
            raise BadRequest(f"{param}: nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.", param=param)
        if isinstance(value, dict):
            children = value.items()
        else:
            kinds = set(map(type, value))  # in C: a prompt of token ids (~1.6 M in 8 MiB) is not walked in Python
            if not (kinds & _CONTAINERS or (text and str in kinds)):
                continue
            children = enumerate(value)
        for key, item in children:
            if text and isinstance(key, str):
                stack.append((key, path))
            if isinstance(item, (dict, list)) or (text and isinstance(item, str)):
                stack.append((item, (*path, key)))


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _json(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, err: InvalidRequestError) -> JSONResponse:
        return _json(400, error_body(str(err), "invalid_request_error", err.param))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, err: ValidationError) -> JSONResponse:
        bad = bad_request_from_validation(err)
        return _json(bad.status_code, bad.body())

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, err: RequestValidationError) -> JSONResponse:
        bad = bad_request_from_validation(err)
        return _json(bad.status_code, bad.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"Unknown path {request.url.path}; this server serves /v1/chat/completions, " \
                      "/v1/responses, /v1/completions, /v1/models and /health."
        elif err.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(err.detail)
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return _json(err.status_code, error_body(message, kind))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        return _json(500, error_body(f"Internal server error ({type(err).__name__}); the server logs have "
                                     "the details.", "server_error"))


async def parse_request(request: Request, model: type[RequestT], limit: int) -> RequestT:
    """The body as `model`, its JSON types checked as OpenAI checks them: strictly, so `"5"`, `true` or `5.0`
    for an integer (or `"true"` for a boolean) is a 400 naming the field, never silently converted."""
    return model.model_validate(parse_json(await read_body(request, limit)), strict=True)


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
