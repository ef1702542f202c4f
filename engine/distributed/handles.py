"""Rank 0's view of ranks 1 .. N-1: start them, notice when one fails, stop them.

Two kinds with one interface: spawned processes (tests, benchmarks, the CLI) and Ray actors (a Serve
replica's placement group). A failure is the worker's own report (its traceback) when it could send
one, else what the process or actor died of.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from typing import Protocol

from engine.distributed.worker import GroupSpec, process_main


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    detail: str  # the worker's traceback, or how it died


class WorkerFailedError(RuntimeError):
    """A rank of a multi-rank engine raised, crashed or went out of step; the engine cannot continue
    and must be restarted (its other ranks are stopped). `rank` and `detail` say which and why."""

    def __init__(self, failure: WorkerFailure):
        self.rank = failure.rank
        self.detail = failure.detail
        lines = failure.detail.strip().splitlines() or ["no detail"]
        message = (f"rank {failure.rank} of the model group failed ({lines[-1]}); the engine's ranks are stopped: "
                   "start a new engine")
        super().__init__(message + (f". Its report:\n{failure.detail}" if len(lines) > 1 else ""))


class WorkerSet(Protocol):
    def poll_failure(self) -> WorkerFailure | None: ...
    def wait_failure(self, timeout_s: float) -> WorkerFailure | None: ...
    def join(self, timeout_s: float) -> None: ...
    def kill(self) -> None: ...


def _wait(poll, timeout_s: float) -> WorkerFailure | None:
    deadline = time.monotonic() + timeout_s
    while True:
        failure = poll()
        if failure is not None or time.monotonic() >= deadline:
            return failure
        time.sleep(0.02)


class ProcessWorkers:
    """Ranks 1 .. N-1 as `multiprocessing` spawn processes, each with a pipe for its failure report."""

    def __init__(self, processes: dict, pipes: dict):
        self.processes = processes
        self.pipes = pipes

    @classmethod
    def spawn(cls, spec: GroupSpec) -> "ProcessWorkers":
        ctx = multiprocessing.get_context("spawn")  # fork would copy rank 0's threads and CUDA state
        processes, pipes = {}, {}
        for rank in range(1, spec.world_size):
            receive, send = ctx.Pipe(duplex=False)
            # daemon: multiprocessing stops them if rank 0's interpreter exits without shutdown()
            p = ctx.Process(target=process_main, args=(rank, spec, send), name=f"gptoss-rank{rank}", daemon=True)
            p.start()
            send.close()  # the child holds the only write end: EOF here means it is gone
            processes[rank], pipes[rank] = p, receive
        return cls(processes, pipes)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def _report(self, rank: int) -> str | None:
        conn = self.pipes[rank]
        try:
            return conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            return None

    def poll_failure(self) -> WorkerFailure | None:
        for rank, p in self.processes.items():
            text = self._report(rank)
            if text is not None:
                return WorkerFailure(rank, text)
            if p.exitcode is not None:
                text = self._report(rank)  # sent just before it exited?
                code = p.exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return WorkerFailure(rank, text or f"worker process {p.pid} {how} without a report")
        return None

    def wait_failure(self, timeout_s: float) -> WorkerFailure | None:
        return _wait(self.poll_failure, timeout_s)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.processes.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.processes.values():
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for conn in self.pipes.values():
            conn.close()


class RayWorkers:
    """Ranks 1 .. N-1 as Ray actors of `RankWorker` (rank 1 first), each running `run()`."""

    POLL_INTERVAL_S = 0.5  # ray.wait costs a round trip to the raylet: don't pay it every step

    def __init__(self, actors: list, run: bool = True):
        self.actors = list(actors)
        self.refs = [a.run.remote() for a in self.actors] if run else []
        self._last_poll = 0.0

    def _check(self, timeout_s: float) -> WorkerFailure | None:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=1, timeout=timeout_s)
        for ref in ready:
            rank = self.refs.index(ref) + 1
            try:
                text = ray.get(ref)
            except ray.exceptions.RayError as exc:
                return WorkerFailure(rank, f"worker actor died: {exc}")
            return WorkerFailure(rank, text or "worker actor left its loop without a shutdown")
        return None

    def poll_failure(self) -> WorkerFailure | None:
        now = time.monotonic()
        if now - self._last_poll < self.POLL_INTERVAL_S:
            return None
        self._last_poll = now
        return self._check(0)

    def wait_failure(self, timeout_s: float) -> WorkerFailure | None:
        return self._check(timeout_s)

    def join(self, timeout_s: float) -> None:
        import ray

        ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
