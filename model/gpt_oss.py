"""GPT-OSS (gpt-oss-20b / gpt-oss-120b) in PyTorch.

Legend for shape comments: T = new tokens in the step, D = hidden size, Hq / Hkv = query / key-value
heads on this rank, Dh = head dim, E = experts, k = experts per token, V = vocabulary (this rank's part).

The model works on flat batches: the engine concatenates the new tokens of all sequences and
describes them with an `AttentionBatch`; attention itself is the backend's business (pure torch on
CPU, FlashInfer and our decode kernel on Hopper).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import layers
from kernels.attention import AttentionBackend, AttentionBatch, TorchAttentionBackend
from kernels.layers.fp8_linear import Fp8Linear
from kernels.moe import TorchExperts, route
from model.config import GptOssConfig
from model.parallel import SINGLE, Parallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layers.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor, delta_bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add fused with the norm that reads its result (delta_bias: a
        projection's bias its GEMM left out, added to delta first)."""
        return layers.add_rms_norm(x, delta, self.weight, self.eps, delta_bias)

    def norm_fp8(self, x: torch.Tensor, delta: torch.Tensor | None, k_padded: int):
        """The norm quantized for an FP8 GEMM (Fp8Rows): rows, or (x + delta, rows) when delta is given."""
        return layers.rms_norm_fp8(x, delta, self.weight, self.eps, k_padded)


