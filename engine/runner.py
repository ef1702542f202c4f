"""Model execution: step metadata, the paged KV cache, the forward, and K/V import/export by token.

Nothing here decides what runs (the scheduler does) or which token comes next (the sampler does):
with tensor parallelism, rank 0 schedules and every rank runs `prepare` + `execute` on the same
scheduled step. `build_step_arrays` is the one place that turns a scheduled step into the flat batch
and paging metadata of kernels/attention/metadata.py (as host arrays, which rank 0 can send to the
other ranks; `StepArrays.to_inputs` copies them to the device), for the pure-torch backend and the
GPU one alike.

Legend: T = new tokens in the step, B = sequences, N = sequences that sample, V = vocabulary,
P = pages in a table row, Hkv / Dh = K/V heads on this rank / head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.block_manager import cdiv
from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.kv_payload import PrefilledKV
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from kernels.attention import AttentionBatch, KVGroupMeta, PagedKVCache
from model.gpt_oss import GptOssForCausalLM


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attention: AttentionBatch
    logits_indices: torch.Tensor  # int64 [N]: the last token of each sequence that samples
    sample_rows: list[int]  # host: which scheduled entries sample, in logits order
    host: "StepArrays | None" = None  # what these were built from (rank 0 sends it to the other ranks)


@dataclass
class StepArrays:
    """A scheduled step as host arrays, before any device copy. With several ranks, rank 0 sends these
    (engine/distributed/wire.py packs them) and every rank builds identical StepInputs from them."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    full_tables: np.ndarray  # int32 [B, P], padded with page 0
    full_lens: np.ndarray  # int32 [B]
    full_slots: np.ndarray  # int64 [T]
    sliding_tables: np.ndarray  # int32 [B, P]
    sliding_lens: np.ndarray  # int32 [B]
    sliding_slots: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [N]
    sample_rows: list[int]

    def to_inputs(self, device) -> StepInputs:
        query_lens = np.diff(self.query_start_loc).tolist()
        attention = AttentionBatch(
            query_start_loc=_to(device, self.query_start_loc),
            query_lens_cpu=query_lens,
            full=_group_meta(self.full_tables, self.full_lens, self.full_slots, device),
            sliding=_group_meta(self.sliding_tables, self.sliding_lens, self.sliding_slots, device),
            is_decode=all(n == 1 for n in query_lens),
        )
        return StepInputs(_to(device, self.input_ids), _to(device, self.positions), attention,
                          _to(device, self.logits_indices), list(self.sample_rows), self)


