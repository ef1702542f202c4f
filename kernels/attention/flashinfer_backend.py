"""The GPU attention backend: FlashInfer's sink wrapper for prefill, our Triton split-KV kernel for decode.

Per step, `plan(batch)` once:
- decode steps (`batch.is_decode`): copy page tables, lengths and slots into fixed-size device
  buffers (StepBuffers) and pick the split count; nothing else. `forward` then launches only
  kernels that read those buffers (KV write, split decode, merge): no host sync, no allocation
  besides the output, so the engine can capture a step in a CUDA graph and replay it after
  another `plan`. Under `cuda_graph=True` the split count depends on the batch size alone.
- prefill / mixed steps: plan FlashInfer's BatchAttentionWithAttentionSinkWrapper, one per layer
  kind (full: window_left=-1; sliding: window_left=W-1), over CSR page lists built from our tables.
  FlashInfer's plan reads lengths on the host: prefill attention is never graph-captured (the piecewise
  prefill graphs of engine/prefill_graphs.py launch it eagerly between their pieces). Sliding layers over
  the cache run our Triton kernel instead (sliding_prefill_triton.py: it reads only each tile's
  window, where FlashInfer's windowed prefill did ~55 TFLOP/s of useful work), unless
  `sliding_prefill="flashinfer"`. Full layers of a step whose sequences all start at position 0 (no cached
  prefix, no decode rows) attend over the step's own k / v rows instead, through FlashInfer's ragged sink
  prefill (`ragged_full`; the rows are the rotary kernel's outputs, the pages are still written), planned when
  the step reaches its first full layer (`defer_ragged_plan`), so that the GPU is not idle through the plan.
- mixed steps (chunked prefills next to decoding sequences): in full layers the sequences with one new
  token go through the split decode kernel (on gathered query rows), only the others through FlashInfer;
  sliding layers run every sequence through the Triton sliding kernel in place (two launches: prompt
  chunks, one-query rows), without gathering rows. FlashInfer's
  prefill kernel gives a one-token query a whole query tile and was ~2.4x slower end to end on 8k/1k.
- an fp8 cache (kv_cache_dtype "fp8_e4m3"): decode reads it directly (the split kernel converts tiles to
  bf16); for prefill the pages a step attends over are first gathered and converted into bf16 staging
  pages, in the CSR order of the plan, and FlashInfer's bf16 sink kernel runs over those (its fp8-KV
  variants are not among the modules built here). One gather + convert per layer, prefill only.
- steps without a cache (`AttentionBatch.without_cache`): the new K/V are copied into scratch
  pages (each sequence starting on a fresh page) and the same wrappers attend over those. (Viewing
  K/V as pages of one token would avoid the copy, but FlashInfer 0.5.3's fa3 plan leaves its
  token-offset indptr unset for page size 1.)

The pure-torch TorchAttentionBackend is the twin; tests/kernels/test_attention_gpu.py compares them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import flashinfer_ops
from kernels.attention.backend import AttentionBackend
from kernels.attention.decode_triton import DecodeConfig, sink_decode, split_scratch
from kernels.attention.gpu_plan import StepBuffers, decode_num_splits, flashinfer_page_lists
from kernels.attention.kv_cache import PagedKVCache, is_fp8
from kernels.attention.kv_write import write_kv
from kernels.attention.metadata import AttentionBatch
from kernels.attention.plan_fill_triton import fill_decode_buffers
from kernels.attention.sliding_prefill_triton import (SlidingPrefillConfig, SlidingTiles, plan_tiles,
                                                      single_query_config, sliding_prefill)

SCRATCH_PAGE = 16


@dataclass
class MixedSplit:
    """A mixed step's one-token sequences (decode kernel) and the rest (FlashInfer), per layer kind."""

    single_rows: torch.Tensor  # token rows of the one-token sequences
    multi_rows: torch.Tensor  # token rows of the others, in order
    tables: dict[bool, torch.Tensor]  # [S, max_blocks] page tables of the one-token sequences
    kv_lens: dict[bool, torch.Tensor]
    splits: dict[bool, int]