class RotaryEmbedding(nn.Module):
    """YaRN rotary embedding over non-interleaved halves; cos and sin both carry the concentration."""

    def __init__(self, config: GptOssConfig, device=None, precompute: bool | None = None):
        super().__init__()
        d_half = config.head_dim // 2
        base = config.rope_theta
        freq = base ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device) / config.head_dim)
        factor = config.rope_scaling_factor
        if factor > 1.0:
            # NTK-by-parts: wavelengths longer than the original context are interpolated, short
            # ones extrapolated, with a linear ramp between the two corrections dims (no rounding).
            def correction_dim(rotations: float) -> float:
                return d_half * math.log(config.rope_original_max_position / (rotations * 2 * math.pi)) / math.log(base)

            low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
            ramp = (torch.arange(d_half, dtype=torch.float32, device=device) - low) / (high - low)
            extrapolate = 1 - ramp.clamp(0, 1)
            inv_freq = (1.0 / (factor * freq)) * (1 - extrapolate) + (1.0 / freq) * extrapolate
        else:
            inv_freq = 1.0 / freq
        self.concentration = config.rope_concentration
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # precompute (default: on CUDA): cos / sin of every position up to max_position_embeddings as one table
        # [P, 2, Dh/2], the same fp32 ops per element as _compute (so the same bits), and a step gathers its rows in
        # one launch instead of six (convert, multiply, cos, sin, two scalings: ~8 us of a batch-1 decode step's
        # chain on the H200). Positions must be below P: the engine's max_model_len is (llm_engine refuses more).
        self.register_buffer("cos_sin", None, persistent=False)
        if inv_freq.is_cuda if precompute is None else precompute:
            positions = torch.arange(config.max_position_embeddings, device=inv_freq.device)
            self.cos_sin = torch.stack(self._compute(positions), dim=1)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        return freqs.cos() * self.concentration, freqs.sin() * self.concentration

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, Dh/2] of the positions, with the concentration; from the table: strided row views."""
        if self.cos_sin is not None and positions.device == self.cos_sin.device:
            rows = self.cos_sin.index_select(0, positions)
            return rows[:, 0], rows[:, 1]
        return self._compute(positions)


class AttentionBlock(nn.Module):
    """GQA with biases on q/k/v/o and a learned per-head sink logit; even layers see 128 tokens."""

    def __init__(self, config: GptOssConfig, layer: int, parallel: Parallel, backend: AttentionBackend,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.layer = layer
        self.parallel = parallel
        self.backend = backend
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // parallel.tp_size
        self.num_kv_heads = config.num_key_value_heads // parallel.tp_size
        kw = dict(dtype=dtype, device=device)
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=True, **kw)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=True, **kw)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device), requires_grad=False)
        # Decode-sized batches run O as a split-K GEMV (kernels/layers/gemv_triton.py): 6.4 vs cuBLAS's
        # 9.6 us at T=1 on the H200; QKV stays on cuBLAS (7.7 vs 9.3 us), bench/results/gemv_h200.json.
        # These are the GEMV's per-block tickets; decode_gemv=False: always F.linear (to compare).
        self.decode_gemv = True
        self.register_buffer("o_gemv_tickets", layers.gemv_tickets(config.hidden_size, device), persistent=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor | None = None,
            k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q [T, Hq, Dh], k, v [T, Hkv, Dh], kv_written): the QKV projection with q and k rotated (cos/sin cast to
        x's dtype first, as the reference does). Where the backend offers its cache (kv_destination), the rotary
        kernel also writes k/v there (one launch instead of two) and kv_written is True. q_out / k_out / v_out:
        where q, k, v go (the prefill graphs' static buffers)."""
        if isinstance(x, torch.Tensor):
            qkv, bias = self.qkv_proj(x), None  # [T, (Hq + 2 Hkv) Dh]
        else:  # FP8 rows from the norm (fp8_input): the GEMM alone, its bias added by the rotary kernel
            qkv, bias = self.qkv_proj.gemm(x), self.qkv_proj.bias
        dest = self.backend.kv_destination(self.layer)
        q, k, v = layers.rotary_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, dest, q_out,
                                    k_out, v_out, bias)
        return q, k, v, dest is not None

    def fp8_input(self, num_tokens: int) -> bool:
        """Whether QKV runs on FP8 activations at this token count (dense_dtype="fp8_e4m3", > 64 tokens): the
        block's norm then quantizes for it."""
        return isinstance(self.qkv_proj, Fp8Linear) and self.qkv_proj.quantizes(num_tokens)

    def fp8_output(self, num_tokens: int) -> bool:
        """Whether O runs on FP8 activations at this token count: its bias then goes to the next norm."""
        return isinstance(self.o_proj, Fp8Linear) and self.o_proj.quantizes(num_tokens)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Sink attention of this step's tokens, [T, Hq, Dh] (into `out` when given)."""
        return self.backend.forward(self.layer, q, k, v, self.sinks, kv_written=kv_written, out=out)

    def project_out(self, o: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """The O projection of attention's output o [T, Hq, Dh], summed over the TP ranks: [T, D] (with_bias=False:
        without its bias, which the caller then adds once after the sum)."""
        t = o.shape[0]
        # Row-parallel O: each rank holds some heads; the bias is added once, by rank 0.
        first = self.parallel.tp_rank == 0 and with_bias
        if not isinstance(self.o_proj, nn.Linear):  # an Fp8Linear (dense_dtype="fp8_e4m3")
            return self.parallel.all_reduce_tp(self.o_proj(o.reshape(t, -1), with_bias=first))
        bias = self.o_proj.bias if first else None
        tickets = self.o_gemv_tickets if self.decode_gemv else None
        return self.parallel.all_reduce_tp(layers.linear(o.reshape(t, -1), self.o_proj.weight, bias, tickets))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.project_out(self.attend(*self.qkv(x, cos, sin)))


class MLPBlock(nn.Module):
    """Router (with bias) -> top-k -> softmax over the k -> clamped-SwiGLU experts -> weighted sum."""

    def __init__(self, config: GptOssConfig, parallel: Parallel, experts: nn.Module, dtype: torch.dtype, device=None):
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True, dtype=dtype, device=device)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed_forward = getattr(self.experts, "routed_forward", None)
        if routed_forward is not None:  # experts that fuse the router into their first launch (Fp8Experts)
            out = routed_forward(x, self.router.weight, self.router.bias, self.top_k)
        else:
            expert_ids, expert_weights = route(self.router(x), self.top_k)  # [T, k], [T, k]
            out = self.experts(x, expert_ids, expert_weights)  # [T, D], this rank's experts only
        return self.parallel.all_reduce_ep(out)


