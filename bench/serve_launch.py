"""Start serve_app on a local Ray for a benchmark, read its replicas' counters, stop it.

What `serve run serve_app:app key=value ...` does, in this process, so that a benchmark can time the
deployment a user runs (HTTP proxy, ingress, prefill and decode replicas, K/V hand-off) and stop it
cleanly afterwards.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

APP = "bench"


def api_key() -> str:
    """The key a server started with ingress.api_keys wants: $OPENAI_API_KEY, as the openai client reads it."""
    return os.environ.get("OPENAI_API_KEY") or "unused"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener_on(port: int) -> str | None:
    """Name of the process listening on a local TCP port: "haproxy" when Serve runs HAProxy
    (RAY_SERVE_ENABLE_HA_PROXY=1), "ray::ProxyActor" for its Python proxy; None if not found."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return psutil.Process(conn.pid).name()
            except psutil.Error:
                return None
    return None


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
        self.port: int | None = None
        self._loop = None  # the event-loop thread handle calls run on (_on_loop)

    def start(self) -> str:
        import ray
        from ray import serve

        from serve_app.builder import build_app

        t0 = time.perf_counter()
        ray.init(include_dashboard=False, num_gpus=self.num_gpus)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(build_app(self.args), name=APP, route_prefix="/", blocking=False)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                ready = urllib.request.Request(f"{self.url}/v1/models",
                                               headers={"Authorization": f"Bearer {api_key()}"})
                with urllib.request.urlopen(ready, timeout=5) as resp:
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

    def http_listener(self) -> str | None:
        """Name of the process accepting HTTP on the app's port (`listener_on`)."""
        return listener_on(self.port)

    def replica_stats(self, deployment: str | None = None) -> list[dict]:
        """A deployment's replicas' `stats()` (device, transport, transfers, fallbacks, pool usage, engine
        counters), one per device: Serve routes each call to some replica, so it asks a few times per
        running replica. Default: the decode deployment."""
        from ray import serve

        from serve_app.builder import DECODE_NAME

        deployment = deployment or DECODE_NAME
        status = serve.status().applications[APP].deployments.get(deployment)
        if status is None:
            return []
        running = status.replica_states.get("RUNNING", 1)

        async def ask() -> list[dict]:
            handle = serve.get_deployment_handle(deployment, APP)
            return [await handle.stats.remote() for _ in range(4 * running)]

        seen: dict[str, dict] = {}
        for stats in self._on_loop(ask()):
            seen.setdefault(stats["device"], stats)
        return [seen[d] for d in sorted(seen)]

    def _on_loop(self, coroutine, timeout_s: float = 60.0):
        """Run a coroutine on this object's event-loop thread. Handles are used from there: with
        RAY_SERVE_THROUGHPUT_OPTIMIZED=1 Serve routes on the caller's running loop and a plain
        `.result()` outside one raises."""
        import asyncio
        import threading

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="serve-launch-handles", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def engine_counters(self) -> dict:
        """Per deployment, the engines' TTFT / TPOT sums and counts added over their replicas."""
        from serve_app.builder import DECODE_NAME, PREFILL_NAME

        out = {}
        for name in (PREFILL_NAME, DECODE_NAME):
            sums = {"ttft_sum": 0.0, "ttft_count": 0, "tpot_sum": 0.0, "tpot_count": 0}
            for stats in self.replica_stats(name):
                for key in ("ttft", "tpot"):
                    sums[f"{key}_sum"] += stats[f"{key}_seconds"]["sum"]
                    sums[f"{key}_count"] += stats[f"{key}_seconds"]["count"]
            out[name] = sums
        return out

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


class ServerProbe:
    """What the server side did during one load level: the engines' own TTFT / TPOT (from their counters,
    so the HTTP / Ray / ingress share of what the client saw is the difference) and the CPU each Ray
    process used (cores busy: 1.0 = one core all the time)."""

    # The replicas --py-spy records, each in a thread of its own (at the same time): by a word of their process title.
    SPIED = ("DecodeServer", "HarmonyIngress")

    def __init__(self, app: LaunchedApp, py_spy_s: float = 0.0, py_spy_delay_s: float = 10.0, out_dir=None):
        """py_spy_s > 0: record the decode and ingress replicas' processes for that long (twice:
        bench/pyspy_summary.py), py_spy_delay_s into each level, saving the recordings under out_dir."""
        self.app = app
        self.py_spy_s, self.py_spy_delay_s, self.out_dir = py_spy_s, py_spy_delay_s, out_dir
        self._counters: dict = {}
        self._cpu: dict = {}
        self._spies: list = []  # (deployment, thread, result holder) of this level's recordings
        self.level = 0

    def start(self) -> None:
        self._counters = self.app.engine_counters()
        self._cpu = ray_process_cpu()
        self.level += 1
        if self.py_spy_s > 0:
            import threading

            for name in self.SPIED:
                holder: dict = {}
                thread = threading.Thread(target=self._record, args=(name, holder), daemon=True)
                thread.start()
                self._spies.append((name, thread, holder))

    def _record(self, name: str, holder: dict) -> None:
        from bench.pyspy_summary import record

        time.sleep(self.py_spy_delay_s)
        pids = [pid for pid, (title, _) in ray_process_cpu().items() if name in title]
        if not pids:
            holder["result"] = {"error": f"no {name} replica process found"}
            return
        try:
            stem = f"pyspy_{name}_level{self.level}"
            holder["result"] = {"pid": pids[0], **record(pids[0], self.py_spy_s, self.out_dir, stem)}
        except Exception as err:  # a diagnostic: never fails the load run
            holder["result"] = {"error": f"{type(err).__name__}: {err}"}

    def finish(self, wall_s: float) -> dict:
        after, cpu = self.app.engine_counters(), ray_process_cpu()
        engines = {}
        for name, sums in after.items():
            before = self._counters.get(name, {})
            row = {}
            for key in ("ttft", "tpot"):
                n = sums[f"{key}_count"] - before.get(f"{key}_count", 0)
                total = sums[f"{key}_sum"] - before.get(f"{key}_sum", 0.0)
                row[f"{key}_ms_mean"] = round(total / n * 1e3, 2) if n else None
            engines[name] = row
        busy: dict[str, float] = {}
        for pid, (title, seconds) in cpu.items():
            if pid in self._cpu:
                busy[title] = busy.get(title, 0.0) + (seconds - self._cpu[pid][1]) / wall_s
        top = dict(sorted(((t, round(v, 2)) for t, v in busy.items()), key=lambda kv: -kv[1])[:8])
        out = {"engines": engines, "cpu_cores_busy": top}
        if self._spies:  # (a level shorter than delay + 2 recordings: waits for them)
            out["py_spy"] = {}
            for name, thread, holder in self._spies:
                thread.join(self.py_spy_delay_s + 2 * self.py_spy_s + 60)
                out["py_spy"][name] = holder.get("result", {"error": "the recording did not finish"})
            self._spies = []
        return out


def ray_process_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (process title, CPU seconds so far) of this machine's Ray processes (`ray::...` titles:
    Serve replicas, the proxy, the controller) and of this process ("driver"), from /proc."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if pid == os.getpid():
            title = "driver (load client)"
        elif not title.startswith("ray::"):
            continue
        # Ray titles a worker by its actor and current method (ray::ServeReplica:app:Deployment.method)
        out[pid] = (title.split(" ")[0].split(".")[0][:60], (int(fields[11]) + int(fields[12])) / ticks)
    return out
