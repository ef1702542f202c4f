"""/v1/files and /v1/batches: OpenAI's Batch API on this server, for the `openai` client's `files` and `batches`.

    f = client.files.create(file=open("requests.jsonl", "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    ...  client.batches.retrieve(b.id).status == "completed"
    client.files.content(b.output_file_id).text  # one line per request, as OpenAI's output file

Routes, as OpenAI's: POST /v1/files (multipart `file` and `purpose`: "batch"); GET /v1/files (`purpose`, `limit`
1-10,000, `order` desc by default, `after`); GET /v1/files/{id}; GET /v1/files/{id}/content; DELETE /v1/files/{id};
POST /v1/batches (`input_file_id`, `endpoint`: /v1/chat/completions, /v1/completions or /v1/responses,
`completion_window`: "24h", `metadata`); GET /v1/batches (`limit` 1-100, `after`; newest first); GET
/v1/batches/{id}; POST /v1/batches/{id}/cancel. How a batch runs: batch_runs.py.

Decisions: files and batches live in the response store (batch_store.py; in its file too, with ingress.store_path):
a server that keeps no responses (ingress.store_max_responses=0) answers these routes with a 400. An upload is at
most `max_upload_bytes` (ingress.file_max_mib) and must be UTF-8; its lines are checked when a batch is created from
it, as OpenAI does. Files are kept until deleted, or until their `expires_after` (anchor `created_at`, 1 hour to 30
days, as OpenAI takes it; a batch's `output_expires_after` for its output and error files) passes; within the store's
room for files (ingress.files_max_mib; an upload past it is a 400 naming that). With API keys, each key sees only its
own files and batches, and a batch's requests run as its key's (their stored responses are that key's).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response

from serve_app.openai_api.auth import requester
from serve_app.openai_api.batch_runs import BatchRuns, batch_object, file_object, new_file_id
from serve_app.openai_api.batch_store import StoredBatch, StoredFile
from serve_app.openai_api.conversations import check_page, page_json
from serve_app.openai_api.errors import APIError, BadRequest, NotFound, ask_store, parse_request
from serve_app.openai_api.generation import IngressContext
from serve_app.openai_api.protocol import Metadata, Strict
from serve_app.openai_api.responses_input import new_id
from serve_app.run_batch import URLS

FILE_PURPOSES = ("batch",)  # what an upload may be for; batches write theirs as "batch_output"
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only one
MULTIPART_SLACK = 64 << 10  # the multipart framing around a file of the upload limit
MAX_FILES_LISTED = 10_000
EXPIRY_SECONDS = (3600, 30 * 24 * 3600)  # OpenAI's range for expires_after.seconds: 1 hour to 30 days


class ExpiresAfter(Strict):
    anchor: Literal["created_at"]
    seconds: int


class BatchCreate(Strict):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None  # of the output and error files


def expiry_seconds(after: ExpiresAfter | None, param: str) -> int | None:
    if after is None:
        return None
    low, high = EXPIRY_SECONDS
    if not low <= after.seconds <= high:
        raise BadRequest(f"{param}.seconds must be between {low} and {high} (1 hour to 30 days), not {after.seconds}",
                         param=f"{param}.seconds")
    return after.seconds


def upload_expiry(form) -> int | None:
    """The seconds of an upload's `expires_after` (the openai client's form fields expires_after[anchor] and
    expires_after[seconds]), or None."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BadRequest(f"expires_after.anchor must be 'created_at', not {anchor!r}", param="expires_after.anchor")
    if not isinstance(seconds, str) or not seconds.strip().isdigit():
        raise BadRequest(f"expires_after.seconds must be a whole number of seconds, not {seconds!r}",
                         param="expires_after.seconds")
    return expiry_seconds(ExpiresAfter(anchor=anchor, seconds=int(seconds)), "expires_after")


