"""CUDA graphs of the decode step (forward + unembedding) at batch-size buckets.

A decode step launches ~15 kernels per layer (36 layers on 120b): from Python that is ~12 us per
kernel of host time against a few us of device time, so batch-1 decode is launch-bound without
graphs. Here each bucket (1, 2, 4, ... up to the largest batch) is captured once; a step of B
sequences runs in the smallest bucket >= B:

- the attention backend's `plan` runs outside the graph, before every replay: it copies the step's
  page tables, lengths and slots into its fixed decode buffers (kernels/attention/gpu_plan.py);
- the rows B..bucket-1 are padding: length 0 and slot -1, so they read no K/V and write none;
- token ids and positions are copied into static buffers; the graph writes static logits.

Sampling stays outside (engine/sampler.py, no host sync). Nothing here reads a device value back to
the host. With several ranks (engine/distributed) every rank captures the same buckets in the same
order and replays the same bucket each step, so the collectives inside the graphs pair up; a rank that
samples nothing (EP only, rank > 0) captures the forward without the unembedding (logits=False). The backend must be built with `cuda_graph=True` (split counts fixed per batch size) and
keep its decode buffers across `bind_cache` calls of the same cache.

Legend: B = sequences in the step, Bp = its bucket, V = vocabulary.
"""

from __future__ import annotations

import time

import torch

from kernels.attention import AttentionBatch, KVGroupMeta
from model.gpt_oss import GptOssForCausalLM


class CudaGraphError(RuntimeError):
    """Graphs cannot serve this model or step; the message says what to change."""


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ..., 64, then every 32 up to 256, every 64 up to 512, every 128 above, and max_batch itself:
    a batch pads to at most 1.5x its size, and at most 1.25x above 128 (where a 120b step streams every
    expert and the batch is capped by KV memory, so each extra row counts)."""
    if max_batch < 1:
        raise CudaGraphError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 64 else b + (32 if b < 256 else 64 if b < 512 else 128)
    return out + [max_batch]


def _pad_group(meta: KVGroupMeta, pad: int) -> KVGroupMeta:
    if pad == 0:
        return meta
    tables = meta.block_tables
    return KVGroupMeta(
        block_tables=torch.cat([tables, tables.new_zeros(pad, tables.shape[1])]),
        kv_lens=torch.cat([meta.kv_lens, meta.kv_lens.new_zeros(pad)]),
        slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)]),
        kv_lens_cpu=list(meta.kv_lens_cpu) + [0] * pad,
    )


def pad_decode_batch(batch: AttentionBatch, size: int) -> AttentionBatch:
    """`batch` (a decode step) grown to `size` sequences whose extra rows read and write nothing."""
    if not batch.is_decode or not batch.has_cache:
        raise CudaGraphError("only decode steps over a KV cache can be padded into a graph bucket")
    pad = size - batch.num_seqs
    if pad < 0:
        raise CudaGraphError(f"a step of {batch.num_seqs} sequences does not fit a bucket of {size}")
    if pad == 0:  # (its query_start_loc is already 0 .. size: no device arange)
        return batch
    qsl = torch.arange(size + 1, dtype=batch.query_start_loc.dtype, device=batch.query_start_loc.device)
    return AttentionBatch(qsl, [1] * size, _pad_group(batch.full, pad),
                          _pad_group(batch.sliding, pad) if batch.sliding is not None else None, is_decode=True)


def dummy_decode_batch(size: int, block_size: int, device) -> AttentionBatch:
    """A capture-time step: every row sees one token of page 0 and writes nothing (slot -1)."""
    def group() -> KVGroupMeta:
        return KVGroupMeta(torch.zeros(size, 1, dtype=torch.int32, device=device),
                           torch.ones(size, dtype=torch.int32, device=device),
                           torch.full((size,), -1, dtype=torch.int64, device=device), [1] * size)

    return AttentionBatch(torch.arange(size + 1, dtype=torch.int32, device=device), [1] * size, group(), group(),
                          is_decode=True)


class DecodeGraphs:
    """One captured decode forward per bucket, sharing one memory pool."""

    def __init__(self, model: GptOssForCausalLM, buckets: list[int], logits: bool = True):
        if model.device.type != "cuda":
            raise CudaGraphError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        if not getattr(model.backend, "cuda_graph", False):
            raise CudaGraphError("the attention backend must be built with cuda_graph=True (fixed decode splits); "
                                 "use engine.model_factory.build_model(..., cuda_graph=True)")
        self.model = model
        self.with_logits = logits
        self.buckets = sorted(set(buckets))
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=model.device)  # static inputs
        self.positions = torch.zeros(top, dtype=torch.long, device=model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # static outputs [Bp, V] (or [Bp, D]: hidden), model dtype
        self.capture_seconds: dict[int, float] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests, benchmarks)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def serves(self, batch: AttentionBatch) -> bool:
        """Whether `run` takes this step (a decode step that fits a bucket); every rank decides alike."""
        return batch.is_decode and self.bucket_for(batch.num_seqs) is not None

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size])  # [Bp, D]; planned already
        return self.model.compute_logits(hidden) if self.with_logits else hidden  # [Bp, V]

    @torch.inference_mode()
    def capture(self) -> dict[int, float]:
        """Capture every bucket, largest first (later graphs reuse its pool). Needs the KV cache bound.
        Returns seconds per bucket (warm-up forward + capture)."""
        if self.model.backend.kv_cache is None:
            raise CudaGraphError("bind the KV cache (ModelRunner.allocate_kv_cache) before capturing decode graphs")
        block_size = self.model.backend.kv_cache.block_size
        # Plan every bucket first: the backend grows its split scratch on plan, and a growth after a
        # capture would free memory that graph still points to.
        for size in self.buckets:
            self.model.backend.plan(dummy_decode_batch(size, block_size, self.model.device))
        for size in reversed(self.buckets):
            start = time.perf_counter()
            self.model.backend.plan(dummy_decode_batch(size, block_size, self.model.device))
            self._forward(size)  # warm-up: Triton compiles and the allocator sees the shapes outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size)
            torch.cuda.synchronize()
            self.pool = graph.pool()
            self.graphs[size] = graph
            self.capture_seconds[size] = time.perf_counter() - start
        return dict(self.capture_seconds)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> int:
        size = self.bucket_for(batch.num_seqs)
        if size is None:
            raise CudaGraphError(f"a decode step of {batch.num_seqs} sequences exceeds the largest captured "
                                 f"bucket ({self.max_batch}); capture larger buckets or lower max_num_seqs")
        # the token ids and positions go into the graph's inputs with the attention plan's copies (one launch)
        self.model.backend.plan(pad_decode_batch(batch, size), ((input_ids, self.input_ids), (positions, self.positions)))
        return size

    def release(self) -> None:
        """Free every captured graph now (not when the last reference goes): graphs holding NCCL kernels
        must be gone before their communicator is destroyed, or destroy_process_group hangs (seen on 2
        H200s, 2026-11-30, with the graphs still referenced at shutdown)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
        self.pool = None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Logits [B, V] (model dtype, a view of the static output: consume before the next step); the
        hidden states [B, D] instead with logits=False."""
        size = self._stage(input_ids, positions, batch)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][: batch.num_seqs]

    @torch.inference_mode()
    def run_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The same padded step launched kernel by kernel: what `run` must reproduce bit for bit."""
        size = self._stage(input_ids, positions, batch)
        return self._forward(size)[: batch.num_seqs]
