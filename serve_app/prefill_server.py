"""PrefillServer: runs prompts and ships their K/V to the decode replica that asked.

A decode replica calls `prefill(request, offer)`; the engine runs the prompt alone (prefill_only: it
stops after sampling the first token and keeps the K/V), exports the K/V by token, and the transport
ships it as the offer asks. The returned KVHandle carries the first token and sampler state inside
its payload skeleton, so decode continues the exact token stream a single engine would produce.
"""

from __future__ import annotations

import asyncio
import time

from engine.request import GenerateRequest
from serve_app.config import GIB, ServeAppConfig
from serve_app.engine_host import (engine_stats, log, replica_device, report_metrics_forever, start_engine,
                                   stop_hosting)
from serve_app.kv_transfer import KVHandle, ReceiveOffer, current_node_id, make_transport
from serve_app.metrics import ServerMetrics


class PrefillServer:
    async def __init__(self, config: ServeAppConfig | dict):
        self.config = ServeAppConfig.from_args(config)
        self.device = replica_device(self.config)
        self.transport = make_transport(self.config.resolved_transport(self.config.resolved_device()), self.device,
                                        int(self.config.cuda_ipc_buffer_gib * GIB))
        self.node_id = current_node_id()
        self.engine = await asyncio.to_thread(start_engine, self.config, self.config.prefill, self.device)
        self.metrics = ServerMetrics("prefill", self.config.served_model_name)
        self._reporter = asyncio.get_running_loop().create_task(report_metrics_forever(self.engine, self.metrics))

    async def prefill(self, request: GenerateRequest, offer: ReceiveOffer) -> KVHandle:
        """Run the prompt, ship its K/V as `offer` asks; InvalidRequestError for a request the engine refuses."""
        t0 = time.perf_counter()
        # over CUDA IPC the engine gathers the K/V straight into the decode replica's slot
        payload = await self.engine.prefill(request, self.transport.export_target(offer))
        t1 = time.perf_counter()
        if offer.kind == "cuda_ipc":
            # In the event loop, not a thread: once started, the copy into the decode replica's slot must
            # finish before this call can end (the decode side frees the slot when the call ends, even on
            # cancellation).
            handle = self.transport.send(payload, offer)
        else:
            handle = await asyncio.to_thread(self.transport.send, payload, offer)
        handle.node_id = self.node_id
        log.info("prefill %s: %d prompt tokens in %.1f ms; K/V %d bytes packed for %s in %.2f ms",
                 request.request_id, len(request.prompt_ids), (t1 - t0) * 1e3, handle.nbytes, handle.kind,
                 handle.pack_ms)
        return handle

    def check_health(self) -> None:
        """Serve's health check: EngineUnhealthyError while the engine cannot serve (engine/health.py); Serve
        replaces the replica after 3 in a row, and meanwhile the engine refuses new requests with a 503."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Debug: the engine's pool usage and counters."""
        return {"device": self.device, "transport": self.transport.name, **engine_stats(self.engine)}

    def __del__(self):
        stop_hosting(self)
