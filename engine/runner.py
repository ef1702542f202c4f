"""Model execution: the paged KV cache, the forward, and K/V import/export by token.

Nothing here decides what runs (the scheduler does) or which token comes next (the sampler does):
with tensor parallelism, rank 0 schedules and every rank runs `prepare` + `execute` on the same
scheduled step. The step's metadata comes from engine/step_arrays.py.

Legend: T = new tokens in the step, B = sequences, N = sequences that sample, V = vocabulary,
Hkv / Dh = K/V heads on this rank / head dim.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from engine.page_pool import cdiv
from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.kv_payload import KVDestination, PrefilledKV
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.step_arrays import StepArrayBuilder, StepInputs, to_device
from kernels.attention import PagedKVCache
from kernels.attention.kv_cache import resolve_kv_dtype
from kernels.attention.kv_pages import copy_pages
from kernels.attention.kv_rows import empty_rows, gather_rows, scatter_rows
from model.gpt_oss import GptOssForCausalLM


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


def device_current(device: torch.device):
    """A context with `device` the current CUDA device (nothing for other devices). Triton launches on the
    current device and torch's "cuda" means it: an engine on cuda:1 stepped from a thread where cuda:0 is
    current failed "Pointer argument cannot be accessed from Triton" (2x H200, 2026-12-01)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_runner_device(method):
    """Decorator for methods of objects with a `runner`: the runner's device is current while they run."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with device_current(self.runner.device):
            return method(self, *args, **kwargs)
    return run


class ModelRunner:
    """Owns the model shard and its paged KV cache on one device."""

    def __init__(self, model: GptOssForCausalLM, block_size: int, kv_cache_dtype: str = "auto"):
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
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.dtype)
        self.kv_cache: PagedKVCache | None = None
        self.host_kv: PagedKVCache | None = None  # the prefix cache's host tier (allocate_host_kv), if any
        self.decode_graphs = None  # engine/cuda_graphs.DecodeGraphs when the engine captured decode steps
        self.triton_precompile_report: dict | None = None  # engine/triton_precompile.py, where a manifest applied
        self.prefill_graphs = None  # engine/prefill_graphs.PrefillGraphs: other steps, piecewise
        self.last_path = "eager"  # how execute ran the last step: "decode_graph", "prefill_graph" or "eager"
        self.step_arrays = StepArrayBuilder(block_size)

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
        """The K/V pools' bytes: config.kv_cache_bytes, else on CUDA `gpu_memory_fraction` of the free memory
        but no more than leaves room for the engine's largest step (engine/memory_budget.py)."""
        if config.kv_cache_bytes is not None:
            return config.kv_cache_bytes
        if self.device.type == "cuda":
            from engine.memory_budget import activation_bytes, kv_budget_bytes

            free, _ = torch.cuda.mem_get_info(self.device)
            parallel = self.model.parallel
            need = activation_bytes(self.model.config, config.max_num_batched_tokens, config.max_num_seqs,
                                    parallel.tp_size, self.model.config.num_local_experts // parallel.ep_size)
            return kv_budget_bytes(free, config.gpu_memory_fraction, need)
        return DEFAULT_CPU_KV_BYTES

    def allocate_kv_cache(self, num_full_pages: int, num_sliding_pages: int) -> None:
        self.kv_cache = PagedKVCache.allocate(self.layer_is_sliding, num_full_pages, num_sliding_pages,
                                              self.block_size, self.kv_heads, self.head_dim, self.kv_dtype,
                                              self.device)
        self.model.backend.bind_cache(self.kv_cache)

    def allocate_host_kv(self, num_full_slots: int, num_sliding_slots: int) -> None:
        """The host tier's storage (engine/host_kv_tier.py): that many pages of each kind, laid out as the GPU
        cache, in pinned memory when the cache is on a GPU (the copy kernel addresses it directly)."""
        self.host_kv = PagedKVCache.allocate(self.layer_is_sliding, num_full_slots, num_sliding_slots,
                                             self.block_size, self.kv_heads, self.head_dim, self.kv_dtype, "cpu",
                                             pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def apply_kv_moves(self, batches: list[tuple[str, bool, list[int], list[int]]]) -> None:
        """Perform the block manager's page copies (kind, to_host, GPU pages, host slots), in order, on the
        current stream: one launch per batch on GPUs (kernels/attention/kv_pages.py)."""
        for kind, to_host, pages, slots in batches:
            layers = [i for i, s in enumerate(self.layer_is_sliding) if s == (kind == "sliding")]
            device = [self.kv_cache.k[i] for i in layers] + [self.kv_cache.v[i] for i in layers]
            host = [self.host_kv.k[i] for i in layers] + [self.host_kv.v[i] for i in layers]
            if to_host:
                copy_pages(device, pages, host, slots)
            else:
                copy_pages(host, slots, device, pages)

    def capture_graphs(self, config: EngineConfig) -> tuple[dict[int, float], dict[int, float]]:
        """The CUDA graphs `config` asks for: decode steps at batch buckets up to max_num_seqs, prefill and
        mixed steps at token buckets up to max_num_batched_tokens. Seconds per bucket of each."""
        from engine.cuda_graphs import default_buckets
        from engine.prefill_graphs import default_token_buckets

        self._await_precompile()
        decode = self.capture_decode_graphs(default_buckets(config.max_num_seqs)) if config.cuda_graphs else {}
        prefill = {}
        if config.uses_prefill_graphs:
            prefill = self.capture_prefill_graphs(default_token_buckets(config.max_num_batched_tokens))
        return decode, prefill

    def capture_decode_graphs(self, buckets: list[int], logits: bool = True) -> dict[int, float]:
        """Capture the decode step at `buckets` (engine/cuda_graphs.py; after allocate_kv_cache); seconds
        per bucket."""
        from engine.cuda_graphs import DecodeGraphs

        self._await_precompile()
        self.model.backend.bind_cache(self.kv_cache)
        self.decode_graphs = DecodeGraphs(self.model, buckets, logits=logits)
        return self.decode_graphs.capture()

    def capture_prefill_graphs(self, buckets: list[int]) -> dict[int, float]:
        """Capture prefill / mixed steps at token `buckets` (engine/prefill_graphs.py; after
        allocate_kv_cache); seconds per bucket."""
        from engine.prefill_graphs import PrefillGraphs

        self._await_precompile()
        self.model.backend.bind_cache(self.kv_cache)
        self.prefill_graphs = PrefillGraphs(self.model, buckets)
        return self.prefill_graphs.capture()

    def _await_precompile(self) -> None:
        """Before the first capture: wait for the Triton kernels compiling in other processes since the model's
        build (engine/triton_precompile.py), so the capture loads them from the cache."""
        from engine import triton_precompile

        report = triton_precompile.wait_for(self.model)
        if report is not None:
            self.triton_precompile_report = report

    # ---- the step ---------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        return self.step_arrays.build(scheduled).to_inputs(self.device)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [N, V] (fp32) of the sequences that sample this step."""
        # Rebinding is a pointer swap; it keeps two engines over one model object (tests) apart.
        self.model.backend.bind_cache(self.kv_cache)
        graphs = self.decode_graphs
        if graphs is not None and graphs.serves(inputs.attention):
            self.last_path = "decode_graph"
            logits = graphs.run(inputs.input_ids, inputs.positions, inputs.attention)  # [B, V]
            if _samples_every_row(inputs, logits.shape[0]):  # (a decode step: no row pick, one kernel fewer)
                return logits.float()
            return logits.index_select(0, inputs.logits_indices).float()
        pieces = self.prefill_graphs
        if pieces is not None and pieces.serves(inputs.attention):
            self.last_path = "prefill_graph"
            hidden = pieces.run(inputs.input_ids, inputs.positions, inputs.attention)  # [T, D], static
        else:
            self.last_path = "eager"
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
    def read_kv_slots(self, slots: dict[bool, np.ndarray], into: KVDestination | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V [len(slots), Hkv, Dh] at the slots of the layer's kind, every layer in one
        launch on GPUs (kernels/attention/kv_rows.py). `into(shapes, dtype)` may supply the destination
        tensors (every K, then every V: a transport's slot); otherwise they are views of one new buffer."""
        index = {s: to_device(self.device, a) for s, a in slots.items()}
        caches, kinds = [*self.kv_cache.k, *self.kv_cache.v], self.layer_is_sliding * 2
        shapes = [(len(slots[s]), *self.kv_cache.k[0].shape[2:]) for s in kinds]
        outs = into(shapes, self.kv_dtype) if into is not None else None
        foreign = outs is not None
        if not foreign:
            outs = empty_rows(shapes, self.kv_dtype, self.device)
        gather_rows(caches, [index[s] for s in kinds], outs)
        if foreign and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # someone else's memory: the rows land before we return
        n = len(self.layer_is_sliding)
        return outs[:n], outs[n:]

    @torch.inference_mode()
    def write_kv_slots(self, slots: dict[bool, np.ndarray], ks: list[torch.Tensor], vs: list[torch.Tensor],
                       pads: list[int] | None = None) -> None:
        """Write per layer K and V [rows, Hkv, Dh] at the slots of the layer's kind, after pads[i] zero rows
        (every K entry, then every V entry); one launch on GPUs (kernels/attention/kv_rows.py)."""
        index = {s: to_device(self.device, a) for s, a in slots.items()}
        caches, kinds = [*self.kv_cache.k, *self.kv_cache.v], self.layer_is_sliding * 2
        rows = [t.to(self.device, self.kv_dtype) for t in (*ks, *vs)]
        scatter_rows(caches, [index[s] for s in kinds], rows, pads or [0] * len(caches))

    def read_kv(self, seq: Sequence, sliding_start: int, into: KVDestination | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V [tokens, Hkv, Dh] of positions 0 (full) or sliding_start (sliding) to num_computed."""
        return self.read_kv_slots(self.kv_slots(seq, sliding_start, seq.num_computed), into)

    def import_slots(self, seq: Sequence, payload: PrefilledKV) -> tuple[dict[bool, np.ndarray], list, list, list]:
        """Where imported K/V goes in the pages the scheduler gave `seq`: (slots, K, V, zero rows before
        each K then V entry). The first live sliding page also holds positions before sliding_start, which
        the window masks out; they are written as zeros because a masked key still meets its value in
        0 * V (NaN stays NaN)."""
        page_start = seq.sliding_first * self.block_size
        pad = payload.sliding_start - page_start
        pads = [pad if sliding else 0 for sliding in self.layer_is_sliding] * 2
        return self.kv_slots(seq, page_start, payload.num_cached), list(payload.k), list(payload.v), pads

    def write_kv(self, seq: Sequence, payload: PrefilledKV) -> None:
        """Write imported K/V into the pages the scheduler gave `seq`."""
        self.write_kv_slots(*self.import_slots(seq, payload))

    def close(self) -> None:
        """Release the K/V cache and the decode graphs (one rank: nothing else to stop; engine/distributed
        adds its workers)."""
        if self.host_kv is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy kernel may still address the buffer
            self.host_kv.unpin()
        self.kv_cache = self.host_kv = None
        for graphs in (self.decode_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.prefill_graphs = None


def _samples_every_row(inputs: StepInputs, rows: int) -> bool:
    """Whether the logits rows to sample are rows 0 .. rows - 1 in order (known from the host arrays)."""
    picks = inputs.host.logits_indices if inputs.host is not None else None
    return picks is not None and len(picks) == rows and bool((picks == np.arange(rows)).all())
