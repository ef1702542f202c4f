"""AsyncEngine: the TokenBackend of engine/request.py on top of LLMEngine.

One background thread owns the LLMEngine: it applies queued commands (add, import, abort), runs
`step()` while there is work, and hands each delta to the asyncio queue of its request through
`loop.call_soon_threadsafe`. A thread rather than an asyncio task because a step blocks for the
whole forward; the event loop (HTTP, Ray Serve) stays responsive meanwhile.

Failures stay local: a bad request raises InvalidRequestError from its own iterator before the first
delta; a step that raises fails only the requests in that step (StepFailedError) and the loop goes on.
Failures the engine cannot recover from (a device error, a dead rank, failed steps in a row, a hung step:
engine/health.py) make `check_health` raise EngineUnhealthyError, and new requests are refused with it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import torch

from engine.health import EngineHealth, HealthPolicy
from engine.kv_payload import KVDestination, PrefilledKV
from engine.llm_engine import LLMEngine, StepFailedError
from engine.request import EngineUnhealthyError, GenerateRequest, InvalidRequestError, TokenDelta

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine was shut down while the request was in flight; retry on another replica."""


class RequestAbortedError(RuntimeError):
    """A prefill-only request was aborted before its K/V was ready."""


ABORT_WAIT_S = 30.0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill: asyncio.Future | None = None  # set for prefill-only requests: resolves to the payload
    into: KVDestination | None = None  # where a prefill-only request's K/V is exported (engine/kv_payload.py)

    def put(self, item) -> None:
        """From the engine thread: a TokenDelta, or an exception to raise in the consumer."""
        if self.prefill is not None:
            self.loop.call_soon_threadsafe(_resolve, self.prefill, item)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta carrying the tokens (and logprobs) of consecutive deltas of one request in order, with the last
    one's counts and finish reason. In one pass: a stream under the item budget merges ~15 deltas per item, and
    merging them two at a time cost 2.6 us each on this CPU, in the process whose one core bounds 512 streams."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = None if all(d.logprobs is None for d in deltas) else [lp for d in deltas for lp in d.logprobs or ()]
    return replace(deltas[-1], token_ids=[t for d in deltas for t in d.token_ids], logprobs=logprobs,
                   num_cached_tokens=max(d.num_cached_tokens for d in deltas))


