"""Rank 0's ModelRunner over a group: each call that touches the model tells the other ranks to do the same.

Rank 0 owns scheduling, paging and sampling; the other ranks mirror its runner calls in the same order:

    kv_budget_bytes  KV_BUDGET, then the MIN over ranks (GPUs of one replica may differ in free memory)
    allocate         ALLOCATE (same page counts everywhere: rank 0's page ids index every rank's cache), and
                     ALLOCATE_HOST for the prefix cache's host tier (same slot counts: rank 0's slots)
    host tier        KV_MOVES with the page copies rank 0's block manager decided, before the step that needs
                     them; each rank copies its own heads' pages
    capture          CAPTURE with the buckets: every rank captures the same decode graphs in the same order
                     (the warm-up forwards' collectives pair up, and so do the captured ones on replay);
                     each step then replays the same bucket everywhere, since every rank sees the same step
    execute          STEP with the step's host arrays (STEP_DELTA: only what changed since the last step,
                     for consecutive decode steps of one batch; STEP_CARRY: a step whose batch changed, as the
                     table rows it takes from the last step and those built anew); every rank copies them to its device and
                     runs the forward; the model all-gathers the vocabulary-split logits, so rank 0 samples.
                     A step launched by the engine's lookahead has placeholders among its host input ids
                     (tokens rank 0 has sampled but not read): rank 0 then broadcasts its device ids
    write_kv         IMPORT_KV with the slots, then a scatter: rank r receives the heads it holds
    read_kv          EXPORT_KV with the slots, then a gather of every rank's heads to rank 0

K/V payloads (PrefilledKV) always carry all K/V heads, so a prefill engine and a decode engine need not
share a TP size. With tp = 1 (EP only) every rank holds every head: import broadcasts, export is local.
At world size 1 the scatter and gather run anyway (over one rank), so the single-GPU test covers them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from engine.distributed.wire import (Op, fed_on_device, flatten_kv, pack_slots, pack_step, pack_step_carry,
                                     pack_step_delta, unflatten_kv)
from engine.host_kv_tier import pack_moves
from engine.kv_payload import KVDestination, PrefilledKV
from engine.runner import ModelRunner
from engine.step_arrays import StepArrays, StepInputs
from kernels.attention.kv_rows import pad_rows
from engine.sequence import Sequence


class DistributedRunner(ModelRunner):
    def __init__(self, model, block_size: int, executor, owns_executor: bool, kv_cache_dtype: str = "auto"):
        super().__init__(model, block_size, kv_cache_dtype)
        self.executor = executor
        self.owns_executor = owns_executor
        self.tp_size = model.parallel.tp_size
        self.world_size = executor.spec.world_size
        self._sent: StepArrays | None = None  # the last step the other ranks ran, and its number
        self._sent_number = 0
        self.delta_steps = 0  # steps sent as deltas (STEP_DELTA), for tests and benchmarks
        self.carry_steps = 0  # steps sent as the rows they carry (STEP_CARRY)

    def kv_budget_bytes(self, config) -> int:
        with self.executor.guard("KV budget", self) as channel:
            channel.send(Op.KV_BUDGET)
            budget = torch.tensor([super().kv_budget_bytes(config)], dtype=torch.int64)
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=channel.group)
        return int(budget.item())

    def allocate_kv_cache(self, num_full_pages: int, num_sliding_pages: int) -> None:
        with self.executor.guard("K/V cache allocation", self) as channel:
            channel.send(Op.ALLOCATE, np.array([num_full_pages, num_sliding_pages], dtype=np.int64))
            super().allocate_kv_cache(num_full_pages, num_sliding_pages)

    def allocate_host_kv(self, num_full_slots: int, num_sliding_slots: int) -> None:
        with self.executor.guard("host K/V tier allocation", self) as channel:
            channel.send(Op.ALLOCATE_HOST, np.array([num_full_slots, num_sliding_slots], dtype=np.int64))
            super().allocate_host_kv(num_full_slots, num_sliding_slots)

    def apply_kv_moves(self, batches) -> None:
        with self.executor.guard("host K/V tier copies", self) as channel:
            channel.send(Op.KV_MOVES, pack_moves(batches))
            super().apply_kv_moves(batches)

    def capture_decode_graphs(self, buckets: list[int], logits: bool = True) -> dict[int, float]:
        with self.executor.guard("decode graph capture", self) as channel:
            channel.send(Op.CAPTURE, np.asarray(buckets, dtype=np.int64))
            return super().capture_decode_graphs(buckets, logits)

    def capture_prefill_graphs(self, buckets: list[int]) -> dict[int, float]:
        with self.executor.guard("prefill graph capture", self) as channel:
            channel.send(Op.CAPTURE_PREFILL, np.asarray(buckets, dtype=np.int64))
            return super().capture_prefill_graphs(buckets)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.host is None:
            raise ValueError("a multi-rank step needs the host arrays it was built from: use runner.prepare")
        with self.executor.guard("step", self) as channel:
            delta, carry = self.step_arrays.last_delta, self.step_arrays.last_carry
            number = self._sent_number + 1
            if delta is not None and delta[0] is self._sent:  # the other ranks hold the delta's base
                channel.send(Op.STEP_DELTA, pack_step_delta(inputs.host, delta[1], delta[2], self._sent_number))
                self.delta_steps += 1
            elif carry is not None and carry[0] is self._sent:  # ... or the step the carried rows come from
                channel.send(Op.STEP_CARRY, pack_step_carry(inputs.host, *carry[1:], self._sent_number))
                self.carry_steps += 1
            else:
                channel.send(Op.STEP, pack_step(inputs.host))
            self._sent, self._sent_number = inputs.host, number
            if fed_on_device(inputs.host):  # the lookahead's ids: every rank needs them, only rank 0 has them
                dist.broadcast(inputs.input_ids, src=0, group=self.model.parallel.group)
            return super().execute(inputs)

    # ---- K/V hand-off ---------------------------------------------------------------------------------
    def _rows(self, slots: dict[bool, np.ndarray]) -> list[int]:
        return [len(slots[sliding]) for sliding in self.layer_is_sliding]

    @torch.inference_mode()
    def write_kv(self, seq: Sequence, payload: PrefilledKV) -> None:
        slots, ks, vs, pads = self.import_slots(seq, payload)
        # the ranks receive rows for every slot, the sliding layers' leading zero rows included
        ks, vs = ([pad_rows(t.to(self.device, self.kv_dtype), pad) for t, pad in zip(part, pads)]
                  for part in (ks, vs))
        with self.executor.guard("K/V import", self) as channel:
            channel.send(Op.IMPORT_KV, pack_slots(slots))
            if self.tp_size == 1 and self.world_size > 1:
                mine = flatten_kv(ks, vs)
                dist.broadcast(mine, 0)
            else:
                h = self.kv_heads  # rank r holds heads [r h, (r + 1) h)
                parts = [flatten_kv([k[:, r * h:(r + 1) * h] for k in ks], [v[:, r * h:(r + 1) * h] for v in vs])
                         for r in range(self.world_size)]
                mine = torch.empty_like(parts[0])
                dist.scatter(mine, parts, src=0)
        self.write_kv_slots(slots, *unflatten_kv(mine, self._rows(slots), self.kv_heads, self.head_dim, self.kv_dtype))

    @torch.inference_mode()
    def read_kv(self, seq: Sequence, sliding_start: int, into: KVDestination | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        slots = self.kv_slots(seq, sliding_start, seq.num_computed)
        if self.tp_size == 1 and self.world_size > 1:  # every rank holds every head
            return self.read_kv_slots(slots, into)
        with self.executor.guard("K/V export", self) as channel:
            channel.send(Op.EXPORT_KV, pack_slots(slots))
            flat = flatten_kv(*self.read_kv_slots(slots))
            parts = [torch.empty_like(flat) for _ in range(self.world_size)]
            dist.gather(flat, parts, dst=0)
        per_rank = [unflatten_kv(p, self._rows(slots), self.kv_heads, self.head_dim, self.kv_dtype) for p in parts]
        layers = range(len(self.layer_is_sliding))
        ks = [torch.cat([k[layer] for k, _ in per_rank], dim=1) for layer in layers]  # [tokens, Hkv, Dh]
        vs = [torch.cat([v[layer] for _, v in per_rank], dim=1) for layer in layers]
        outs = into([tuple(t.shape) for t in (*ks, *vs)], self.kv_dtype) if into is not None else None
        if outs is None:
            return ks, vs
        for out, t in zip(outs, (*ks, *vs)):
            out.copy_(t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # someone else's memory: the rows land before we return
        return outs[:len(ks)], outs[len(ks):]

    def close(self) -> None:
        """Drop the model on every rank; with owns_executor also stop the worker processes."""
        super().close()
        try:
            self.executor.unload(self)
        finally:
            if self.owns_executor:
                self.executor.shutdown()
