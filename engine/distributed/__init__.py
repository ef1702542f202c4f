"""One model instance over several processes (tensor and expert parallelism): see README.md here."""

from engine.distributed.executor import Executor, ExecutorStateError, check_parallel, launch_engine, local_group
from engine.distributed.handles import WorkerFailedError, WorkerFailure
from engine.distributed.worker import GroupSpec, RankWorker

__all__ = ["Executor", "ExecutorStateError", "GroupSpec", "RankWorker", "WorkerFailedError", "WorkerFailure",
           "check_parallel", "launch_engine", "local_group"]
