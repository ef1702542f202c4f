"""Piecewise CUDA graphs of prefill and mixed steps at token-count buckets.

An eager prefill forward launches ~14 kernels per layer from Python (a Triton launch ~13 us of host
time, DeepGEMM's grouped GEMM ~35 us): 20b at 1k tokens measured 12.5 ms of GPU kernels in 30.7 ms of
wall time (at 4k-8k the GPU was already busy: bench/RESULTS.md, "Piecewise prefill graphs"). Attention is the one
part of a step whose launch depends on the step's shape beyond its token count (FlashInfer plans per
sequence on the host), so it stays eager and everything between two attention calls is replayed:

    graph 0: embedding, rotary tables, layer 0's norm, QKV, rotary (+ K/V write into the cache)
    eager:   layer 0's attention (planned for the step's real sequences) on the first T rows of q
    graph i: layer i-1's O projection, add + norm, MoE; layer i's add + norm, QKV, rotary (+ K/V write)
    eager:   layer i's attention ...
    graph L: the last layer's O projection, add + norm, MoE, the final norm

A step of T new tokens (prompt chunks, the one-token rows of decoding sequences, or both) pads T to the
smallest bucket Tp >= T. Everything in the graphs is token-parallel, so the padding rows (token 0 at
position 0, cache slot -1: they write no K/V) change no real row; attention sees only the T real rows,
and rows T..Tp-1 of its output buffer keep earlier, finite values.

Buffers at fixed addresses, outside the graphs' pool and shared by every bucket: token ids, positions,
the cache slots per layer kind (what the rotary kernel writes through, `AttentionBackend.graph_slots`),
q and the full layers' k / v rows (the rotary kernel writes them in place; attention over a step without
cached prefixes reads the rows), attention's output, and the final hidden states. Everything
else lives in one pool: buckets are replayed one at a time, so the largest one's working set is the
pool's size. A graph's intermediate tensors (residual stream, MLP output, rotary tables) are released
once the next graph that reads them is captured; at replay the reader has run before anything reuses them.

Needs the attention backend to write K/V through kv_destination (FlashInferAttentionBackend with
fuse_kv_write; on the CPU the torch backend, for run_eager). Over several ranks every rank captures the
same buckets in the same order (engine/distributed: CAPTURE_PREFILL) and replays the same bucket each
step, so the collectives inside the pieces pair up, as with the decode graphs.
Legend: T = real tokens, Tp = bucket.
"""

from __future__ import annotations

import contextlib
import time

import torch

from engine.cuda_graphs import CudaGraphError
from kernels import pdl as pdl_launch
from kernels.attention import AttentionBatch
from model.gpt_oss import GptOssForCausalLM