class TransformerBlock(nn.Module):
    def __init__(self, config: GptOssConfig, layer: int, parallel: Parallel, backend: AttentionBackend,
                 experts: nn.Module, dtype: torch.dtype, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.self_attn = AttentionBlock(config, layer, parallel, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.mlp = MLPBlock(config, parallel, experts, dtype, device)

    def attention_inputs(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                         q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                         v_out: torch.Tensor | None = None):
        """The block up to attention: (residual x + delta, q, k, v, kv_written); see AttentionBlock.qkv."""
        if self.self_attn.fp8_input(x.shape[0]):  # the norm writes FP8 rows for QKV's FP8 GEMM
            k_padded = self.self_attn.qkv_proj.k_padded
            if delta is None:
                h = self.input_layernorm.norm_fp8(x, None, k_padded)
            else:
                x, h = self.input_layernorm.norm_fp8(x, delta, k_padded)
        elif delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, delta)
        return (x, *self.self_attn.qkv(h, cos, sin, q_out, k_out, v_out))

    def after_attention(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block from attention's output o on: (residual before the MLP, MLP output)."""
        attn = self.self_attn
        if attn.fp8_output(o.shape[0]):  # O's bias added by the norm (one pass fewer over its output)
            x, h = self.post_attention_layernorm.add_and_norm(x, attn.project_out(o, with_bias=False), attn.o_proj.bias)
        else:
            x, h = self.post_attention_layernorm.add_and_norm(x, attn.project_out(o))
        return x, self.mlp(h)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x + delta is the residual stream entering this block (delta: the previous block's MLP output,
        None for the first block). Returns (residual before the MLP, MLP output): each residual add is
        done by the norm that reads it, so the stream is written once per add. (engine/prefill_graphs.py
        runs the same two halves with attention between graph replays.)"""
        x, q, k, v, kv_written = self.attention_inputs(x, delta, cos, sin)
        return self.after_attention(x, self.self_attn.attend(q, k, v, kv_written))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; other ranks fill in the rest through the all-reduce."""

    def __init__(self, vocab: int, dim: int, parallel: Parallel, dtype: torch.dtype, device=None):
        super().__init__()
        self.parallel = parallel
        rows = vocab // parallel.tp_size
        self.start = parallel.tp_rank * rows
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.parallel.all_reduce_tp(out)


class GptOssModel(nn.Module):
    def __init__(self, config: GptOssConfig, parallel: Parallel, backend: AttentionBackend,
                 experts_factory, dtype: torch.dtype, device=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel, dtype, device)
        self.rotary = RotaryEmbedding(config, device)
        self.layers = nn.ModuleList(
            TransformerBlock(config, i, parallel, backend, experts_factory(), dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x [T, D], cos, sin [T, Dh/2]): the token embeddings and the rotary tables of their positions."""
        return self.embed_tokens(input_ids), *self.rotary(positions)

    def final_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.norm.add_and_norm(x, delta)[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, positions)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin)
        return self.final_norm(x, delta)


class GptOssForCausalLM(nn.Module):
    """The whole model on one rank. `forward` returns final hidden states; `compute_logits` the logits.

    `experts_factory` builds each layer's expert module (pure torch by default; the FP8 DeepGEMM
    experts on Hopper); `backend` does attention (pure torch by default)."""

    def __init__(self, config: GptOssConfig, parallel: Parallel = SINGLE, dtype: torch.dtype = torch.float32,
                 device=None, backend: AttentionBackend | None = None, experts_factory=None):
        super().__init__()
        parallel.validate(config.num_attention_heads, config.num_key_value_heads,
                          config.num_local_experts, config.vocab_size)
        self.config = config
        self.parallel = parallel
        self.dtype = dtype
        self.backend = backend or TorchAttentionBackend(
            [config.is_sliding(i) for i in range(config.num_hidden_layers)], config.sliding_window, config.head_dim)
        if experts_factory is None:
            num_local = config.num_local_experts // parallel.ep_size

            def experts_factory():
                return TorchExperts(num_local, parallel.ep_rank * num_local, config.hidden_size,
                                    config.intermediate_size, config.swiglu_alpha, config.swiglu_limit, dtype, device)

        self.model = GptOssModel(config, parallel, self.backend, experts_factory, dtype, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // parallel.tp_size, bias=False,
                                 dtype=dtype, device=device)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch | None = None) -> torch.Tensor:
        """Hidden states [T, D] of the new tokens. With `batch` given the backend plans it first; without,
        the caller planned already (the CUDA-graph path)."""
        if batch is not None:
            self.backend.plan(batch)
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather_last_dim(self.lm_head(hidden))  # [N, V]

    @torch.inference_mode()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of one prompt recomputed from scratch (no KV cache): the reference path."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden = self.forward(ids, positions, AttentionBatch.without_cache([len(token_ids)], self.device))
        return self.compute_logits(hidden)
