"""Ranks 1 .. N-1 of a model instance: join the group, then do what rank 0 says until it says stop.

A worker holds its shard of the model (heads, vocabulary rows, experts) and its own paged K/V cache
(its heads only). It never schedules or samples: every step arrives from rank 0 as host arrays, from
which it builds the same StepInputs rank 0 built, then runs the same forward (the all-reduces inside the
model pair up across ranks). The same class runs in a spawned process (tests, benchmarks, the CLI) and
as a Ray actor in a replica's placement group (serving).

Failures: a worker that raises reports the traceback (a pipe to rank 0, or the return value of `run`
for a Ray actor) and then tears its process groups down, so that rank 0, which may be waiting inside a
collective for it, gets a connection error at once instead of hanging; rank 0 then raises
WorkerFailedError with this text.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.wire import (ControlChannel, Op, apply_step_carry, apply_step_delta, fed_on_device,
                                     flatten_kv, kv_wire_bytes, unflatten_kv, unpack_slots, unpack_step)
from engine.host_kv_tier import unpack_moves

log = logging.getLogger(__name__)

# NVLink SHARP / multicast stays off in every rank: it is unavailable or unreliable on the lent H200
# machines (see the device notes), and NCCL falls back to plain NVLink rings without it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Control messages wait as long as the engine idles between requests; a dead peer still fails them
# at once (its sockets close).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class GroupSpec:
    """How the ranks of one model instance find each other and which device each uses."""

    world_size: int
    init_method: str  # tcp://HOST:PORT served by rank 0
    device: str = "cpu"  # "cpu", or "cuda[:K]": rank r uses cuda:K+r
    timeout_s: float = 600.0  # model collectives (and the rendezvous): a rank this late is considered dead

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def device_of(self, rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        base = torch.device(self.device).index or 0
        return torch.device("cuda", base + rank)


@dataclass(frozen=True)
class LoadSpec:
    """What LOAD carries: every rank loads its shard of `folder` with these settings; with folder None,
    random weights of `model`'s shapes drawn from `seed` (engine/model_factory.random_for_engine)."""

    folder: str | None
    config: EngineConfig
    model: Any = None  # GptOssConfig, for random weights
    seed: int = 0


def wants_symm_mem(mode: str, world: int, device: torch.device) -> bool:
    """Whether this rank sets up the symmetric-memory all-reduce. "auto" decides from what every rank of a
    node sees alike (so all of them enter the collective set-up or none): CUDA, at least `world` visible
    GPUs, and peer access from this one to each other (NVLink / P2P). A rank narrowed to its own GPU (Ray's
    default CUDA_VISIBLE_DEVICES) cannot map the others' memory."""
    if mode == "nccl" or world == 1 or device.type != "cuda":
        return False
    if mode == "symm_mem":
        return True
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return count >= world and all(torch.cuda.can_device_access_peer(index, j) for j in range(count) if j != index)


def load_shard(spec: LoadSpec, rank: int, device: torch.device, progress: bool = False):
    """This rank's part of the model (its heads, vocabulary rows and experts; only those bytes are read),
    with the kernels the config picks for the device."""
    from dataclasses import replace

    from engine.model_factory import load_for_engine, random_for_engine
    from model.parallel import Parallel

    c = replace(spec.config, device=str(device))  # every rank builds for its own device (rank 0's config names rank 0's)
    parallel = Parallel(tp_size=c.tp_size, ep_size=c.ep_size, rank=rank)
    if wants_symm_mem(c.all_reduce, parallel.world_size, device):  # collective: every rank builds it here
        from kernels.comm import SymmMemAllReduce, SymmMemUnavailableError

        dtype = {"float32": torch.float32, "float16": torch.float16}.get(c.dtype, torch.bfloat16)
        try:
            parallel = replace(parallel, fast_all_reduce=SymmMemAllReduce(device, dtype))
        except SymmMemUnavailableError as err:
            if c.all_reduce == "symm_mem":
                raise
            log.warning("rank %d: all_reduce=auto falls back to NCCL: %s", rank, err)
    if spec.folder is None:
        return random_for_engine(spec.model, c, parallel, spec.seed)
    return load_for_engine(spec.folder, c, parallel, progress)