class FileTooLarge(APIError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, limit: int):
        super().__init__(f"The file is larger than this server takes ({limit} bytes, ingress.file_max_mib); split "
                         "it into several batches.", param="file", code="file_too_large")


class FileNotFound(NotFound):
    def __init__(self, file_id: str, param: str = "file_id"):
        super().__init__(f"No such File object: {file_id}", param=param)


class BatchNotFound(NotFound):
    def __init__(self, batch_id: str):
        super().__init__(f"No such Batch object: {batch_id}", param="batch_id")


def store_of(ctx: IngressContext):
    if ctx.store is None:
        raise BadRequest("files and batches need the response store, which this server does not keep "
                         "(ingress.store_max_responses=0)")
    return ctx.store


async def owned_file(ctx: IngressContext, http: Request, file_id: str, with_text: bool = False,
                     param: str = "file_id") -> StoredFile:
    stored = await ask_store(store_of(ctx).get_file(file_id, with_text))
    if stored is None or stored.owner != requester(http):
        raise FileNotFound(file_id, param)
    return stored


async def owned_batch(ctx: IngressContext, http: Request, batch_id: str) -> StoredBatch:
    stored = await ask_store(store_of(ctx).get_batch(batch_id))
    if stored is None or stored.owner != requester(http):
        raise BatchNotFound(batch_id)
    return stored


