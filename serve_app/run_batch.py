"""`gptoss run-batch INPUT OUTPUT [MODEL_DIR]`: an OpenAI Batch API input file, run through the engine in this process
(no Ray, no HTTP server), its results written as OpenAI's batch output file.

    gptoss run-batch requests.jsonl results.jsonl /models/gpt-oss-20b --device cuda --max-num-seqs 256

Input: JSONL, one request per line, as OpenAI's Batch API takes it:
`{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-oss", ...}}`, the url
one of /v1/chat/completions, /v1/completions and /v1/responses. The whole file is checked before anything runs (a
line that is not such an object, a custom_id used twice, another method or url, `stream: true`): any problem and
the command exits 2, naming the lines, with no output written.

Each body goes to the same app the server runs (serve_app/openai_api's create_app over an AsyncEngine, called
in-process over ASGI): the same validation, Harmony rendering and parsing, the same answers. `--concurrency`
requests are in flight at once (default twice --max-num-seqs, so the engine's batch stays full while answers are
parsed). Output: a line per request, written as each ends (so not in input order; custom_id says which):
`{"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {...}},
"error": null}`; a request the API refuses has its 4xx status and OpenAI-shaped error body, as in OpenAI's output
file. Progress goes to stderr every few seconds, then a summary (requests by status, input and output tokens,
seconds, output tokens per second). Exit status 0, or 1 when a request failed on the server's side (5xx).
`--resume` keeps what OUTPUT already holds (a run that was stopped, or whose requests failed on the server's side)
and runs only the requests without a kept answer, appending: answers with a 2xx or 4xx status are kept, server
failures (5xx, no answer) and a last line cut short run again.

Decisions: no store (`store`, `previous_response_id`, conversations and background are the server's; a Responses
request is answered statelessly, a continuation is a 400 in its line); the served model name is
`--served-model-name` (default "gpt-oss", the Serve app's), and a body naming another model gets the API's 404.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_REPORTED_PROBLEMS = 20
PROGRESS_EVERY_S = 5.0
RETRY_MAX_WAIT_S = 10.0  # the longest wait between two tries of a line answered 503 (run_batch)


class BatchFileError(ValueError):
    """The input file cannot be run as given; the message lists the lines and why."""


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line of the input file
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_line(number: int, text: str) -> BatchLine:
    """One input line as a BatchLine; ValueError saying what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    custom_id, method, url, body = (data.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method must be POST, not {method!r}")
    if url not in URLS:
        raise ValueError(f"url must be one of {', '.join(URLS)}, not {url!r}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request's body)")
    if body.get("stream"):
        raise ValueError("stream is not supported in a batch; leave it out")
    return BatchLine(number, custom_id, url, body)


def line_problem(line: BatchLine, seen: dict[str, int], endpoint: str | None = None) -> str | None:
    """Why `line` cannot run in its file (another url than the batch's `endpoint`, when given; a custom_id of an
    earlier line: `seen`, custom_id -> line number, which this line joins), or None."""
    if endpoint is not None and line.url != endpoint:
        return f"url must be the batch's endpoint {endpoint}, not {line.url}"
    if line.custom_id in seen:
        return f"custom_id {line.custom_id!r} is already used on line {seen[line.custom_id]}"
    seen[line.custom_id] = line.number
    return None


def _numbered(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield number, text


def check_file(path: Path) -> int:
    """The number of requests in the file, after checking every line (BatchFileError listing the problems)."""
    problems, seen, count = [], {}, 0
    try:
        for number, text in _numbered(path):
            count += 1
            try:
                problem = line_problem(parse_line(number, text), seen)
            except ValueError as err:
                problem = str(err)
            if problem:
                problems.append(f"line {number}: {problem}")
    except (OSError, UnicodeDecodeError) as err:
        raise BatchFileError(f"{path}: cannot read it ({err})") from None
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise BatchFileError(f"{path}: {len(problems)} line(s) cannot be run:\n" + "\n".join(shown) + more)
    if count == 0:
        raise BatchFileError(f"{path}: no requests")
    return count


def read_file(path: Path) -> Iterator[BatchLine]:
    """The requests of a file check_file passed, one at a time."""
    for number, text in _numbered(path):
        yield parse_line(number, text)


@dataclass
class BatchSummary:
    total: int
    by_status: Counter = field(default_factory=Counter)  # status code (0: no response) -> requests
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of the input tokens, those the prefix cache served
    reasoning_tokens: int = 0  # of the output tokens, the analysis channel's
    started: float = field(default_factory=time.perf_counter)

    def add(self, status: int, body: Any) -> None:
        self.by_status[status] += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):  # chat and text completions' names, or the Responses API's
            self.input_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
            self.output_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
            details = usage.get("prompt_tokens_details", usage.get("input_tokens_details")) or {}
            self.cached_tokens += details.get("cached_tokens", 0) or 0
            details = usage.get("completion_tokens_details", usage.get("output_tokens_details")) or {}
            self.reasoning_tokens += details.get("reasoning_tokens", 0) or 0

    def usage(self) -> dict[str, Any]:
        """The lines' tokens so far as OpenAI's batch `usage`."""
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}

    @property
    def done(self) -> int:
        return sum(self.by_status.values())

    @property
    def server_failures(self) -> int:
        return sum(n for status, n in self.by_status.items() if status == 0 or status >= 500)

    def line(self) -> str:
        seconds = time.perf_counter() - self.started
        statuses = ", ".join(f"{n} x {status or 'no response'}" for status, n in sorted(self.by_status.items()))
        return (f"{self.done}/{self.total} requests ({statuses or 'none yet'}), {self.input_tokens} input and "
                f"{self.output_tokens} output tokens in {seconds:.1f} s: {self.output_tokens / max(seconds, 1e-9):.1f} "
                "output tok/s")