def _put_all(batch: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    for queue_, delta in batch:
        queue_.put_nowait(delta)


def _resolve(future: asyncio.Future, item) -> None:
    if future.done():
        return
    if isinstance(item, BaseException):
        future.set_exception(item)
    else:
        future.set_result(item)


class AsyncEngine:
    """Implements engine.request.TokenBackend; also `prefill` / `generate_prefilled` for disaggregation."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5, coalesce: bool = True,
                 health: HealthPolicy | None = None, stream_items_per_s: float = 0.0):
        """coalesce: a request's deltas that are already queued when its consumer asks for the next one
        are merged into one (same tokens, fewer messages); False hands out one delta per engine step.
        health: when the engine counts as unable to serve (engine/health.py; default HealthPolicy()).
        stream_items_per_s (with coalesce; 0 = no limit): the deltas per second all of this engine's streams may
        send together. With N streams sending (first delta out, last not yet), a stream's next delta leaves at least
        N / stream_items_per_s seconds after its previous one and carries every token made meanwhile: while that
        interval is shorter than an engine step nothing changes; past it, deltas carry several tokens. A first
        delta, a lone finishing delta and an error leave at once; the last tokens may wait up to one interval.
        Why: each delta is one message between processes (a Ray Serve streaming item) of fixed CPU cost in the
        replica's process, which caps the deltas per second a replica sends (bench/serve_stream_capacity.py)."""
        if stream_items_per_s < 0:
            raise ValueError(f"stream_items_per_s must be >= 0, got {stream_items_per_s}")
        self.engine = engine
        self.health = EngineHealth(health)
        self.coalesce = coalesce
        self.stream_items_per_s = stream_items_per_s if coalesce else 0.0
        self._sending = 0  # streams that have sent a delta and not ended (event loop side): share the budget
        self.stream_items_sent = 0  # deltas all streams have yielded (one Ray Serve item each behind a replica)
        self.max_context = engine.max_model_len
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gptoss-engine", daemon=True)
        self._thread.start()

    # ---- public API (event-loop side) -------------------------------------------------------------
    def check_health(self) -> None:
        """Raise EngineUnhealthyError saying why if the engine cannot serve (engine/health.py); cheap."""
        problem = self.health.problem()
        if problem is None and not self._thread.is_alive():
            problem = "the engine thread is not running"
        if problem is not None:
            raise EngineUnhealthyError(problem)

    async def _validated(self, request: GenerateRequest) -> None:
        """EngineUnhealthyError while the engine cannot serve; InvalidRequestError for a request the engine can
        never run; then the constraint's one-time work (ConstraintSpec.prepare: compiling grammars) on a worker
        thread, not on the engine loop."""
        self.check_health()
        self.engine.validate(request)
        prepare = getattr(request.sampling.constraint, "prepare", None)
        if prepare is not None:
            await asyncio.to_thread(prepare)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas; leaving the loop early (or cancellation) aborts the request."""
        await self._validated(request)
        stream = _Stream(asyncio.get_running_loop())
        self._submit(lambda: self._start(request.request_id, stream, lambda: self.engine.add_request(request)))
        async for delta in self._drain(request.request_id, stream):
            yield delta

    async def generate_prefilled(self, request: GenerateRequest, payload: PrefilledKV) -> AsyncIterator[TokenDelta]:
        """Like generate, for a request whose prefill ran elsewhere; the first delta carries its token(s)."""
        await self._validated(request)
        stream = _Stream(asyncio.get_running_loop())

        def start() -> None:
            for delta in self.engine.import_prefilled(request, payload):
                stream.put(delta)
                if delta.finish_reason is not None:
                    self._streams.pop(request.request_id, None)

        self._submit(lambda: self._start(request.request_id, stream, start))
        async for delta in self._drain(request.request_id, stream):
            yield delta

    async def prefill(self, request: GenerateRequest, into: KVDestination | None = None) -> PrefilledKV:
        """Run only the prefill and return K/V + first token + sampler state for a decode replica; `into`
        may place the K/V (a transport's slot). Cancelled, it returns only once the engine thread has
        dropped the request, so nothing writes into `into`'s memory after that."""
        await self._validated(request)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, prefill=loop.create_future(), into=into)
        self._submit(lambda: self._start(request.request_id, stream,
                                         lambda: self.engine.add_request(request, prefill_only=True)))
        try:
            return await stream.prefill
        except asyncio.CancelledError:
            await self.abort(request.request_id, wait=into is not None)
            raise

    async def abort(self, request_id: str, wait: bool = False) -> None:
        """Abort a request; with wait, return once the engine thread has done it."""
        if not wait:
            self._submit(lambda: self._abort(request_id))
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            try:
                self._abort(request_id)
            finally:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        self._submit(command)
        await asyncio.wait({done}, timeout=ABORT_WAIT_S)  # bounded: a stopped engine thread never answers

    def metrics(self) -> dict:
        """The engine's counters (engine/metrics.py) and `stream_items_total`: the deltas streamed so far (decode
        tokens over it is how many tokens a delta carries: coalescing and stream_items_per_s at work)."""
        return {**self.engine.metrics.snapshot(), "stream_items_total": self.stream_items_sent}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still in flight fail with EngineStoppedError."""
        self._stopping = True
        self.health.stopped("shut down")
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- event-loop helpers -----------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopping:
            raise EngineStoppedError("the engine is shut down")
        self._commands.put(command)
        self._wake.set()

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[TokenDelta]:
        finished = False
        held = None  # an exception met while merging: raised after the merged delta is out
        sent_at = None  # when this stream's last delta left (stream_items_per_s); set, it counts in _sending
        try:
            while True:
                item = held if held is not None else await stream.queue.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if sent_at is not None and item.finish_reason is None:
                    wait = sent_at + self._sending / self.stream_items_per_s - stream.loop.time()
                    if wait > 0:  # let this request's next tokens join this delta
                        await asyncio.sleep(wait)
                # Deltas that queued up while the consumer was busy leave as one (under load a Serve replica
                # then sends one message per request per wake-up instead of one per engine step).
                if self.coalesce and item.finish_reason is None and not stream.queue.empty():
                    parts = [item]
                    while parts[-1].finish_reason is None and not stream.queue.empty():
                        more = stream.queue.get_nowait()
                        if isinstance(more, BaseException):
                            held = more
                            break
                        parts.append(more)
                    item = merge_deltas(parts)
                finished = item.finish_reason is not None
                self.stream_items_sent += 1
                yield item
                if finished:
                    return
                if self.stream_items_per_s:
                    if sent_at is None:
                        self._sending += 1
                    sent_at = stream.loop.time()
        finally:
            if sent_at is not None:
                self._sending -= 1
            if not finished and not self._stopping:  # consumer left early or was cancelled
                self._submit(lambda: self._abort(request_id))

    # ---- engine thread ------------------------------------------------------------------------------
    def _start(self, request_id: str, stream: _Stream, add: Callable[[], None]) -> None:
        if request_id in self._streams:
            stream.put(InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id"))
            return
        self._streams[request_id] = stream
        try:
            add()
        except (ValueError, RuntimeError) as exc:  # InvalidRequestError, KVPayloadError, ...
            self._streams.pop(request_id, None)
            stream.put(exc)

    def _abort(self, request_id: str) -> None:
        delta = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and delta is not None:
            stream.put(delta if stream.prefill is None else
                       RequestAbortedError(f"request {request_id} was aborted during its prefill"))

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if stream.prefill is not None:  # prefill-only: its one delta means the K/V is ready
                self._streams.pop(delta.request_id)
                try:
                    stream.put(self.engine.export_kv(delta.request_id, stream.into))
                except RuntimeError as exc:  # a failed device read: this request only
                    self.engine.abort(delta.request_id)
                    stream.put(exc)
                continue
            batches.setdefault(stream.loop, []).append((stream.queue, delta))
            if delta.finish_reason is not None:
                self._streams.pop(delta.request_id)
        for loop, batch in batches.items():  # one wake-up of each event loop per step, not one per request
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the loop itself: nothing steps any more
            self.health.stopped(f"the engine thread died ({type(exc).__name__}: {exc})")
            log.exception("engine thread died")
            raise

    def _loop(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":
            # The current CUDA device is per thread and a new thread starts on cuda:0, where Triton launches
            # its kernels: an engine on cuda:1 (a Serve replica that sees every GPU of its node, for CUDA IPC)
            # ran its eager Triton kernels on GPU 0 over peer memory, or failed "Pointer argument cannot be
            # accessed from Triton" where no peer mapping existed (2x H200, 2026-11-30).
            torch.cuda.set_device(device)
        while not self._stopping:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # a command's own errors reach its stream in _start; this is a bug
                    log.exception("engine command failed")
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.health.step_started()
                deltas = self.engine.step()
                self.health.step_succeeded()
                self._dispatch(deltas)
                if not deltas and not self.engine.scheduler.running:
                    # Waiting requests that cannot be admitted yet (pages held elsewhere): don't spin.
                    self._wake.wait(0.005)
                    self._wake.clear()
            except StepFailedError as exc:
                self.health.step_failed(exc)
                log.error("engine step failed; failing requests %s", exc.request_ids, exc_info=exc)
                self._fail(exc.request_ids, exc)
            except Exception as exc:  # a bug outside the forward: fail everything in flight, keep serving
                self.health.step_failed(exc)
                log.exception("engine loop error; failing all in-flight requests")
                self._fail(list(self._streams), exc)
        self._fail(list(self._streams), EngineStoppedError("the engine was shut down"))