class FlashInferAttentionBackend(AttentionBackend):
    """Sink attention on NVIDIA GPUs over the paged cache of kv_cache.py (NHD pages; bf16 or fp8)."""

    def __init__(
        self,
        layer_is_sliding: list[bool],
        sliding_window: int,
        head_dim: int,
        num_q_heads: int,  # per rank
        num_kv_heads: int,  # per rank
        device: torch.device | str = "cuda",
        max_batch: int = 256,
        max_kv_len: int = 131072,
        prefill_backend: str | None = None,  # "fa3" | "fa2"; default: fa3 on Hopper
        cuda_graph: bool = False,
        decode_config: DecodeConfig | None = None,  # None: default_decode_config
        sliding_prefill: str = "triton",  # sliding layers of prefill steps over the cache: "triton" | "flashinfer"
        sliding_prefill_config: SlidingPrefillConfig | None = None,
    ):
        super().__init__(layer_is_sliding, sliding_window, head_dim)
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} kv heads")
        self.device = torch.device(device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.max_batch, self.max_kv_len = max_batch, max_kv_len
        self.cuda_graph = cuda_graph
        # the model's rotary kernel writes k/v into the cache (kv_destination): one launch less per layer
        self.fuse_kv_write = True
        self.decode_config = decode_config
        if sliding_prefill not in ("triton", "flashinfer"):
            raise ValueError(f"sliding_prefill must be 'triton' or 'flashinfer', got {sliding_prefill!r}")
        self.sliding_prefill = sliding_prefill
        self.sliding_prefill_config = sliding_prefill_config or SlidingPrefillConfig()
        # this prefill step's launches of the Triton sliding kernel: (tiles, launch shape) each
        self.sliding_tiles: list[tuple[SlidingTiles, SlidingPrefillConfig]] | None = None
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.prefill_backend = prefill_backend or flashinfer_ops.default_prefill_backend(self.device)
        self.workspace = flashinfer_ops.new_workspace(self.device)
        kinds = sorted(set(layer_is_sliding))
        self.prefill = {
            sliding: flashinfer_ops.sink_prefill_wrapper(
                self.workspace, sliding_window - 1 if sliding else -1, self.prefill_backend, head_dim)
            for sliding in kinds
        }
        # Full layers of steps whose prompts have no cached prefix: FlashInfer's ragged sink prefill over the
        # step's own k / v rows (the same JIT module; 7-10% faster than the paged kernel on whole prompts, H200,
        # kernels/attention/NOTES.md). False: always the paged kernel, to compare (bench/prefill_ab --variants ragged).
        self.ragged_full = True
        self.full_ragged_wrapper = flashinfer_ops.sink_prefill_ragged_wrapper(
            self.workspace, -1, self.prefill_backend, head_dim) if False in kinds else None
        self.step_ragged = False  # this step's full layers run the ragged kernel
        # Sliding layers of steps whose sequences have no keys before the step's: the Triton sliding kernel reads
        # K/V from the step's own k / v rows instead of the pages (no page-table reads; bf16 even over an fp8
        # cache, as the ragged full layers attend). False: always the pages (bench/prefill_ab --variants
        # sliding-rows compares). Prefill graphs read it when captured: they then keep every layer's k / v rows.
        self.sliding_rows = True
        self.step_sliding_rows = False
        # The ragged plan (FlashInfer's C++ scheduler, ~0.8-1 ms of host time at 4k-8k tokens) made when the step
        # reaches its first full layer instead of in plan(): the GPU then runs the embedding and layer 0 meanwhile
        # instead of idling. False: planned up front (bench/prefill_ab --variants defer-plan compares).
        self.defer_ragged_plan = True
        self._pending_ragged_plan = None
        self._ragged_planned: torch.cuda.Event | None = None
        self.decode_buffers: dict[bool, StepBuffers] = {}
        self.num_splits = {sliding: 1 for sliding in kinds}
        self.part_o, self.part_lse = split_scratch(0, num_q_heads, 1, head_dim, self.device)
        self._retired_scratch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_slots: torch.Tensor | None = None  # no-cache steps: token -> row of the scratch pages
        self.scratch_pages = 0
        self.staged_pages: dict[bool, torch.Tensor] = {}  # fp8 cache, prefill: cache page of each staging page
        self.mixed: MixedSplit | None = None  # this step's one-token sequences, run by the decode kernel
        # FlashInfer's plan writes a pinned host buffer and queues its copy to the device. With the
        # engine's lookahead a plan can come while the previous plan's copy still waits behind GPU
        # work: the next plan first waits for that copy (an event after each plan).
        self._prefill_planned: torch.cuda.Event | None = None

    def bind_cache(self, kv_cache: PagedKVCache | None) -> None:
        # Rebinding the bound cache (the runner does it every step) keeps the decode buffers: captured
        # CUDA graphs (engine/cuda_graphs.py) read them at fixed addresses.
        rebind = kv_cache is not None and kv_cache is self.kv_cache and bool(self.decode_buffers)
        super().bind_cache(kv_cache)
        if kv_cache is None or rebind:
            return
        # Sliding tables are short in decode, but sizing both alike accepts any table width the
        # engine pads to; 256 x 8192 int32 is 8 MB.
        max_blocks = -(-self.max_kv_len // kv_cache.block_size)
        self.decode_buffers = {
            sliding: StepBuffers.allocate(self.max_batch, max_blocks, self.max_batch, self.device)
            for sliding in self.prefill
        }

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, batch: AttentionBatch, rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
        decode = batch.is_decode and batch.has_cache
        super().plan(batch, () if decode else rows)
        self.mixed = None
        self.step_ragged = False
        self.step_sliding_rows = False
        self._pending_ragged_plan = None
        if decode:
            self._plan_decode(batch, rows)
        else:
            self._plan_prefill(batch)

    def _plan_decode(self, batch: AttentionBatch, rows=()) -> None:
        num_seqs = batch.num_seqs
        if batch.num_tokens != num_seqs:
            raise ValueError("a decode batch has exactly one new token per sequence; plan it as prefill instead")
        # one launch for both kinds' tables, lengths and slots (plan_fill_triton; StepBuffers.fill is its twin)
        fill_decode_buffers([(buffers, batch.group(sliding)) for sliding, buffers in self.decode_buffers.items()],
                            num_seqs, rows)
        for sliding, buffers in self.decode_buffers.items():
            meta = batch.group(sliding)
            if sliding:
                longest = self.sliding_window
            else:
                longest = self.max_kv_len if self.cuda_graph else max(meta.kv_lens_cpu)
            self.num_splits[sliding] = decode_num_splits(num_seqs, longest, self.num_kv_heads, self.num_sms)
        rows = num_seqs * self.num_q_heads * max(self.num_splits.values())
        self._grow_split_scratch(rows)

    def _plan_prefill(self, batch: AttentionBatch) -> None:
        lens = batch.query_lens_cpu
        starts = [0]  # each sequence's first row in q, from host lengths (no device read in the plan)
        for n in lens:
            starts.append(starts[-1] + n)
        multi = [b for b, n in enumerate(lens) if n > 1]
        single = [b for b, n in enumerate(lens) if n == 1]
        if batch.has_cache and multi and single:
            self.mixed = self._plan_mixed(batch, single, multi, starts)
            seqs = multi
        else:
            seqs = list(range(len(lens)))
        qo_indptr = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor([lens[b] for b in seqs], dtype=torch.int32), 0)
        if self._prefill_planned is not None:
            self._prefill_planned.synchronize()  # the previous plan's pinned buffer has reached the device
        pick = None if len(seqs) == len(lens) else torch.tensor(seqs, device=self.device)
        self.sliding_tiles = None
        self.step_ragged = self._ragged_eligible(batch, lens)
        if self.step_ragged:
            if self.defer_ragged_plan:
                self._pending_ragged_plan = qo_indptr  # forward() plans at the step's first full layer
            else:
                self._plan_ragged(qo_indptr)
        for sliding, wrapper in self.prefill.items():
            window_left = self.sliding_window - 1 if sliding else -1
            if not sliding and self.step_ragged:
                continue
            if batch.has_cache:
                meta = batch.group(sliding)
                if sliding and self.sliding_prefill == "triton":
                    self.sliding_tiles = self._plan_sliding_tiles(meta, lens, starts, multi, single)
                    self.step_sliding_rows = self.sliding_rows and list(meta.kv_lens_cpu) == list(lens)
                    continue
                page_size = self.kv_cache.block_size
                tables = meta.block_tables if pick is None else meta.block_tables[pick]
                kv_indptr, kv_indices, last_page_len = flashinfer_page_lists(
                    tables, [meta.kv_lens_cpu[b] for b in seqs], page_size)
                if is_fp8(self.kv_cache.k[0].dtype):  # staging page i holds cache page kv_indices[i]
                    self.staged_pages[sliding] = kv_indices.long()
                    kv_indices = torch.arange(len(kv_indices), dtype=torch.int32, device=self.device)
            else:
                page_size = SCRATCH_PAGE
                kv_indptr, kv_indices, last_page_len = self._plan_scratch_pages(batch.query_lens_cpu)
            flashinfer_ops.plan_sink_prefill(
                wrapper, qo_indptr, kv_indptr, kv_indices, last_page_len,
                self.num_q_heads, self.num_kv_heads, self.head_dim, page_size, window_left, self.scale)
        if self.device.type == "cuda":
            self._prefill_planned = torch.cuda.Event()
            self._prefill_planned.record()

    def _plan_ragged(self, qo_indptr: torch.Tensor) -> None:
        """FlashInfer's ragged plan of the step's full layers, after the previous one's pinned copy finished."""
        if self._ragged_planned is not None:
            self._ragged_planned.synchronize()
        flashinfer_ops.plan_sink_prefill_ragged(self.full_ragged_wrapper, qo_indptr, qo_indptr, self.num_q_heads,
                                                self.num_kv_heads, self.head_dim, -1, self.scale)
        if self.device.type == "cuda":
            self._ragged_planned = torch.cuda.Event()
            self._ragged_planned.record()

    def _ragged_eligible(self, batch: AttentionBatch, lens: list[int]) -> bool:
        """Whether this step's full layers can attend over its own k / v rows: a step over the cache (not
        mixed: every sequence has several new tokens) in which no sequence has cached tokens before them."""
        if not (self.ragged_full and self.full_ragged_wrapper is not None and batch.has_cache):
            return False
        full = batch.group(False)
        return all(n > 1 for n in lens) and list(full.kv_lens_cpu) == list(lens)

    def _plan_sliding_tiles(self, meta, lens: list[int], starts: list[int], multi: list[int],
                            single: list[int]) -> list[tuple[SlidingTiles, SlidingPrefillConfig]]:
        """The Triton sliding kernel's launches over the whole step's q and out: prompt chunks in tiles of
        the configured shape, one-query sequences (a mixed step's decode rows) in tiles of 16 rows."""
        group = self.num_q_heads // self.num_kv_heads
        launches = []
        for seqs, config in ((multi, self.sliding_prefill_config), (single, single_query_config(group))):
            if not seqs:
                continue
            pick = None if len(seqs) == len(lens) else torch.tensor(seqs, device=self.device)
            tables = meta.block_tables if pick is None else meta.block_tables[pick]
            kv_lens = meta.kv_lens if pick is None else meta.kv_lens[pick]
            tiles = plan_tiles([lens[b] for b in seqs], tables, kv_lens, config.block_m, [starts[b] for b in seqs])
            launches.append((tiles, config))
        return launches

    def _plan_mixed(self, batch: AttentionBatch, single: list[int], multi: list[int],
                    starts: list[int]) -> "MixedSplit":
        idx = torch.tensor(single, device=self.device)
        split = MixedSplit(
            single_rows=torch.tensor([starts[b] for b in single], device=self.device),
            multi_rows=torch.cat([torch.arange(starts[b], starts[b + 1]) for b in multi]).to(self.device),
            tables={}, kv_lens={}, splits={})
        for sliding in self.prefill:
            if sliding and self.sliding_prefill == "triton":
                continue  # the sliding kernel takes one-query sequences in place (_plan_sliding_tiles)
            meta = batch.group(sliding)
            split.tables[sliding] = meta.block_tables[idx].contiguous()
            split.kv_lens[sliding] = meta.kv_lens[idx].contiguous()
            longest = self.sliding_window if sliding else max(meta.kv_lens_cpu[b] for b in single)
            split.splits[sliding] = decode_num_splits(len(single), longest, self.num_kv_heads, self.num_sms)
        self._grow_split_scratch(len(single) * self.num_q_heads * max(split.splits.values(), default=1))
        return split

    def _grow_split_scratch(self, rows: int) -> None:
        """Split partials for `rows` rows. Grows outside any capture (plan runs before it); the buffers it
        replaces stay referenced, since decode graphs captured earlier keep writing to them."""
        if self.part_lse.numel() < rows:
            self._retired_scratch.append((self.part_o, self.part_lse))
            self.part_o, self.part_lse = split_scratch(rows, 1, 1, self.head_dim, self.device)

    def _plan_scratch_pages(self, lens: list[int]):
        pages = [-(-n // SCRATCH_PAGE) for n in lens]
        first = [0]
        for p in pages:
            first.append(first[-1] + p)
        slots = torch.cat([torch.arange(n) + SCRATCH_PAGE * f for n, f in zip(lens, first)])
        self.scratch_slots = slots.to(self.device, non_blocking=True)
        self.scratch_pages = first[-1]
        table = torch.arange(first[-1], dtype=torch.int32, device=self.device)
        indptr = torch.tensor(first, dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * SCRATCH_PAGE for n, p in zip(lens, pages)], dtype=torch.int32)
        return indptr, table, last

    # -- per layer --------------------------------------------------------------------------------

    def kv_destination(self, layer: int):
        batch = self.batch
        if not self.fuse_kv_write:
            return None
        if self.graph_slots is not None:  # prefill graphs: their fixed slot buffers (base class)
            return super().kv_destination(layer)
        if batch is None or not batch.has_cache:
            return None
        sliding = self.layer_is_sliding[layer]
        slots = self.decode_buffers[sliding].slot_mapping if batch.is_decode else batch.group(sliding).slot_mapping
        return self.kv_cache.k[layer], self.kv_cache.v[layer], slots

    def forward(self, layer, q, k, v, sinks, kv_written=False, out=None):
        batch = self.batch
        sliding = self.layer_is_sliding[layer]
        q = q.contiguous()
        sinks = sinks.float().contiguous()
        out = torch.empty_like(q) if out is None else out
        if not batch.has_cache:
            shape = (self.scratch_pages, SCRATCH_PAGE, self.num_kv_heads, self.head_dim)
            pages_k = torch.zeros(shape, dtype=k.dtype, device=k.device)  # zeros: tails of last pages stay finite
            pages_v = torch.zeros(shape, dtype=v.dtype, device=v.device)
            write_kv(k, v, pages_k, pages_v, self.scratch_slots)
            return flashinfer_ops.run_sink_prefill(self.prefill[sliding], q, pages_k, pages_v, sinks, self.scale, out)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
        if batch.is_decode:
            buffers = self.decode_buffers[sliding]
            if not kv_written:
                write_kv(k, v, k_cache, v_cache, buffers.slot_mapping)
            return sink_decode(
                q, k_cache, v_cache, buffers.block_tables, buffers.kv_lens, sinks, self.scale,
                self.window(layer), self.num_splits[sliding], out, self.part_o, self.part_lse, self.decode_config)
        if not kv_written:
            write_kv(k, v, k_cache, v_cache, batch.group(sliding).slot_mapping)
        if not sliding and self.step_ragged:  # the step's prompts are all of their keys: attend over k / v rows
            if k is None or v is None:
                raise ValueError("this step's full layers attend over the step's k / v rows (no cached prefix): pass "
                                 "them to forward (prefill graphs: their static k / v row buffers)")
            if self._pending_ragged_plan is not None:
                indptr, self._pending_ragged_plan = self._pending_ragged_plan, None
                self._plan_ragged(indptr)
            return flashinfer_ops.run_sink_prefill_ragged(self.full_ragged_wrapper, q, k, v, sinks, self.scale, out)
        if sliding and self.sliding_tiles is not None:  # every sequence of the step, in place: no gathers
            rows = self.step_sliding_rows and k is not None and v is not None  # every key is one of the step's rows
            keys, values = (k, v) if rows else (k_cache, v_cache)
            for tiles, config in self.sliding_tiles:
                sliding_prefill(q, keys, values, sinks, self.scale, self.sliding_window, tiles, out, config, kv_rows=rows)
            return out
        m = self.mixed
        if m is not None:
            one = q[m.single_rows]
            out[m.single_rows] = sink_decode(
                one, k_cache, v_cache, m.tables[sliding], m.kv_lens[sliding], sinks, self.scale, self.window(layer),
                m.splits[sliding], torch.empty_like(one), self.part_o, self.part_lse, self.decode_config)
            q = q[m.multi_rows]
        if is_fp8(k_cache.dtype):
            pages = self.staged_pages[sliding]
            k_cache, v_cache = k_cache[pages].to(q.dtype), v_cache[pages].to(q.dtype)
        got = flashinfer_ops.run_sink_prefill(self.prefill[sliding], q, k_cache, v_cache, sinks, self.scale,
                                              None if m is not None else out)
        if m is not None:
            out[m.multi_rows] = got
        return out