async def run_batch(app, lines: Iterator[BatchLine], out: TextIO, summary: BatchSummary,
                    concurrency: int | asyncio.Semaphore, progress: TextIO | None = sys.stderr,
                    errors: TextIO | None = None, retry_unavailable_s: float = 0.0) -> BatchSummary:
    """Send every line's body to `app` (an ASGI app: create_app's), `concurrency` at a time (or as many as a shared
    semaphore's slots allow: the runs that share it share its slots), writing each result to
    `out` as it ends (to `errors` instead, when given, if it is not a 2xx). A 503 (full queues, an engine being
    replaced) is sent again, after its Retry-After and then twice as long each time (at most RETRY_MAX_WAIT_S), while
    `retry_unavailable_s` has not passed since the line's first try (0: never). Cancelled, it cancels the requests in
    flight (their lines are not written)."""
    import httpx

    if isinstance(concurrency, asyncio.Semaphore):
        slots = concurrency
    elif concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    else:
        slots = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # an app's crash: its 500, not ours

    async def post(client: httpx.AsyncClient, line: BatchLine):
        first, wait_s = time.monotonic(), None
        while True:
            answer = await client.post(line.url, json=line.body)
            if answer.status_code != 503 or time.monotonic() - first >= retry_unavailable_s:
                return answer
            header = answer.headers.get("retry-after", "")
            wait_s = min(RETRY_MAX_WAIT_S, wait_s * 2 if wait_s else float(header) if header.isdigit() else 1.0)
            await asyncio.sleep(wait_s)

    async def one(client: httpx.AsyncClient, line: BatchLine) -> None:
        try:
            answer = await post(client, line)
            try:
                body = answer.json()
            except ValueError:
                body = {"error": {"message": answer.text[:1000], "type": "server_error", "param": None, "code": None}}
            record = {"response": {"status_code": answer.status_code, "request_id": answer.headers.get("x-request-id"),
                                   "body": body}, "error": None}
            summary.add(answer.status_code, body)
        except Exception as err:  # the transport failed: no answer at all
            record = {"response": None,
                      "error": {"code": "batch_request_failed", "message": f"{type(err).__name__}: {err}"}}
            summary.add(0, None)
        ok = record["response"] is not None and 200 <= record["response"]["status_code"] < 300
        into = out if ok or errors is None else errors
        into.write(json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, **record},
                              ensure_ascii=False) + "\n")
        into.flush()

    async def report() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            print(f"run-batch: {summary.line()}", file=progress, flush=True)

    reporter = asyncio.create_task(report()) if progress is not None else None
    running: set[asyncio.Task] = set()
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            for line in lines:
                await slots.acquire()
                task = asyncio.create_task(one(client, line))
                running.add(task)
                task.add_done_callback(running.discard)
                # released when the task ends, even cancelled before it ran: a shared semaphore keeps its slots
                task.add_done_callback(lambda _: slots.release())
            await asyncio.gather(*running)
    finally:
        for task in running:  # cancelled (or failed) before they ended
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if reporter is not None:
            reporter.cancel()
    return summary


