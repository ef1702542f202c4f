"""Rank 0 of a model group: the process group, the control channel, and the other ranks' handles.

    engine = LLMEngine.from_checkpoint(folder, EngineConfig(tp_size=2, ...))   # spawns rank 1
    ...
    engine.close()                                                            # stops it

or, to keep the worker processes across several engines (tests: one spawn per world size):

    executor = Executor.spawn(world_size=4)
    engine = executor.start_engine(folder, EngineConfig(tp_size=4, ep_size=4))
    engine.close()                         # unloads the model on every rank; the processes stay
    executor.shutdown()

torch.distributed keeps one default group per process, so a process is rank 0 of one Executor at a time.
Any error in a collective, in a worker, or in rank 0 while the other ranks wait for it leaves the
ranks out of step: the executor is then broken, its workers are stopped, and every later call raises
WorkerFailedError.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
from pathlib import Path

import torch

from engine.config import EngineConfig, EngineConfigError
from engine.distributed.handles import ProcessWorkers, RayWorkers, WorkerFailedError, WorkerFailure, WorkerSet
from engine.distributed.wire import ControlChannel, Op
from engine.distributed.worker import GroupSpec, LoadSpec, cpu_threads_per_rank, join_group, leave_group, load_shard


class ExecutorStateError(RuntimeError):
    """The executor was used after shutdown, or a second one was started in the same process."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_group(world_size: int, device: str = "cpu", host: str = "127.0.0.1", timeout_s: float = 600.0) -> GroupSpec:
    """A GroupSpec whose rendezvous is a free port of `host` (rank 0's address, reachable by every rank)."""
    return GroupSpec(world_size, f"tcp://{host}:{free_port(host)}", device, timeout_s)


def check_parallel(config: EngineConfig, model_config) -> None:
    """Start-up checks of tp/ep against the model and the visible devices; the message names the numbers."""
    from model.parallel import Parallel, ParallelConfigError

    mc = model_config
    try:
        Parallel(tp_size=config.tp_size, ep_size=config.ep_size).validate(
            mc.num_attention_heads, mc.num_key_value_heads, mc.num_local_experts, mc.vocab_size)
    except ParallelConfigError as err:
        raise EngineConfigError(f"tp_size={config.tp_size}, ep_size={config.ep_size} do not fit the model: {err}") \
            from None
    check_devices(config.world_size, config.device)


