"""Start serve_app on a local Ray for a benchmark, read its replicas' counters, stop it.

What `serve run serve_app:app key=value ...` does, in this process, so that a benchmark can time the
deployment a user runs (HTTP proxy, ingress, prefill and decode replicas, K/V hand-off) and stop it
cleanly afterwards.
"""

from __future__ import annotations

import socket
import time
import urllib.request

APP = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedApp:
    def __init__(self, args: list[str], num_gpus: int | None = None, ready_timeout_s: float = 900.0):
        from serve_app.config import ServeAppConfig

        self.args = dict(a.split("=", 1) for a in args)
        self.config = ServeAppConfig.from_args(self.args)  # fails here on a bad key, before Ray starts
        self.model_name = self.config.served_model_name
        self.num_gpus = num_gpus
        self.ready_timeout_s = ready_timeout_s
        self.startup_s: float | None = None
        self.url: str | None = None

    def start(self) -> str:
        import ray
        from ray import serve

        from serve_app.builder import build_app

        t0 = time.perf_counter()
        ray.init(include_dashboard=False, num_gpus=self.num_gpus)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(self.args), name=APP, route_prefix="/", blocking=False)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            status = serve.status().applications.get(APP)
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"serve_app failed to deploy: {status.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve_app did not answer within {self.ready_timeout_s} s")
            time.sleep(1.0)
        self.startup_s = round(time.perf_counter() - t0, 1)
        return self.url

    def replica_stats(self) -> list[dict]:
        """The decode replicas' `stats()` (device, transport, transfers, fallbacks, pool usage), one per
        device: Serve routes each call to some replica, so it asks a few times per running replica."""
        from ray import serve

        from serve_app.builder import DECODE_NAME

        status = serve.status().applications[APP].deployments[DECODE_NAME]
        running = status.replica_states.get("RUNNING", 1)
        handle = serve.get_deployment_handle(DECODE_NAME, APP)
        seen: dict[str, dict] = {}
        for _ in range(4 * running):
            stats = handle.stats.remote().result()
            seen.setdefault(stats["device"], stats)
        return [seen[d] for d in sorted(seen)]

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