def default_token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ..., 512, then every 256 to 2048, every 512 to 4096, every 1024 to 8192, every 2048 above,
    and max_tokens itself: a step of T tokens runs max(16, T) to 2T rows up to 512, at most 1.5x to 1024 and
    1.34x above."""
    if max_tokens < 1:
        raise CudaGraphError(f"max_tokens must be >= 1, got {max_tokens}")
    out, t = [], 16
    while t < max_tokens:
        out.append(t)
        t = t * 2 if t < 512 else t + (256 if t < 2048 else 512 if t < 4096 else 1024 if t < 8192 else 2048)
    return out + [max_tokens]


class PrefillGraphs:
    """Per bucket, num_layers + 1 captured graphs with attention launched eagerly between them."""

    def __init__(self, model: GptOssForCausalLM, buckets: list[int], pdl: bool = True):
        if not buckets:
            raise CudaGraphError("give at least one token bucket")
        self.model = model
        self.buckets = sorted(set(buckets))
        self.pdl = pdl  # capture the Triton kernels with programmatic dependent launch (kernels/pdl.py)
        self.num_layers = len(model.model.layers)
        top, device, dtype = self.buckets[-1], model.device, model.dtype
        attn = model.model.layers[0].self_attn
        kinds = sorted(set(model.config.is_sliding(i) for i in range(self.num_layers)))
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = {kind: torch.full((top,), -1, dtype=torch.int64, device=device) for kind in kinds}
        self.q = torch.zeros(top, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        # k / v rows as the rotary kernel leaves them: what the backend's ragged full layers (and, with its
        # sliding_rows, the sliding kernel) read in steps whose prompts have no cached prefix; the layers that do
        # not read them leave them alone
        self.k_rows, self.v_rows = (torch.zeros(top, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
                                    for _ in range(2))
        self.row_layers = [model.backend.sliding_rows or not model.config.is_sliding(i) for i in range(self.num_layers)]
        self.attn_out = torch.zeros(top, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_seconds: dict[int, float] = {}
        self.pool = None
        self.replays = 0  # steps served by the graphs (tests, benchmarks)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def serves(self, batch: AttentionBatch) -> bool:
        """Whether `run` takes this step: a step over the K/V cache that fits a bucket."""
        return batch.has_cache and 0 < batch.num_tokens and self.bucket_for(batch.num_tokens) is not None

    # ---- the pieces -------------------------------------------------------------------------------
    def _piece(self, i: int, size: int, state: dict) -> None:
        """Piece i of a forward over the first `size` rows of the static buffers; `state` carries the
        tensors one piece hands to the next (residual x, cos, sin). K/V go into the cache through the
        static slots (_writing_through_static_slots), q into the static q."""
        m = self.model.model
        if i == 0:
            x, cos, sin = m.embed(self.input_ids[:size], self.positions[:size])
            state.update(cos=cos, sin=sin)
            delta = None
        else:
            x, delta = m.layers[i - 1].after_attention(state["x"], self.attn_out[:size])
        if i < self.num_layers:
            rows = (self.k_rows[:size], self.v_rows[:size]) if self.row_layers[i] else (None, None)
            state["x"] = m.layers[i].attention_inputs(x, delta, state["cos"], state["sin"], self.q[:size], *rows)[0]
        else:
            self.hidden[:size].copy_(m.final_norm(x, delta))

    def _attend(self, i: int, t: int) -> None:
        """Layer i's attention over the step's T real rows; their K/V are in the cache already (and, for the
        row layers, in the k / v row buffers)."""
        k, v = (self.k_rows[:t], self.v_rows[:t]) if self.row_layers[i] else (None, None)
        self.model.model.layers[i].self_attn.attend(self.q[:t], k, v, True, out=self.attn_out[:t])

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> tuple[int, int]:
        t = batch.num_tokens
        size = self.bucket_for(t)
        if size is None or not batch.has_cache:
            raise CudaGraphError(f"a step of {t} tokens{'' if batch.has_cache else ' without a K/V cache'} is not "
                                 f"served by prefill graphs up to {self.max_tokens} tokens")
        self.model.backend.plan(batch)  # attention's plan for the real sequences (eager, between the pieces)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        if size > t:
            self.input_ids[t:size].zero_()
            self.positions[t:size].zero_()
        for kind, slots in self.slots.items():
            slots[:t].copy_(batch.group(kind).slot_mapping, non_blocking=True)
            if size > t:
                slots[t:size].fill_(-1)
        return t, size

    @contextlib.contextmanager
    def _writing_through_static_slots(self):
        backend = self.model.backend
        backend.graph_slots = self.slots
        try:
            if backend.kv_destination(0) is None:
                raise CudaGraphError("prefill graphs need a backend whose rotary kernel writes K/V through fixed "
                                     "slot buffers (FlashInferAttentionBackend with fuse_kv_write=True)")
            yield
        finally:
            backend.graph_slots = None

    # ---- capture and replay -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> dict[int, float]:
        """Capture every bucket, largest first (smaller ones fit in its pool). Needs the K/V cache bound.
        Returns seconds per bucket (each piece warmed up eagerly, captured, then replayed once so the next
        piece warms up on real values)."""
        model = self.model
        if model.device.type != "cuda":
            raise CudaGraphError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        if model.backend.kv_cache is None:
            raise CudaGraphError("bind the K/V cache (ModelRunner.allocate_kv_cache) before capturing prefill graphs")
        for slots in self.slots.values():
            slots.fill_(-1)  # capture-time steps write no K/V
        for size in reversed(self.buckets):
            start = time.perf_counter()
            state: dict = {}
            pieces = []
            with self._writing_through_static_slots(), pdl_launch.switched(pdl_launch.ENABLED and self.pdl):
                for i in range(self.num_layers + 1):
                    self._piece(i, size, dict(state))  # warm-up: compiles, allocator sees the shapes
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self._piece(i, size, state)
                    self.pool = graph.pool()
                    graph.replay()
                    pieces.append(graph)
            torch.cuda.synchronize()
            self.graphs[size] = pieces
            self.capture_seconds[size] = time.perf_counter() - start
        return dict(self.capture_seconds)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Hidden states [T, D] of the step's tokens (a view of the static buffer: consume before the next
        step), the graphs replayed with attention between them."""
        t, size = self._stage(input_ids, positions, batch)
        pieces = self.graphs[size]
        for i in range(self.num_layers):
            pieces[i].replay()
            self._attend(i, t)
        pieces[-1].replay()
        self.replays += 1
        return self.hidden[:t]

    @torch.inference_mode()
    def run_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The same padded pieces launched kernel by kernel (any device): what `run` must reproduce bit for
        bit, and on the CPU the check that the pieces compose into the model's forward."""
        t, size = self._stage(input_ids, positions, batch)
        state: dict = {}
        with self._writing_through_static_slots():
            for i in range(self.num_layers):
                self._piece(i, size, state)
                self._attend(i, t)
            self._piece(self.num_layers, size, state)
        return self.hidden[:t]

    def release(self) -> None:
        """Free the captured graphs now (see DecodeGraphs.release)."""
        for pieces in self.graphs.values():
            for graph in pieces:
                graph.reset()
        self.graphs.clear()
        self.pool = None