def check_devices(world_size: int, device: str) -> None:
    """The CUDA devices `world_size` ranks from `device` take are visible (rank r runs on the r-th after it)."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise EngineConfigError(f"device {device!r}: no CUDA device is visible to this torch ({torch.__version__}, "
                                f"CUDA {torch.version.cuda or 'none: a CPU build'}); run with device 'cpu'")
    base = torch.device(device).index or 0
    if base + world_size > count:
        raise EngineConfigError(
            f"{world_size} ranks from {device} need cuda:{base}..cuda:{base + world_size - 1}, one GPU per rank, "
            f"but {count} CUDA device(s) are visible: lower tp_size/ep_size or pick another device")


class Executor:
    _active: "Executor | None" = None

    def __init__(self, spec: GroupSpec, workers: WorkerSet):
        """Join the group as rank 0; `workers` are ranks 1 .. N-1, already started with `spec`."""
        if Executor._active is not None:
            workers.kill()
            raise ExecutorStateError("this process is already rank 0 of a model group: shut that executor down "
                                     "first (torch.distributed has one default group per process)")
        self.spec = spec
        self.workers = workers
        self.device = spec.device_of(0)
        self.failure: WorkerFailure | None = None
        self.closed = False
        self.loaded = None  # the DistributedRunner whose model the workers hold
        self.channel: ControlChannel | None = None
        self._threads_before = torch.get_num_threads()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the joining thread sets it too
        else:  # measured on 2 cores, world 4: 4-5x slower steps with torch's default threads on rank 0
            torch.set_num_threads(cpu_threads_per_rank(spec.world_size))
        try:
            self.channel = self._join()
        except BaseException:
            torch.set_num_threads(self._threads_before)
            raise
        Executor._active = self
        atexit.register(self.shutdown)

    @classmethod
    def spawn(cls, world_size: int, device: str = "cpu", timeout_s: float = 600.0) -> "Executor":
        """This process is rank 0; ranks 1 .. world_size - 1 are new processes on this host."""
        check_devices(world_size, device)
        spec = local_group(world_size, device, timeout_s=timeout_s)
        return cls(spec, ProcessWorkers.spawn(spec))

    @classmethod
    def over_ray_actors(cls, spec: GroupSpec, actors: list) -> "Executor":
        """This process (a Serve replica) is rank 0; `actors` are RankWorker actors for ranks 1 .. N-1,
        constructed with the same `spec` (see engine/distributed/README.md)."""
        if len(actors) != spec.world_size - 1:
            RayWorkers(actors, run=False).kill()  # they would wait for the rendezvous until its timeout
            raise EngineConfigError(f"{len(actors)} worker actors for a group of {spec.world_size} ranks; "
                                    f"start one per rank 1..{spec.world_size - 1}")
        return cls(spec, RayWorkers(actors))

    def _join(self) -> ControlChannel:
        """join_group as rank 0, in a thread, so that a worker that dies before the rendezvous (bad
        import, bad device) fails start-up at once instead of after the rendezvous timeout."""
        result: dict = {}

        def join() -> None:
            try:
                result["channel"] = join_group(self.spec, 0, self.device)
            except Exception as exc:  # handed to the calling thread below
                result["error"] = exc

        thread = threading.Thread(target=join, name="gptoss-rank0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            failure = self.workers.poll_failure() if thread.is_alive() else None
            if failure is not None:
                self.workers.kill()
                raise WorkerFailedError(failure)
        if "error" in result:
            self.workers.kill()
            raise WorkerFailedError(self.workers.wait_failure(2.0) or WorkerFailure(
                0, f"rank 0 could not join the group at {self.spec.init_method}: {result['error']!r}"))
        return result["channel"]

    # ---- guarded use -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise WorkerFailedError if a rank failed (now or before); cheap enough for every step."""
        if self.closed:
            raise ExecutorStateError("the executor is shut down: start a new engine")
        if self.failure is None:
            failure = self.workers.poll_failure()
            if failure is not None:
                self._break(failure)
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    @contextlib.contextmanager
    def guard(self, what: str, runner=None):
        """Run one distributed operation; any error in it breaks the executor (the ranks are out of step).
        runner: the engine's runner, which must still be the one loaded on the workers."""
        self.check()
        if runner is not None and runner is not self.loaded:
            raise ExecutorStateError(f"{what}: this engine was closed or replaced by a newer start_engine on the "
                                     "same executor; its model is no longer loaded on the other ranks")
        try:
            yield self.channel
        except Exception as exc:
            failure = self.workers.wait_failure(5.0) or WorkerFailure(
                0, f"{what} failed on rank 0 while the other ranks took part: {exc!r}")
            self._break(failure)
            raise WorkerFailedError(failure) from exc

    def _break(self, failure: WorkerFailure) -> None:
        self.failure = failure
        self.workers.kill()

    # ---- engines -----------------------------------------------------------------------------------
    def start_engine(self, folder: str | Path | None, config: EngineConfig, progress: bool = False,
                     owns_executor: bool = False, model=None, seed: int = 0):
        """Load `folder` on every rank (each reads only its shard) and return rank 0's LLMEngine.
        folder None: random weights of `model` (a GptOssConfig) drawn from `seed` on every rank.
        owns_executor: the engine's close() also shuts this executor down."""
        from engine.distributed.runner import DistributedRunner
        from engine.llm_engine import LLMEngine
        from model.loader import read_config

        if config.world_size != self.spec.world_size:
            raise EngineConfigError(f"tp_size={config.tp_size}, ep_size={config.ep_size} needs {config.world_size} "
                                    f"ranks; this executor has {self.spec.world_size}")
        if GroupSpec(1, "", config.device).device_of(0) != self.device:
            raise EngineConfigError(f"config.device={config.device!r} but this executor's rank 0 runs on "
                                    f"{self.device}")
        if (folder is None) == (model is None):
            raise EngineConfigError("give exactly one weight source: a checkpoint folder or model= (random weights)")
        check_parallel(config, model if folder is None else read_config(folder))
        spec = LoadSpec(None if folder is None else str(folder), config, model, seed)
        with self.guard("load") as channel:
            channel.send(Op.LOAD, spec)
        try:
            model = load_shard(spec, 0, self.device, progress)
        except Exception as exc:  # e.g. CheckpointError: the caller sees it as is; the workers are stopped
            self._break(self.workers.wait_failure(1.0) or WorkerFailure(0, f"rank 0 could not load: {exc!r}"))
            raise
        runner = self.loaded = DistributedRunner(model, config.block_size, self, owns_executor, config.kv_cache_dtype)
        try:
            return LLMEngine(model, config, runner=runner)
        except BaseException:
            runner.close()
            raise

    def unload(self, runner) -> None:
        """Drop `runner`'s model on ranks 1 .. N-1 (rank 0's runner drops its own); a no-op if another
        engine has been loaded since."""
        if not self.closed and self.failure is None and runner is self.loaded:
            with self.guard("unload") as channel:
                channel.send(Op.UNLOAD)
            self.loaded = None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (cleanly when they are healthy, else by kill) and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        try:
            if self.failure is None and self.channel is not None:
                with contextlib.suppress(RuntimeError):  # a worker that died meanwhile: killed below
                    self.channel.send(Op.SHUTDOWN)
            self.workers.join(timeout_s)
        finally:
            graphs = self.loaded.decode_graphs if self.loaded is not None else None
            if graphs is not None:  # an engine not closed first: its graphs must go before the group
                graphs.release()
            leave_group(self.channel, drain=self.failure is None)
            torch.set_num_threads(self._threads_before)
            if Executor._active is self:
                Executor._active = None


def launch_engine(folder: str | Path | None, config: EngineConfig, progress: bool = False, model=None, seed: int = 0):
    """An LLMEngine over config.world_size ranks: this process is rank 0, the others are spawned here;
    engine.close() stops them. Configuration errors surface before any process starts. folder None:
    random weights of `model` (a GptOssConfig), see Executor.start_engine."""
    from model.loader import read_config

    check_parallel(config, model if folder is None else read_config(folder))
    executor = Executor.spawn(config.world_size, config.device)
    try:
        return executor.start_engine(folder, config, progress, owns_executor=True, model=model, seed=seed)
    except BaseException:
        executor.shutdown()
        raise
