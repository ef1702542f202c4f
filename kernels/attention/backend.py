"""The attention interface the model calls, and its pure-torch implementation (the CPU path).

Usage per step: `plan(batch)` once, then `forward(layer, q, k, v, sinks)` for every layer. A backend
that runs inside CUDA graphs keeps its metadata in fixed-size buffers that `plan` fills in place.
"""

from __future__ import annotations

import math

import torch

from kernels.attention.kv_cache import PagedKVCache, store_rows
from kernels.attention.metadata import AttentionBatch
from kernels.attention.reference import gather_pages, sink_attention


class AttentionBackend:
    """Sink attention over paged K/V for the layers of one model shard."""

    def __init__(self, layer_is_sliding: list[bool], sliding_window: int, head_dim: int):
        self.layer_is_sliding = layer_is_sliding
        self.sliding_window = sliding_window
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kv_cache: PagedKVCache | None = None
        self.batch: AttentionBatch | None = None
        # While engine/prefill_graphs.py captures (or runs its pieces eagerly): per layer kind, fixed slot
        # buffers that kv_destination hands out instead of the planned step's slot mapping.
        self.graph_slots: dict[bool, torch.Tensor] | None = None
        # Whether the sliding layers of prompt steps without cached keys read K/V from the step's own k / v rows
        # (forward's k, v) rather than the cache: prefill graphs then keep those rows for every layer.
        self.sliding_rows = False

    def bind_cache(self, kv_cache: PagedKVCache | None) -> None:
        self.kv_cache = kv_cache

    def plan(self, batch: AttentionBatch, rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
        """Plan `batch`. rows: (src, dst) pairs of 1-D tensors of one dtype to copy now, dst[:len(src)] = src (the
        decode graphs' token ids and positions: the GPU backend copies them in its decode plan's one launch)."""
        if batch.has_cache and self.kv_cache is None:
            raise RuntimeError("batch carries paging metadata but no KV cache is bound")
        self.batch = batch
        for src, dst in rows:
            dst[: src.numel()].copy_(src, non_blocking=True)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_is_sliding[layer] else None

    def kv_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) where this step's k/v rows of `layer` go, for a caller that
        writes them itself (the rotary kernel) and then passes kv_written=True; None: forward writes.
        Here: the fixed graph_slots while they are set, else None."""
        if self.graph_slots is not None and self.kv_cache is not None:
            return self.kv_cache.k[layer], self.kv_cache.v[layer], self.graph_slots[self.layer_is_sliding[layer]]
        return None

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D] after RoPE
        k: torch.Tensor,  # [T, Hkv, D] after RoPE
        v: torch.Tensor,  # [T, Hkv, D]
        sinks: torch.Tensor,  # [Hq] fp32
        kv_written: bool = False,  # the caller wrote k/v at kv_destination(layer) already
        out: torch.Tensor | None = None,  # [T, Hq, D]: where the result goes (a fresh tensor if None)
    ) -> torch.Tensor:  # [T, Hq, D]
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Reference implementation: writes pages with index_copy_, attends per sequence in fp32."""

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        meta = self.batch.group(self.layer_is_sliding[layer])
        store_rows(self.kv_cache.k[layer], meta.slot_mapping, k)
        store_rows(self.kv_cache.v[layer], meta.slot_mapping, v)

    def forward(self, layer, q, k, v, sinks, kv_written=False, out=None):
        batch = self.batch
        window = self.window(layer)
        out = torch.empty_like(q) if out is None else out
        starts = batch.query_start_loc.tolist()
        if not batch.has_cache:
            for b in range(batch.num_seqs):
                s, e = starts[b], starts[b + 1]
                out[s:e] = sink_attention(q[s:e], k[s:e], v[s:e], sinks, self.scale, window)
            return out
        if not kv_written:
            self.write_kv(layer, k, v)
        meta = batch.group(self.layer_is_sliding[layer])
        kc, vc = self.kv_cache.k[layer], self.kv_cache.v[layer]
        bs = self.kv_cache.block_size
        for b in range(batch.num_seqs):
            s, e = starts[b], starts[b + 1]
            kv_len = meta.kv_lens_cpu[b]
            pages = meta.block_tables[b, : -(-kv_len // bs)].long()
            keys = gather_pages(kc, pages, kv_len)
            values = gather_pages(vc, pages, kv_len)
            out[s:e] = sink_attention(q[s:e], keys, values, sinks, self.scale, window)
        return out
