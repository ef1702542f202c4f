"""DecodeServer: orchestrates one request end to end and streams its tokens.

    validate -> offer a receive slot -> PrefillServer.prefill (a replica on this node first) -> receive K/V -> import into
    the local engine -> decode, streaming TokenDeltas back to the ingress

If the remote prefill fails (replica died, error, busy past `prefill_timeout_s`) or its K/V does not
arrive (`kv_transfer_timeout_s`, lost object, unusable payload), the decode replica runs the prompt
itself and the request still succeeds: same tokens, later first token. Each transfer's bytes and
milliseconds are logged and exported as metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import AsyncIterator

import ray
from ray.serve.exceptions import BackPressureError, RayServeException

from engine.kv_payload import KVPayloadError, PrefilledKV
from engine.request import EngineUnhealthyError, GenerateRequest, TokenDelta
from serve_app.config import GIB, ServeAppConfig
from serve_app.engine_host import (engine_stats, log, replica_device, replica_fingerprint, report_metrics_forever,
                                   start_engine, stop_hosting)
from serve_app.kv_transfer import CudaIpcTransport, KVTransferError, ReceiveOffer, make_transport, payload_upper_bound
from serve_app.metrics import ServerMetrics

# Failures of the remote half that the local prefill recovers from.
_REMOTE_FAILURES = (ray.exceptions.RayError, RayServeException, KVTransferError, KVPayloadError, asyncio.TimeoutError)


class DecodeServer:
    async def __init__(self, prefill, config: ServeAppConfig | dict):
        """prefill: a DeploymentHandle of PrefillServer, or None to run every prompt here."""
        self.config = ServeAppConfig.from_args(config)
        self.prefill = prefill
        self.device = replica_device(self.config)
        self.transport = make_transport(self.config.resolved_transport(self.config.resolved_device()), self.device,
                                        int(self.config.cuda_ipc_buffer_gib * GIB))
        if isinstance(self.transport, CudaIpcTransport):
            self.transport.reserve_arena()  # before the engine sizes its KV pools from free memory
        self.engine = await asyncio.to_thread(start_engine, self.config, self.config.decode, self.device)
        runner = self.engine.engine.runner
        self._kv_shape = (runner.layer_is_sliding, runner.payload_kv_heads, runner.head_dim, runner.kv_dtype,
                          self.engine.engine.model.config.sliding_window)
        self._fingerprint = replica_fingerprint(self.config, self.engine.engine)
        self.metrics = ServerMetrics("decode", self.config.served_model_name)
        self._reporter = asyncio.get_running_loop().create_task(report_metrics_forever(self.engine, self.metrics))
        self.fallbacks: Counter[str] = Counter()  # by reason (_reason)
        self.local_prefills = 0  # prompts run here because this replica's prefix cache held nearly all of them
        self.transfers_by_node: Counter[str] = Counter()  # "same": the prefill replica ran on this node; "other"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas; InvalidRequestError before the first one for a bad request."""
        t0 = time.monotonic()
        self.engine.check_health()  # refuse while the engine cannot serve, and bad requests, before remote work
        self.engine.engine.validate(request)
        stream = None
        first_at = last_at = None
        num_out = num_cached = 0
        outcome, prefill = "cancelled", "local"  # what ended it; where its prompt ran
        try:
            if self.prefill is not None and (cached_here := await self._mostly_cached_here(request)):
                prefill = f"local: {cached_here} tokens cached here"
                self.local_prefills += 1
            elif self.prefill is not None:
                payload, prefill = await self._remote_prefill(request)
                stream = self.engine.generate_prefilled(request, payload) if payload is not None else None
            if stream is not None:
                try:
                    first = await stream.__anext__()
                except KVPayloadError as err:  # prefill and decode disagree about the model
                    prefill = self._fell_back(request, "import_error", err)
                    await stream.aclose()
                    stream = None
            if stream is None:
                stream = self.engine.generate(request)
                first = await stream.__anext__()
            delta = first
            while True:
                if delta.token_ids:
                    last_at = time.monotonic()
                    first_at = first_at or last_at
                num_out, num_cached = delta.num_output_tokens, max(num_cached, delta.num_cached_tokens)
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason
                yield delta
                if delta.finish_reason is not None:
                    break
                delta = await stream.__anext__()
        except Exception as err:
            outcome = f"failed ({type(err).__name__})"
            raise
        finally:
            if stream is not None:
                await stream.aclose()  # after an early exit (client gone, cancelled) this aborts in the engine
            tpot = (last_at - first_at) / (num_out - 1) if first_at and num_out > 1 else None
            self.metrics.observe_request(first_at - t0 if first_at else None, tpot)
            # one line per request; under Serve it carries the request's x-request-id
            log.info("request %s: %s after %.3f s; prompt %d tokens (%d cached, prefill %s), output %d tokens, "
                     "first token %s, %s", request.request_id, outcome, time.monotonic() - t0,
                     len(request.prompt_ids), num_cached, prefill, num_out,
                     f"{first_at - t0:.3f} s" if first_at else "-",
                     f"{1 / tpot:.1f} tok/s after it" if tpot else "no decode rate")

    async def _mostly_cached_here(self, request: GenerateRequest) -> int:
        """The prompt tokens this replica's prefix cache holds, if the prompt continues an output generated here
        (its cached prefix ends in such a block: a prefill replica never saw it) and at most local_prefill_max_tokens
        of it are not cached (then the prompt runs here: ServeAppConfig.local_prefill_max_tokens); else 0. A prompt
        that only shares what a prefill replica also caches (a system prompt) goes there as before. (Hashing a
        prompt takes ~1 us per block: a long one's off the event loop.)"""
        limit = self.config.local_prefill_max_tokens
        if not limit:
            return 0
        look = self.engine.engine.block_manager.cached_prefix
        args = (request.prompt_ids, request.cache_salt)
        cached, past_output = await asyncio.to_thread(look, *args) if len(request.prompt_ids) > 4096 else look(*args)
        return cached if past_output and len(request.prompt_ids) - cached <= limit else 0

    async def _remote_prefill(self, request: GenerateRequest) -> tuple[PrefilledKV | None, str]:
        """The prompt's K/V + first token from a prefill replica, or None (then decode runs the prompt); and
        where the prompt ran, for the request's log line."""
        sliding, kv_heads, head_dim, dtype, window = self._kv_shape
        offer = self.transport.offer(payload_upper_bound(len(request.prompt_ids), len(sliding), sliding, window,
                                                         kv_heads, head_dim, dtype))
        call = asyncio.ensure_future(self._call_prefill(request, offer))
        try:
            try:
                done, _ = await asyncio.wait({call}, timeout=self.config.prefill_timeout_s)
            except asyncio.CancelledError:  # the client went away while the prompt ran remotely
                done = None
                raise
            finally:
                if not done:
                    # The call is not cancelled: the prefill finishes in the background and its K/V is
                    # dropped. Until it ends it may still write into the offered slot: free it only then.
                    call.add_done_callback(lambda _: self.transport.release(offer))
            if not done:
                raise asyncio.TimeoutError(f"no prefill answer within {self.config.prefill_timeout_s} s")
            try:
                handle = call.result()
                t_recv = time.perf_counter()
                payload = await self.transport.receive(handle, offer, self.config.kv_transfer_timeout_s)
            finally:
                self.transport.release(offer)  # the call has ended and receive copied the slot out
        except _REMOTE_FAILURES as err:
            return None, self._fell_back(request, _reason(err), err)
        stats = self.transport.last_stats
        total_s = handle.pack_ms / 1e3 + (time.perf_counter() - t_recv)
        node = "same" if handle.node_id == offer.node_id else "other"
        self.transfers_by_node[node] += 1
        self.metrics.observe_transfer(handle.kind, handle.nbytes, total_s, node)
        log.info("kv transfer %s: %d bytes via %s from %s node, pack %.2f ms + receive %.2f ms (waiting for the "
                 "copy: %s ms; %.1f MB/s)", request.request_id, handle.nbytes, handle.kind,
                 "this" if node == "same" else "another", handle.pack_ms, stats.receive_ms,
                 "-" if stats.wait_ms is None else f"{stats.wait_ms:.2f}", handle.nbytes / max(total_s, 1e-9) / 1e6)
        return payload, f"remote on {'this' if node == 'same' else 'another'} node, K/V via {handle.kind}"

    async def _call_prefill(self, request: GenerateRequest, offer: ReceiveOffer):
        return await self.prefill.prefill.remote(request, offer)

    def _fell_back(self, request: GenerateRequest, reason: str, err: BaseException) -> str:
        self.fallbacks[reason] += 1
        self.metrics.observe_fallback(reason)
        log.warning("request %s: remote prefill failed (%s: %s); running the prompt on this decode replica",
                    request.request_id, reason, err)
        return f"local after {reason}"

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def max_context(self) -> int:
        return self.engine.max_context

    async def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint` of this deployment's configuration (engine/fingerprint.py)."""
        return self._fingerprint

    def check_health(self) -> None:
        """Serve's health check: EngineUnhealthyError while the engine cannot serve (engine/health.py); Serve
        replaces the replica after 3 in a row, and meanwhile the engine refuses new requests with a 503."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Debug: pool usage and counters of this replica's engine, transfers and fallbacks."""
        out = {"device": self.device, "transport": self.transport.name,
               "transfers": sum(self.transfers_by_node.values()), "transfers_by_node": dict(self.transfers_by_node),
               "fallbacks": sum(self.fallbacks.values()), "fallback_reasons": dict(self.fallbacks),
               "local_prefills": self.local_prefills,
               **engine_stats(self.engine)}
        if isinstance(self.transport, CudaIpcTransport):
            out["cuda_ipc_arena_free_bytes"] = self.transport.arena_free_bytes
        return out

    def __del__(self):
        stop_hosting(self)


def _reason(err: BaseException) -> str:
    if isinstance(err, BackPressureError):  # the prefill deployment's queue in this replica is full
        return "prefill_overloaded"
    if isinstance(err, asyncio.TimeoutError):
        return "prefill_timeout"
    if isinstance(err, KVTransferError):
        return "transfer_error"
    if isinstance(getattr(err, "cause", None), EngineUnhealthyError):  # that prefill replica is being replaced
        return "prefill_unhealthy"
    return "prefill_error"