async def upload_file(http: Request, ctx: IngressContext, max_upload_bytes: int) -> dict[str, Any]:
    store = store_of(ctx)
    if not http.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("upload the file as multipart/form-data with the fields `file` and `purpose`")
    limit = max_upload_bytes + MULTIPART_SLACK
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise FileTooLarge(max_upload_bytes)

    async def body():  # the body as it comes (the parser spools the file part), refused once past the limit
        size = 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(max_upload_bytes)
            yield chunk

    try:
        form = await MultiPartParser(http.headers, body(), max_files=1, max_fields=8).parse()
    except MultiPartException as err:
        raise BadRequest(f"the multipart body cannot be read: {err.message}") from None
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose not in FILE_PURPOSES:
        raise BadRequest(f"purpose must be one of {', '.join(FILE_PURPOSES)} (the files this server uses), not "
                         f"{purpose!r}", param="purpose")
    if not isinstance(upload, UploadFile):
        raise BadRequest("the multipart body has no `file` part", param="file")
    expires_s = upload_expiry(form)
    data = await upload.read()
    await form.close()
    if len(data) > max_upload_bytes:
        raise FileTooLarge(max_upload_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the file must be UTF-8 JSONL ({err})", param="file") from None
    file_id = new_file_id()
    stored = StoredFile(file_object(file_id, upload.filename or "upload.jsonl", purpose, len(data), expires_s), text,
                        requester(http))
    if not await ask_store(store.put_file(file_id, stored)):
        raise BadRequest(f"the server's room for files (ingress.files_max_mib) has no {len(data)} bytes left; "
                         "delete files you no longer need", param="file", code="file_storage_full")
    return stored.file


async def list_files(http: Request, ctx: IngressContext, purpose: str | None, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc', not {order!r}", param="order")
    if not 1 <= limit <= MAX_FILES_LISTED:
        raise BadRequest(f"limit must be between 1 and {MAX_FILES_LISTED}, not {limit}", param="limit")
    got = await ask_store(store_of(ctx).list_files(requester(http), purpose, order, limit, after))
    if got is None:
        raise BadRequest(f"after: no file {after!r} in this list", param="after")
    return page_json(*got)


async def file_content(http: Request, ctx: IngressContext, file_id: str) -> Response:
    stored = await owned_file(ctx, http, file_id, with_text=True)
    return Response(stored.text.encode(), media_type="application/octet-stream")


async def delete_file(http: Request, ctx: IngressContext, file_id: str) -> dict[str, Any]:
    await owned_file(ctx, http, file_id)
    await ask_store(store_of(ctx).delete_file(file_id))
    return {"id": file_id, "object": "file", "deleted": True}


async def create_batch(req: BatchCreate, http: Request, ctx: IngressContext, runs: BatchRuns) -> dict[str, Any]:
    store = store_of(ctx)
    if req.endpoint not in URLS:
        raise BadRequest(f"endpoint must be one of {', '.join(URLS)}, not {req.endpoint!r}", param="endpoint")
    if req.completion_window not in COMPLETION_WINDOWS:
        raise BadRequest(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, not "
                         f"{req.completion_window!r}", param="completion_window")
    source = await owned_file(ctx, http, req.input_file_id, param="input_file_id")
    if source.file["purpose"] != "batch":
        raise BadRequest(f"file {req.input_file_id} has purpose {source.file['purpose']!r}; a batch's input file is "
                         "uploaded with purpose 'batch'", param="input_file_id")
    output_expires_s = expiry_seconds(req.output_expires_after, "output_expires_after")
    batch = batch_object(new_id("batch"), req.endpoint, req.input_file_id,
                         COMPLETION_WINDOWS[req.completion_window], req.metadata)
    if output_expires_s is not None:  # as asked (OpenAI's batch object does not show it; the openai client keeps it)
        batch["output_expires_after"] = req.output_expires_after.model_dump()
    owner = requester(http)
    await ask_store(store.put_batch(batch["id"], StoredBatch(batch, owner)))
    runs.start(batch, owner)
    return batch


async def cancel_batch(http: Request, ctx: IngressContext, batch_id: str) -> dict[str, Any]:
    await owned_batch(ctx, http, batch_id)
    return await ask_store(store_of(ctx).request_batch_cancel(batch_id))


async def list_batches(http: Request, ctx: IngressContext, limit: int, after: str | None) -> dict[str, Any]:
    check_page("desc", limit)
    got = await ask_store(store_of(ctx).list_batches(requester(http), limit, after))
    if got is None:
        raise BadRequest(f"after: no batch {after!r} in this list", param="after")
    return page_json(*got)


def install_batch_routes(app: FastAPI, ctx: IngressContext, runs: BatchRuns, max_upload_bytes: int) -> None:
    """The /v1/files and /v1/batches routes on `app`; files and batches are scoped to API keys as stored responses
    are (auth.requester)."""
    limit = ctx.config.max_body_bytes

    @app.post("/v1/files")
    async def files_create(request: Request) -> dict[str, Any]:
        return await upload_file(request, ctx, max_upload_bytes)

    @app.get("/v1/files")
    async def files_list(request: Request, purpose: str | None = None, limit: int = MAX_FILES_LISTED,
                         order: str = "desc", after: str | None = None) -> dict[str, Any]:
        return await list_files(request, ctx, purpose, limit, order, after)

    @app.get("/v1/files/{file_id}")
    async def files_retrieve(request: Request, file_id: str) -> dict[str, Any]:
        return (await owned_file(ctx, request, file_id)).file

    @app.get("/v1/files/{file_id}/content")
    async def files_content(request: Request, file_id: str) -> Response:
        return await file_content(request, ctx, file_id)

    @app.delete("/v1/files/{file_id}")
    async def files_delete(request: Request, file_id: str) -> dict[str, Any]:
        return await delete_file(request, ctx, file_id)

    @app.post("/v1/batches")
    async def batches_create(request: Request) -> dict[str, Any]:
        return await create_batch(await parse_request(request, BatchCreate, limit), request, ctx, runs)

    @app.get("/v1/batches")
    async def batches_list(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        return await list_batches(request, ctx, limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def batches_retrieve(request: Request, batch_id: str) -> dict[str, Any]:
        return (await owned_batch(ctx, request, batch_id)).batch

    @app.post("/v1/batches/{batch_id}/cancel")
    async def batches_cancel(request: Request, batch_id: str) -> dict[str, Any]:
        return await cancel_batch(request, ctx, batch_id)