def cmd_run_batch(args) -> int:
    from engine.async_engine import AsyncEngine
    from engine.cli import CliError, default_model_dir, engine_config_of, ensure_tiny_model
    from engine.fingerprint import checkpoint_identity, engine_fingerprint
    from engine.llm_engine import LLMEngine
    from serve_app.harmony.render_worker import RenderWorkers
    from serve_app.openai_api.app import create_app

    source, target = Path(args.input), Path(args.output)
    try:
        total = check_file(source)
    except BatchFileError as err:
        raise CliError(str(err)) from None
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError(f"--concurrency must be >= 1, not {args.concurrency}")
    folder = Path(args.model_dir) if args.model_dir else ensure_tiny_model(default_model_dir())
    config = engine_config_of(args, args.max_model_len, seed=args.seed)
    engine = LLMEngine.from_checkpoint(folder, config)
    backend, renderer = AsyncEngine(engine), RenderWorkers()
    try:
        app = create_app(backend, model_name=args.served_model_name, max_context=engine.max_model_len,
                         default_max_tokens=args.default_max_tokens, renderer=renderer,
                         conversation_start_date=args.conversation_start_date,
                         system_fingerprint=engine_fingerprint(engine, checkpoint_identity(folder)))
        target.parent.mkdir(parents=True, exist_ok=True)
        summary = BatchSummary(total)
        done = resume_output(target, {line.custom_id for line in read_file(source)}, summary) if args.resume \
            else set()
        with open(target, "a" if args.resume else "w", encoding="utf-8") as out:
            summary = asyncio.run(run_batch(app, (line for line in read_file(source) if line.custom_id not in done),
                                            out, summary, args.concurrency or 2 * args.max_num_seqs))
    finally:
        backend.shutdown()
        renderer.close()
        engine.close()
    print(f"run-batch: {summary.line()}; results in {target}", file=sys.stderr)
    return 1 if summary.server_failures else 0


def kept_answers(lines: Iterable[str], summary: BatchSummary, seen: set[str],
                 keep: Callable[[str, int], bool] = lambda custom_id, status: True) -> list[str]:
    """Of answer lines written before (OpenAI's output lines, as run_batch writes them), those to keep: each
    custom_id once (`seen` gathers them, across calls), `keep(custom_id, status)` (status 0: no answer), not a line
    cut short; each ending in a newline, counted into `summary`."""
    kept = []
    for text in lines:
        try:
            record = json.loads(text)
            custom_id, answer = record["custom_id"], record.get("response") or {}
            status = answer.get("status_code", 0)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line cut short (or not ours): its request runs again
        if custom_id in seen or not keep(custom_id, status):
            continue
        seen.add(custom_id)
        kept.append(text if text.endswith("\n") else text + "\n")
        summary.add(status, answer.get("body"))
    return kept


def resume_output(target: Path, wanted: set[str], summary: BatchSummary) -> set[str]:
    """--resume: keep the answers an earlier run wrote to `target` for custom_ids in `wanted` (each once; not its
    server failures, 5xx or no answer, which run again; not a last line cut short by a crash), counted into
    `summary`; `target` is rewritten with them (through a temporary file, so a crash now loses nothing). Their
    custom_ids."""
    kept, done = [], set()
    if target.exists():
        with open(target, encoding="utf-8") as f:
            kept = kept_answers(f, summary, done, lambda custom_id, status: custom_id in wanted and 0 < status < 500)
    partial = target.with_name(target.name + ".resume")
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    print(f"run-batch: resuming with {len(done)} answers of {target} kept", file=sys.stderr)
    return done


def add_run_batch_parser(sub) -> None:
    from engine.cli import add_engine_arguments

    p = sub.add_parser("run-batch", help="run an OpenAI Batch API input file (JSONL) through the engine, no Ray")
    p.add_argument("input", help="JSONL of {custom_id, method: POST, url, body}")
    p.add_argument("output", help="where the results go (JSONL, OpenAI's batch output lines)")
    p.add_argument("model_dir", nargs="?", help="HF-layout checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--concurrency", type=int, help="requests in flight at once (default: 2 x --max-num-seqs)")
    p.add_argument("--resume", action="store_true",
                   help="keep the answers OUTPUT already holds (an earlier run stopped, or some failed on the "
                        "server's side) and run only the other requests, appending (default: OUTPUT is rewritten)")
    p.add_argument("--served-model-name", default="gpt-oss", help="the `model` the bodies must name")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens (default: the model's)")
    p.add_argument("--default-max-tokens", type=int,
                   help="output tokens of a chat or responses request that sets none (default: the rest of the "
                        "context)")
    p.add_argument("--conversation-start-date", help="YYYY-MM-DD in the Harmony system message (default: today)")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests that bring none (a run is reproducible)")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_run_batch)