def join_group(spec: GroupSpec, rank: int, device: torch.device) -> ControlChannel:
    """Initialize torch.distributed for this rank (NCCL or gloo for the model, gloo for control)."""
    os.environ.update(NCCL_ENV)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ControlChannel(control, rank)


def leave_group(channel: ControlChannel | None, drain: bool = True) -> None:
    """Destroy this rank's groups (closing their sockets, which wakes peers blocked on this rank).
    Captured decode graphs must be released first (ModelRunner.close): they hold NCCL work of the default
    group. drain: the group is healthy; let the device finish first. Not after a failure: a collective
    whose peer is gone would never finish."""
    if not dist.is_initialized():
        return
    if drain and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if channel is not None:
        dist.destroy_process_group(channel.group)
    dist.destroy_process_group()


def cpu_threads_per_rank(world_size: int) -> int:
    """CPU ranks share the host's cores: without a cap, N ranks of torch's default pool thrash."""
    return max(1, (os.cpu_count() or 1) // world_size)


class RankWorker:
    """Rank r >= 1. As a Ray actor: `ray.remote(RankWorker)`, started with `(rank, spec, device)` by
    serve_app.placement.start_rank_workers; then call `run.remote()` once and keep its ObjectRef.

    device: a torch device string, a zero-argument callable returning one (evaluated inside the worker,
    e.g. serve_app.placement.local_cuda_device for a Ray actor that sees only its own GPU), or None for
    the spec's numbering (cuda:K+rank)."""

    def __init__(self, rank: int, spec: GroupSpec, device: str | Callable[[], str] | None = None):
        if rank < 1:
            raise ValueError(f"RankWorker serves ranks 1..N-1; rank 0 is the engine process (got rank {rank})")
        self.rank = rank
        self.spec = spec
        self._device = device
        self.runner = None
        self._last_step, self._last_number = None, 0  # the step this rank ran last (STEP_DELTA applies to it)

    def run(self, report: Callable[[str], None] | None = None) -> str | None:
        """Serve until SHUTDOWN. Returns None after a clean shutdown, or the error text after a failure
        (also passed to `report` first, for a process whose return value nobody reads)."""
        channel, failed = None, False
        try:
            device = self._device() if callable(self._device) else self._device
            device = torch.device(device) if device is not None else self.spec.device_of(self.rank)
            if device.type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(self.spec.world_size))
            channel = join_group(self.spec, self.rank, device)
            self._serve(channel, device)
            return None
        except Exception:  # any failure ends this rank; rank 0 turns the text into WorkerFailedError
            failed = True
            text = f"rank {self.rank} (pid {os.getpid()}): {traceback.format_exc()}"
            if report is not None:
                report(text)
            return text
        finally:
            if self.runner is not None:
                self.runner.close()
            self.runner = None
            leave_group(channel, drain=not failed)

    # ---- the command loop ---------------------------------------------------------------------------
    def _serve(self, channel: ControlChannel, device: torch.device) -> None:
        while True:
            op, payload = channel.recv()
            if op is Op.SHUTDOWN:
                return
            if op is Op.LOAD:
                self._load(payload, device)
            elif op is Op.UNLOAD:
                if self.runner is not None:
                    self.runner.close()  # the K/V cache and the decode graphs, at once
                self.runner = None
                gc.collect()  # the model, its cache and its decode graphs, cycles included
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            elif op is Op.KV_BUDGET:
                budget = torch.tensor([self.runner.kv_budget_bytes(self.config)], dtype=torch.int64)
                dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=channel.group)
            elif op is Op.ALLOCATE:
                self.runner.allocate_kv_cache(int(payload[0]), int(payload[1]))
            elif op is Op.ALLOCATE_HOST:
                self.runner.allocate_host_kv(int(payload[0]), int(payload[1]))
            elif op is Op.KV_MOVES:
                self.runner.apply_kv_moves(unpack_moves(payload))
            elif op is Op.CAPTURE:  # rank 0 samples; with the vocabulary not split nobody else needs logits
                self.runner.capture_decode_graphs([int(b) for b in payload],
                                                  logits=self.runner.model.parallel.tp_size > 1)
            elif op is Op.CAPTURE_PREFILL:  # same buckets, same order as rank 0: the collectives pair up
                self.runner.capture_prefill_graphs([int(b) for b in payload])
            elif op is Op.STEP:
                self._last_step, self._last_number = unpack_step(payload), self._last_number + 1
                self._step(self._last_step)
            elif op in (Op.STEP_DELTA, Op.STEP_CARRY):
                apply = apply_step_delta if op is Op.STEP_DELTA else apply_step_carry
                self._last_step = apply(self._last_step, self._last_number, payload)
                self._last_number += 1
                self._step(self._last_step)
            elif op is Op.IMPORT_KV:
                self._import_kv(unpack_slots(payload))
            elif op is Op.EXPORT_KV:
                self._export_kv(unpack_slots(payload))
            else:
                raise ValueError(f"unknown control opcode {op!r}")

    def _load(self, spec: LoadSpec, device: torch.device) -> None:
        from engine.runner import ModelRunner

        self.runner = None  # free the previous model first
        self.config = spec.config
        self._last_step, self._last_number = None, 0  # a new engine numbers its steps from 1
        self.runner = ModelRunner(load_shard(spec, self.rank, device), spec.config.block_size, spec.config.kv_cache_dtype)

    @torch.inference_mode()
    def _step(self, arrays) -> None:
        runner = self.runner
        inputs = arrays.to_inputs(runner.device)
        if fed_on_device(arrays):  # rank 0's lookahead: its device ids replace our placeholders
            dist.broadcast(inputs.input_ids, src=0, group=runner.model.parallel.group)
        if runner.model.parallel.tp_size == 1:
            # Vocabulary not split: no all-gather to take part in, and rank 0 alone samples.
            runner.model.backend.bind_cache(runner.kv_cache)
            graphs, pieces = runner.decode_graphs, runner.prefill_graphs  # rank 0 decides alike (ModelRunner.execute)
            if graphs is not None and graphs.serves(inputs.attention):
                graphs.run(inputs.input_ids, inputs.positions, inputs.attention)
            elif pieces is not None and pieces.serves(inputs.attention):
                pieces.run(inputs.input_ids, inputs.positions, inputs.attention)
            else:
                runner.model(inputs.input_ids, inputs.positions, inputs.attention)
        else:
            runner.execute(inputs)

    def _rows(self, slots) -> list[int]:
        return [len(slots[sliding]) for sliding in self.runner.layer_is_sliding]

    def _import_kv(self, slots) -> None:
        r = self.runner
        rows = self._rows(slots)
        flat = torch.empty(kv_wire_bytes(rows, r.kv_heads, r.head_dim, r.kv_dtype), dtype=torch.uint8, device=r.device)
        if r.model.parallel.tp_size == 1:  # EP only (a worker means world > 1): every rank holds every head
            dist.broadcast(flat, 0)
        else:
            dist.scatter(flat, None, src=0)
        ks, vs = unflatten_kv(flat, rows, r.kv_heads, r.head_dim, r.kv_dtype)
        r.write_kv_slots(slots, ks, vs)

    def _export_kv(self, slots) -> None:
        ks, vs = self.runner.read_kv_slots(slots)
        dist.gather(flatten_kv(ks, vs), None, dst=0)


def process_main(rank: int, spec: GroupSpec, conn) -> None:
    """Body of a spawned worker process: run, report a failure through `conn`, exit non-zero on failure."""
    import threading
    import time

    parent = os.getppid()

    def exit_with_parent() -> None:
        # A worker still loading when rank 0 dies would otherwise live on (it is in no collective yet).
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    def report(text: str) -> None:
        try:
            conn.send(text)
        except OSError:  # rank 0 is gone (that is likely what failed): nobody left to tell
            pass

    threading.Thread(target=exit_with_parent, daemon=True, name="exit-with-parent").start()
    error = RankWorker(rank, spec).run(report=report)
    conn.close()
    if error is not None:
        raise SystemExit(1)