def _to(device, array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def _tables(rows: list) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    tables = np.zeros((len(rows), width), dtype=np.int32)  # [B, P], padded with page 0
    for b, row in enumerate(rows):
        if len(row):
            tables[b, : len(row)] = row
    return tables


def _group_meta(tables: np.ndarray, kv_lens: np.ndarray, slots: np.ndarray, device) -> KVGroupMeta:
    return KVGroupMeta(block_tables=_to(device, tables), kv_lens=_to(device, kv_lens),
                       slot_mapping=_to(device, slots), kv_lens_cpu=kv_lens.tolist())


def _chunk_slots(pages, first_page: int, start: int, end: int, bs: int) -> list[int]:
    """Cache slots of positions start .. end - 1 through a table whose entry 0 is logical page first_page."""
    if end - start <= 16:  # decode rows and short chunks: Python ints beat a dozen tiny numpy calls
        return [int(pages[p // bs - first_page]) * bs + p % bs for p in range(start, end)]
    pos = np.arange(start, end, dtype=np.int64)
    return (np.asarray(pages, dtype=np.int64)[pos // bs - first_page] * bs + pos % bs).tolist()


def build_step_arrays(scheduled: list[ScheduledSeq], block_size: int) -> StepArrays:
    """Flat batch + paging metadata for both layer kinds, on the host. Call after the scheduler
    allocated pages.

    Full tables hold every page; sliding tables start at the first live page, and their kv_lens
    count from that page's first position. A kind the model lacks gets tables no layer reads."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    full_rows, sliding_rows, full_slots, sliding_slots = [], [], [], []
    full_lens, sliding_lens, starts, sample_rows, logits_indices = [], [], [0], [], []
    for b, s in enumerate(scheduled):
        seq, start, end = s.seq, s.start, s.end
        ids += seq.token_slice(start, end)
        positions += range(start, end)
        full = seq.full_pages.array()
        full_rows.append(full)
        full_lens.append(end)
        full_slots += _chunk_slots(full, 0, start, end, bs) if len(full) else [0] * (end - start)
        live = seq.sliding_pages
        sliding_rows.append(live if not len(live) else np.fromiter(live, dtype=np.int32, count=len(live)))
        if len(live):
            sliding_lens.append(end - seq.sliding_first * bs)
            sliding_slots += _chunk_slots(sliding_rows[-1], seq.sliding_first, start, end, bs)
        else:
            sliding_lens.append(0)
            sliding_slots += [0] * (end - start)
        starts.append(starts[-1] + end - start)
        if end == seq.num_tokens:  # the chunk reaches the last known token: sample
            sample_rows.append(b)
            logits_indices.append(starts[-1] - 1)
    return StepArrays(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        query_start_loc=np.asarray(starts, dtype=np.int32),
        full_tables=_tables(full_rows),
        full_lens=np.asarray(full_lens, dtype=np.int32),
        full_slots=np.asarray(full_slots, dtype=np.int64),
        sliding_tables=_tables(sliding_rows),
        sliding_lens=np.asarray(sliding_lens, dtype=np.int32),
        sliding_slots=np.asarray(sliding_slots, dtype=np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        sample_rows=sample_rows,
    )


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int, device) -> StepInputs:
    """StepInputs (device tensors) of a scheduled step: build_step_arrays, then one copy per array."""
    return build_step_arrays(scheduled, block_size).to_inputs(device)


def plan_pool_sizes(config: EngineConfig, budget_bytes: int, full_page_bytes: int, sliding_page_bytes: int,
                    sliding_window: int) -> tuple[int, int]:
    """Split a byte budget into (full pages, sliding pages).

    The sliding pool gets what a full batch can hold at its peak: per sequence the live window
    pages plus the chunk's edge page, plus one step's worth of new tokens; the full pool the rest.
    Sliding pages beyond that would never be used."""
    bs = config.block_size
    if not full_page_bytes:
        return 0, budget_bytes // sliding_page_bytes
    sliding = 0
    if sliding_page_bytes:
        sliding = config.max_num_seqs * (cdiv(sliding_window - 1, bs) + 2) + cdiv(config.max_num_batched_tokens, bs)
    full = max(0, budget_bytes - sliding * sliding_page_bytes) // full_page_bytes
    return full, sliding


class ModelRunner:
    """Owns the model shard and its paged KV cache on one device."""

    def __init__(self, model: GptOssForCausalLM, block_size: int):
        self.model = model
        self.block_size = block_size
        self.device = model.device
        config = model.config
        self.layer_is_sliding = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
        attn = model.model.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # this rank's heads
        # Heads of the K/V that read_kv returns and write_kv takes (PrefilledKV): all of them, whatever
        # the TP size, so prefill and decode engines need not share one. Ranks split them in engine/distributed.
        self.payload_kv_heads = attn.num_kv_heads * model.parallel.tp_size
        self.kv_dtype = model.dtype
        self.kv_cache: PagedKVCache | None = None
        self.decode_graphs = None  # engine/cuda_graphs.DecodeGraphs when the engine captured decode steps

    @property
    def has_full(self) -> bool:
        return not all(self.layer_is_sliding)

    @property
    def has_sliding(self) -> bool:
        return any(self.layer_is_sliding)

    def page_bytes(self) -> tuple[int, int]:
        """Bytes of one page id in the full pool and in the sliding pool (K and V over their layers)."""
        n_sliding = sum(self.layer_is_sliding)
        n_full = len(self.layer_is_sliding) - n_sliding
        return tuple(PagedKVCache.bytes_per_block(n, self.kv_heads, self.head_dim, self.block_size, self.kv_dtype)
                     for n in (n_full, n_sliding))

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        if config.kv_cache_bytes is not None:
            return config.kv_cache_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * config.gpu_memory_fraction)
        return DEFAULT_CPU_KV_BYTES

    def allocate_kv_cache(self, num_full_pages: int, num_sliding_pages: int) -> None:
        self.kv_cache = PagedKVCache.allocate(self.layer_is_sliding, num_full_pages, num_sliding_pages,
                                              self.block_size, self.kv_heads, self.head_dim, self.kv_dtype,
                                              self.device)
        self.model.backend.bind_cache(self.kv_cache)

    # ---- the step ---------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        return build_step_inputs(scheduled, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [N, V] (fp32) of the sequences that sample this step."""
        # Rebinding is a pointer swap; it keeps two engines over one model object (tests) apart.
        self.model.backend.bind_cache(self.kv_cache)
        graphs = self.decode_graphs
        if graphs is not None and inputs.attention.is_decode and graphs.bucket_for(inputs.attention.num_seqs):
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.attention)  # [B, V]
            return logits.index_select(0, inputs.logits_indices).float()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention)  # [T, D]
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()

    # ---- K/V by token, for the prefill -> decode hand-off -----------------------------------------
    # With several ranks, rank 0 computes the slots (it owns the page tables) and every rank reads or
    # writes its own heads at them: see engine/distributed/runner.py.
    def kv_slots(self, seq: Sequence, sliding_start: int, end: int) -> dict[bool, np.ndarray]:
        """Cache slots (int64) of positions 0 (full layers) or sliding_start (sliding layers) to end - 1,
        keyed by `is_sliding`; only the kinds this model has."""
        bs = self.block_size
        out = {}
        for sliding in set(self.layer_is_sliding):
            pos = np.arange(sliding_start if sliding else 0, end, dtype=np.int64)
            if sliding:
                pages = np.fromiter(seq.sliding_pages, dtype=np.int64, count=len(seq.sliding_pages))
                out[sliding] = pages[pos // bs - seq.sliding_first] * bs + pos % bs
            else:
                out[sliding] = seq.full_pages.array()[pos // bs].astype(np.int64) * bs + pos % bs
        return out

    @torch.inference_mode()
    def read_kv_slots(self, slots: dict[bool, np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V [len(slots), Hkv, Dh] at the slots of the layer's kind."""
        index = {s: _to(self.device, a) for s, a in slots.items()}
        ks, vs = [], []
        for layer, sliding in enumerate(self.layer_is_sliding):
            kc, vc = self.kv_cache.k[layer], self.kv_cache.v[layer]
            ks.append(kc.view(-1, *kc.shape[2:]).index_select(0, index[sliding]))
            vs.append(vc.view(-1, *vc.shape[2:]).index_select(0, index[sliding]))
        return ks, vs

    @torch.inference_mode()
    def write_kv_slots(self, slots: dict[bool, np.ndarray], ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Write per layer K and V [len(slots), Hkv, Dh] at the slots of the layer's kind."""
        index = {s: _to(self.device, a) for s, a in slots.items()}
        for layer, sliding in enumerate(self.layer_is_sliding):
            kc, vc = self.kv_cache.k[layer], self.kv_cache.v[layer]
            kc.view(-1, *kc.shape[2:]).index_copy_(0, index[sliding], ks[layer].to(self.device, kc.dtype))
            vc.view(-1, *vc.shape[2:]).index_copy_(0, index[sliding], vs[layer].to(self.device, vc.dtype))

    def read_kv(self, seq: Sequence, sliding_start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V [tokens, Hkv, Dh] of positions 0 (full) or sliding_start (sliding) to num_computed."""
        return self.read_kv_slots(self.kv_slots(seq, sliding_start, seq.num_computed))

    def import_slots(self, seq: Sequence, payload: PrefilledKV) -> tuple[dict[bool, np.ndarray], list, list]:
        """Where imported K/V goes in the pages the scheduler gave `seq`, and the K/V padded to match."""
        # The first live sliding page also holds positions before sliding_start, which the window masks
        # out; they are written as zeros because a masked key still meets its value in 0 * V (NaN stays NaN).
        page_start = seq.sliding_first * self.block_size
        pad = payload.sliding_start - page_start
        ks, vs = list(payload.k), list(payload.v)
        if pad:
            for layer, sliding in enumerate(self.layer_is_sliding):
                if sliding:
                    ks[layer] = torch.cat([ks[layer].new_zeros(pad, *ks[layer].shape[1:]), ks[layer]])
                    vs[layer] = torch.cat([vs[layer].new_zeros(pad, *vs[layer].shape[1:]), vs[layer]])
        return self.kv_slots(seq, page_start, payload.num_cached), ks, vs

    def write_kv(self, seq: Sequence, payload: PrefilledKV) -> None:
        """Write imported K/V into the pages the scheduler gave `seq`."""
        self.write_kv_slots(*self.import_slots(seq, payload))

    def close(self) -> None:
        """Release the K/V cache (one rank: nothing else to stop; engine/distributed adds its workers)."""
        self.kv_cache = None
