"""HarmonyIngress: the OpenAI API (serve_app/openai_api's `create_app`) served by Ray Serve over HTTP.

The FastAPI app is built inside the replica, around `ServeTokenBackend`: a TokenBackend whose engine is
the DecodeServer deployment, called through a streaming DeploymentHandle. This process imports no
torch: token ids go out, TokenDeltas come back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError

from engine.request import BackendOverloaded, EngineUnhealthyError, GenerateRequest, InvalidRequestError, TokenDelta
from serve_app.deployment_settings import IngressSettings
from serve_app.harmony.render_worker import RenderWorkers
from serve_app.grafana import install_if_head_node
from serve_app.metrics import ApiMetrics
from serve_app.response_store import ServeResponseStore

log = logging.getLogger("ray.serve")

# Under Serve's default graceful_shutdown_timeout_s (20 s), after which the replica is killed.
BACKGROUND_DRAIN_S = 10.0
ADOPT_TIMEOUT_S = 5.0  # a health check waits this long at most for the store's answer on batches to adopt


class ServeTokenBackend:
    """engine/request.py's TokenBackend over a DecodeServer DeploymentHandle."""

    def __init__(self, decode_handle, max_context: int, system_fingerprint: str | None = None):
        self._decode = decode_handle.options(stream=True)
        self.max_context = max_context
        self.system_fingerprint = system_fingerprint  # the decode deployment's (engine/fingerprint.py)
        self._in_flight: dict[str, object] = {}  # request id -> its response generator

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        responses = self._decode.generate.remote(request)
        self._in_flight[request.request_id] = responses
        ended = False
        try:
            async for delta in responses:
                yield delta
            ended = True
        except BackPressureError as err:  # the decode deployment's queue in this replica is full (max_queued_requests)
            ended = True
            raise BackendOverloaded(f"decode queue full: {err}") from None
        except RayTaskError as err:
            ended = True
            # The decode replica refused the request: re-raise the engine's own error so the API turns it
            # into a 400 with its `param`, or, from an engine that cannot serve, a 503 to retry (Serve replaces
            # that replica). Anything else (a replica that died, ...) propagates as is and becomes a 503 too.
            cause = getattr(err, "cause", None)
            if isinstance(cause, InvalidRequestError):
                raise InvalidRequestError(str(cause), cause.param) from None
            if isinstance(cause, EngineUnhealthyError):
                raise EngineUnhealthyError(str(cause)) from None
            raise
        finally:
            self._in_flight.pop(request.request_id, None)
            if not ended:
                # Closed early (the client went away while this generator sat at a `yield`, not inside
                # Serve's await, so no cancellation reached the decode replica; `abort` then finds the
                # request gone from _in_flight): cancel the decode call here, or it runs to max_tokens.
                responses.cancel()

    async def abort(self, request_id: str) -> None:
        """Cancel the request on whichever decode replica runs it (Serve propagates the cancellation,
        and the replica's generator aborts the request in its engine)."""
        responses = self._in_flight.pop(request_id, None)
        if responses is not None:
            responses.cancel()


@serve.ingress()
class HarmonyIngress:
    """HTTP ingress. `decode`: the DecodeServer handle of the model `served_model_name`; `more_models`: further
    models behind the same API, {served name: (their DecodeServer handle, max_context or None)}, routed by the
    body's `model` (serve_app/openai_api/model_router.py). A context limit left None is asked from the model."""

    async def __init__(self, decode, served_model_name: str, max_context: int | None = None,
                       settings: IngressSettings | None = None, response_store=None,
                       more_models: dict[str, tuple[Any, int | None]] | None = None):
        """response_store: the ResponseStore deployment's handle (None: /v1/responses is stateless)."""
        models = {served_model_name: (decode, max_context), **(more_models or {})}
        self.backends: dict[str, ServeTokenBackend] = {}
        for name, (handle, limit) in models.items():
            self.backends[name] = ServeTokenBackend(handle, limit if limit is not None else
                                                    await handle.max_context.remote(),
                                                    await handle.system_fingerprint.remote())
        self.backend = self.backends[served_model_name]  # the first model's (the only one, usually)
        self.served_model_name = served_model_name
        self.settings = settings or IngressSettings(api_keys=[])
        self.response_store = ServeResponseStore(response_store) if response_store is not None else None
        self.api_metrics = ApiMetrics()
        self.renderer = RenderWorkers(self.settings.render_workers, self.settings.render_off_loop_chars)
        self.renderer.warm()
        install_if_head_node()  # Grafana's dashboard of the app's metrics (serve_app/grafana.py)

    def __serve_build_asgi_app__(self):
        from serve_app.openai_api.app import DEFAULT_MAX_BODY_BYTES, create_app
        from serve_app.openai_api.model_router import serve_models

        s = self.settings
        several = len(self.backends) > 1  # then keys and CORS wrap the router, once, not each model's app
        self._apps = {name: create_app(
            backend, model_name=name, max_context=backend.max_context,
            conversation_start_date=s.conversation_start_date, default_max_tokens=s.default_max_tokens,
            api_keys=() if several else s.api_key_values(), stream_keepalive_s=s.stream_keepalive_s,
            response_store=self.response_store, cors_allow_origins=() if several else s.cors_allow_origins,
            allow_priority=s.allow_priority, isolate_prefix_cache=s.isolate_prefix_cache,
            forced_call_reasoning_tokens=s.forced_call_reasoning_tokens, usage_sink=self.api_metrics.record,
            renderer=self.renderer, system_fingerprint=backend.system_fingerprint,
            batch_concurrency=s.batch_concurrency, batch_priority=s.batch_priority,
            max_upload_bytes=int(s.file_max_mib * 2**20))
            for name, backend in self.backends.items()}
        if not several:
            return self._apps[self.served_model_name]
        return serve_models(self._apps, max_body_bytes=DEFAULT_MAX_BODY_BYTES, api_keys=s.api_key_values(),
                            cors_allow_origins=s.cors_allow_origins)

    async def check_health(self) -> None:
        """Serve's periodic health check (ingress.health_check_period_s): also where this replica adopts the
        background responses (background.BackgroundRuns.adopt, each model's app its own) and a batch
        (batch_runs.BatchRuns.adopt) that another replica gave back or left silent. A store that does not answer is
        logged, not a failed check."""
        apps = list(getattr(self, "_apps", {}).values())
        runs = [(app.state.background, "background responses") for app in apps if app.state.background is not None]
        # (the first app runs the batches: model_router.serve_models)
        runs += [(app.state.batches, "batches") for app in apps[:1] if app.state.batches is not None]
        for runner, what in runs:
            try:
                await asyncio.wait_for(runner.adopt(), ADOPT_TIMEOUT_S)
            except Exception as err:
                log.warning("looking for %s to adopt failed (%s: %s)", what, type(err).__name__, err)

    async def __del__(self):
        """Serve's graceful shutdown (after in-flight HTTP requests drained): background responses get a few
        seconds to finish, the rest are given back for another replica to run again (streamed ones: to go on from
        their stored events; serve_app/openai_api/background.py); running batches are given back to the store with
        the answers they have, for another replica to finish (batch_runs.py)."""
        apps = getattr(self, "_apps", {}).values()
        runs = [app.state.background for app in apps if app.state.background is not None]
        batches = [app.state.batches for app in apps if app.state.batches is not None]
        await asyncio.gather(*(background.stop(wait_s=BACKGROUND_DRAIN_S) for background in runs),
                             *(batch_runs.stop() for batch_runs in batches))
        self.renderer.close()
