"""`Fp8Experts`: the MoE experts of one layer in FP8 with 128x128 block scales (drop-in for TorchExperts).

Weights: gate_up [E_local, 2I, Hp] and down [E_local, D, Ip] in float8_e4m3fn, K padded to 2944,
fp32 block scales, fp32 biases. `forward(x [T, D], expert_ids [T, k], expert_weights [T, k])` returns
this rank's contribution exactly like TorchExperts.forward: the routing-weighted sum over the local
experts [first_expert, first_expert + E_local); other ids are ignored (expert parallelism sums ranks).

Backends: "deep_gemm" (SM90 + DeepGEMM built by scripts/build_deep_gemm.sh), "triton" (any CUDA GPU
Triton supports FP8 dots on), "torch" (the twin in fp8_reference.py: the CPU path). Decode-sized batches
(T <= masked_max_tokens) use the masked layout (up to 64 tokens: the Triton decode GEMM over active
experts only, see decode_kernel), larger ones the contiguous layout (up to segments_max_rows rows per expert on
the Triton segments GEMM, above on DeepGEMM's). Neither reads anything back to the host, so a forward can be
captured in a CUDA graph for a fixed T.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe import fp8_reference
from kernels.moe.fp8_quant import (BLOCK, FP8, Fp8LayoutError, align, dequantize_weight_blocks,
                                   mxfp4_to_fp8_blocks, padded, quantize_weight_blocks)
from kernels.moe.reference import TorchExperts

BACKENDS = ("auto", "deep_gemm", "triton", "torch")
# Masked-layout groups are rounded up to whole 128-row tiles: DeepGEMM stores D tiles whole, and a
# partial tile of expert e would otherwise overwrite the first rows of expert e + 1.
MASKED_ROW_ALIGN = 128


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        # "triton" on CPU tensors runs the kernels under Triton's interpreter: for tests only.
        if backend == "deep_gemm":
            raise ValueError(f"backend 'deep_gemm' needs a CUDA device; weights are on {device}")
        return "triton" if backend == "triton" else "torch"
    if backend == "auto":
        from kernels.moe import deep_gemm_ops

        return "deep_gemm" if deep_gemm_ops.available() else "triton"
    return backend


class Fp8Experts(nn.Module):
    def __init__(self, num_local: int, first_expert: int, hidden: int, intermediate: int,
                 alpha: float, limit: float, device=None, backend: str = "auto", masked_max_tokens: int = 64):
        super().__init__()
        self.num_local, self.first_expert = num_local, first_expert
        self.hidden, self.intermediate = hidden, intermediate
        self.alpha, self.limit = alpha, limit
        self.backend = backend
        self.masked_max_tokens = masked_max_tokens
        # Contiguous-layout psum grouping (DeepGEMM schedules only real row blocks) vs m_indices.
        self.use_psum = True
        # Decode (masked, T <= 64) GEMMs: our Triton decode kernel also under the deep_gemm backend: on
        # the H200 it beat DeepGEMM's masked GEMM at every decode size measured (20b T=1 44 vs 64 us per
        # layer, 120b T=64 711 vs 752; bench/results/moe_h200_deep_gemm.json). "deep_gemm" to compare.
        self.decode_kernel = "triton"
        # routed_forward fuses router + routing + plan + quantization into one launch where it can
        # (decode_front_triton); False: the unfused launches, to compare
        self.fused_front = True
        # single-token steps' front as one CUDA cluster (decode_front_cuda; set by engine/model_factory.py from
        # EngineConfig.decode_front, its extension built before the first step)
        self.cuda_front = False
        # SwiGLU + quantization with approximate divisions (epilogues_triton.swiglu_quant): None = its
        # default (prefill-sized calls only); True / False to compare (bench/prefill_ab)
        self.swiglu_fast_div: bool | None = None
        # Prefill (contiguous layout): SwiGLU + quantization by row tiles of 32 rows, bias loaded once per tile
        # (epilogues_triton.swiglu_quant_contiguous, bitwise the per-pair kernel's output, GPU test): H200,
        # 2026-11-30, python -m bench.swiglu_ab: 20b 4k 104.4 -> 92.7 us, 120b 8k 198.2 -> 174.8 us per call
        # (bench/results/swiglu_ab_tiles_h200.log). False: the per-pair kernel, to compare.
        self.swiglu_tiles = True
        # The tiles' inputs as int32 words, one (gate, up) pair each (bitwise the same output; SM90 static SASS
        # 1,536 -> 1,120 instructions per thread without PDL) and, where fast division is on, the sigmoid from the
        # SFU's ex2 / rcp approximations (864; a few ulp off before the FP8 cast: 5.4e-7 of the codes one step off).
        # H200, 2026-12-06, python -m bench.swiglu_ab: 120b 8k 175.0 -> 153.3 -> 135.7 us per call, 20b 4k
        # 93.2 -> 83.0 -> 73.2 (the H100 gave 1.07x; kernels/moe/NOTES.md, item 5). False: the bf16 halves / the
        # IEEE-rounded sigmoid.
        self.swiglu_words = True
        self.swiglu_mufu = True
        # Prefill dispatch quantization by a per-block reciprocal instead of a division per value (as the
        # SwiGLU's fast division, in prefill-sized calls: epilogues_triton.prefill_sized). Off: no gain measured
        # (H200, 120b 8k forward: 3.27 vs 3.24 ms of the kernel per forward, bench/prefill_ab swiglu-mufu; the
        # kernel alone within 2% at every launch shape, bench/dispatch_ab).
        self.dispatch_fast_div = False
        # Contiguous-layout GEMMs whose experts average at most this many rows (pairs / local experts; under expert
        # parallelism an overestimate) run triton_grouped_gemm.grouped_gemm_segments (weights streamed once per
        # segment, no padding rows computed) instead of DeepGEMM's / the general Triton grouped GEMM: 120b steps of
        # 65-512 tokens, 20b's of 65-128. H100, 2026-12-06: the layer 1.17-1.31x up to 16 rows, 1.03x at 32, 0.8x at
        # 64 (bench/results/moe_segments_h100.json); 20b decode steps of 96 / 128 sequences 1.10x / 1.09x
        # (decode_ab_segments_20b_h100.json). Not yet timed on an H200 (kernels/moe/NOTES.md). 0: never.
        self.segments_max_rows = 16
        hp, ip = padded(hidden), padded(intermediate)
        kw = dict(device=device)
        self.register_buffer("w13", torch.zeros(num_local, 2 * intermediate, hp, dtype=FP8, **kw))
        self.register_buffer("s13", torch.ones(num_local, -(-2 * intermediate // BLOCK), hp // BLOCK, **kw))
        self.register_buffer("b13", torch.zeros(num_local, 2 * intermediate, **kw))
        self.register_buffer("w2", torch.zeros(num_local, hidden, ip, dtype=FP8, **kw))
        self.register_buffer("s2", torch.ones(num_local, -(-hidden // BLOCK), ip // BLOCK, **kw))
        self.register_buffer("b2", torch.zeros(num_local, hidden, **kw))
        # the fused decode front's ticket counter (zero between calls; see decode_front_triton)
        # (a plain zeros buffer: building the module must not import Triton)
        self.register_buffer("front_ticket", torch.zeros(1, dtype=torch.int32, **kw), persistent=False)
        # Decode steps of at most this many tokens read the MXFP4 copy attached by attach_mxfp4 (0: never)
        self.mxfp4_max_tokens = 0
        self._mxfp4: tuple[dict, dict] | None = None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor, first_expert: int, alpha: float, limit: float,
                   device=None, **kwargs) -> "Fp8Experts":
        """From TorchExperts-layout weights: gate_up [E, 2I, D] (rows interleaved gate/up), down [E, D, I].
        Quantized on `device` (default: the weights' device)."""
        e, two_i, d = gate_up.shape
        if down.shape != (e, d, two_i // 2):
            raise Fp8LayoutError(f"down_proj {tuple(down.shape)} does not match gate_up_proj {tuple(gate_up.shape)}: "
                                 f"expected [{e}, {d}, {two_i // 2}]")
        device = torch.device(device) if device is not None else gate_up.device
        m = cls(e, first_expert, d, two_i // 2, alpha, limit, device, **kwargs)
        m.load_quantized(*quantize_weight_blocks(gate_up.to(device), m.w13.shape[2]), gate_up_bias,
                         *quantize_weight_blocks(down.to(device), m.w2.shape[2]), down_bias)
        return m

    @classmethod
    def from_torch_experts(cls, experts: TorchExperts, device=None, **kwargs) -> "Fp8Experts":
        return cls.from_dense(experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                              experts.down_proj_bias, experts.first_expert, experts.alpha, experts.limit,
                              device, **kwargs)

    @classmethod
    def from_mxfp4(cls, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
                   down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor,
                   first_expert: int, alpha: float, limit: float, device=None, **kwargs) -> "Fp8Experts":
        """From the published checkpoints' MXFP4 blocks/scales ([E, out, in/32, 16] / [E, out, in/32]),
        converted on `device` (the GPU at load time: seconds per model, not minutes on the host)."""
        e, two_i = gate_up_blocks.shape[:2]
        d = down_blocks.shape[1]
        device = torch.device(device) if device is not None else gate_up_blocks.device
        m = cls(e, first_expert, d, two_i // 2, alpha, limit, device, **kwargs)
        w13 = mxfp4_to_fp8_blocks(gate_up_blocks.to(device), gate_up_scales.to(device), m.w13.shape[2])
        w2 = mxfp4_to_fp8_blocks(down_blocks.to(device), down_scales.to(device), m.w2.shape[2])
        m.load_quantized(*w13, gate_up_bias, *w2, down_bias)
        return m

    @torch.no_grad()
    def load_quantized(self, w13, s13, b13, w2, s2, b2) -> None:
        """Fill from already-converted tensors (a `gptoss convert` checkpoint), checking every shape."""
        for name, value in (("w13", w13), ("s13", s13), ("b13", b13), ("w2", w2), ("s2", s2), ("b2", b2)):
            mine = getattr(self, name)
            if tuple(value.shape) != tuple(mine.shape):
                raise Fp8LayoutError(f"{name} has shape {tuple(value.shape)}, this layer needs {tuple(mine.shape)}")
            mine.copy_(value.to(mine.dtype) if name.startswith("b") else value)

    @torch.no_grad()
    def attach_mxfp4(self, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                     down_scales: torch.Tensor, max_tokens: int) -> None:
        """Keep the checkpoint's MXFP4 experts too (this rank's [E_local, out, in/32, 16] blocks and scales, the
        weights the FP8 copy was converted from), packed for the CUDA MXFP4 decode GEMM; decode steps of at most
        `max_tokens` tokens then run kernels/moe/mxfp4_decode_layer.py (20b steps 1.02-1.07x at T <= 8 on the H200, 0.73x at 16)."""
        from kernels.moe import mxfp4_cuda
        from kernels.moe.mxfp4_decode_layer import MAX_TOKENS

        if not 0 < max_tokens <= MAX_TOKENS:
            raise Fp8LayoutError(f"mxfp4 decode max_tokens must be 1..{MAX_TOKENS}, got {max_tokens}")
        want = ((self.num_local, 2 * self.intermediate, self.hidden // 32, 16),
                (self.num_local, self.hidden, self.intermediate // 32, 16))
        for name, blocks, scales, shape in (("gate_up", gate_up_blocks, gate_up_scales, want[0]),
                                            ("down", down_blocks, down_scales, want[1])):
            if tuple(blocks.shape) != shape or tuple(scales.shape) != shape[:3]:
                raise Fp8LayoutError(f"MXFP4 {name} blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)}: this "
                                     f"layer needs {shape} / {shape[:3]}")
        device = self.w13.device
        packed = [mxfp4_cuda.pack_mma_words(b.to(device), s.to(device))
                  for b, s in ((gate_up_blocks, gate_up_scales), (down_blocks, down_scales))]
        for name, p in zip(("mx13", "mx2"), packed):  # buffers: moved with the module, counted in weight bytes
            self.register_buffer(f"{name}_words", p["words"], persistent=False)
            self.register_buffer(f"{name}_scales", p["scales"], persistent=False)
        self._mxfp4 = tuple({"n": p["n"], "k": p["k"]} for p in packed)
        self.mxfp4_max_tokens = max_tokens

    def _mxfp4_packed(self) -> tuple[dict, dict]:
        (m13, m2) = self._mxfp4
        return (dict(m13, words=self.mx13_words, scales=self.mx13_scales),
                dict(m2, words=self.mx2_words, scales=self.mx2_scales))

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> TorchExperts:
        """A TorchExperts holding exactly the weights this module computes with (the accuracy reference)."""
        ref = TorchExperts(self.num_local, self.first_expert, self.hidden, self.intermediate,
                           self.alpha, self.limit, dtype, self.w13.device)
        with torch.no_grad():
            ref.gate_up_proj.copy_(dequantize_weight_blocks(self.w13, self.s13, self.hidden, dtype))
            ref.down_proj.copy_(dequantize_weight_blocks(self.w2, self.s2, self.intermediate, dtype))
            ref.gate_up_proj_bias.copy_(self.b13)
            ref.down_proj_bias.copy_(self.b2)
        return ref

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden or expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != x.shape[0]:
            raise Fp8LayoutError(f"x {tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)} and expert_weights "
                                 f"{tuple(expert_weights.shape)} must be [T, {self.hidden}], [T, k], [T, k]")
        backend = resolve_backend(self.backend, x.device)
        if backend == "torch":
            return fp8_reference.fp8_moe_forward(x, expert_ids, expert_weights, self.w13, self.s13, self.b13,
                                                 self.w2, self.s2, self.b2, self.first_expert, self.alpha, self.limit)
        return self._forward_gpu(x, expert_ids.contiguous(), expert_weights.contiguous(), backend)

    def routed_forward(self, x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
                       top_k: int) -> torch.Tensor:
        """Router + top-k + this layer, as MLPBlock computes them. Decode-sized bf16 batches on the Triton
        decode GEMM take the fused front (decode_front_triton: one launch for router, routing, plan and
        quantization); everything else routes with kernels.moe.route first."""
        backend = resolve_backend(self.backend, x.device)
        t = x.shape[0]
        from kernels.moe import decode_front_triton as front

        if not self.fused_front or backend == "torch" or x.dtype != torch.bfloat16 or not 0 < t <= front.FRONT_MAX_TOKENS \
                or not self._decode_kernel_runs(backend, t <= self.masked_max_tokens, t):
            from kernels.moe import route

            logits = torch.nn.functional.linear(x, router_weight, router_bias)
            return self(x, *route(logits, top_k))
        if self.front_ticket.device != x.device:
            raise Fp8LayoutError(f"experts on {self.front_ticket.device}, activations on {x.device}")
        from kernels.moe import decode_front_cuda

        if t == 1 and self.cuda_front and decode_front_cuda.supports(x, router_weight, top_k, self.w13.shape[2]):
            ids, weights, plan, a = decode_front_cuda.decode_front(x, router_weight, router_bias, top_k,
                                                                   self.first_expert, self.num_local, self.w13.shape[2])
        else:
            ids, weights, plan, a = front.decode_front(x, router_weight, router_bias, top_k, self.first_expert,
                                                       self.num_local, self.w13.shape[2], self.front_ticket)
        if self._mxfp4 is not None and t <= self.mxfp4_max_tokens and x.is_cuda:
            from kernels.moe import mxfp4_decode_layer

            return mxfp4_decode_layer.decode_experts(x.contiguous(), ids, weights, plan, *self._mxfp4_packed(),
                                                     self.b13, self.b2, self.first_expert, self.alpha, self.limit)
        from kernels.moe import triton_grouped_gemm as tgg

        return self._experts_gpu(x, ids, weights, plan, tgg.decode_splits(t), a, backend)

    def _forward_gpu(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, backend: str) -> torch.Tensor:
        from kernels.moe import epilogues_triton as epi

        t, k = ids.shape
        if t == 0:
            return torch.empty(t, self.hidden, dtype=x.dtype, device=x.device)
        plan, splits = self.plan_step(ids, backend)
        a = epi.Fp8Rows.empty(plan.num_groups, plan.rows_per_group, self.w13.shape[2], x.device)
        fast_div = self.dispatch_fast_div and epi.prefill_sized(ids.numel())
        epi.dispatch_quant(x, plan.row_of_pair, k, a, fast_div=fast_div)
        return self._experts_gpu(x, ids, weights, plan, splits, a, backend)

    def _experts_gpu(self, x, ids, weights, plan, splits: int, a, backend: str) -> torch.Tensor:
        """gate_up GEMM -> SwiGLU + quant -> down GEMM -> combine, from A rows already quantized."""
        from kernels.moe import epilogues_triton as epi

        t = ids.shape[0]
        out = torch.empty(t, self.hidden, dtype=x.dtype, device=x.device)
        h = self.gemm_output(plan, splits, self.w13.shape[1])
        self._gemm(backend, a, self.w13, self.s13, h, plan, t, self.hidden, a_row_map=plan.token_of_row)
        a2 = epi.Fp8Rows.empty(plan.num_groups, plan.rows_per_group, self.w2.shape[2], x.device)
        if self.swiglu_tiles and plan.layout == "contiguous":
            epi.swiglu_quant_contiguous(h, plan.m_indices, self.b13, self.alpha, self.limit, a2,
                                        self._alignment(backend), ids.numel(), fast_div=self.swiglu_fast_div,
                                        words=self.swiglu_words, mufu=self.swiglu_mufu and x.is_cuda)
        else:
            epi.swiglu_quant(h, plan.row_of_pair, ids, self.b13, self.first_expert, self.alpha, self.limit, a2,
                             fast_div=self.swiglu_fast_div)
        y = self.gemm_output(plan, splits, self.hidden)
        self._gemm(backend, a2, self.w2, self.s2, y, plan, t, self.intermediate, plan_written_before_predecessor=True)
        return epi.combine(y, plan.row_of_pair, ids, weights, self.b2, self.first_expert, out)

    def plan_step(self, ids: torch.Tensor, backend: str):
        """(routing plan, K splits of the GEMM outputs) of a forward over ids [T, k] on `backend`."""
        from kernels.moe import routing_triton
        from kernels.moe import triton_grouped_gemm as tgg

        t = ids.shape[0]
        masked = t <= self.masked_max_tokens
        # The Triton decode GEMM (T <= 64) reads only each expert's counts[e] rows: groups of T rows
        # suffice. DeepGEMM stores whole 128-row tiles (see MASKED_ROW_ALIGN).
        decode = self._decode_kernel_runs(backend, masked, t)
        if masked:
            plan = routing_triton.plan_masked(ids, self.first_expert, self.num_local,
                                              t if decode else align(t, MASKED_ROW_ALIGN))
        else:
            plan = routing_triton.plan_contiguous(ids, self.first_expert, self.num_local, self._alignment(backend))
        return plan, tgg.decode_splits(t) if decode else 1

    def gemm_output(self, plan, splits: int, n: int) -> torch.Tensor:
        """A grouped GEMM's output: [rows, N] bf16, or [S, rows, N] fp32 split-K partial sums."""
        device = plan.row_of_pair.device
        if splits == 1:
            return torch.empty(plan.num_rows, n, dtype=torch.bfloat16, device=device)
        return torch.empty(splits, plan.num_rows, n, dtype=torch.float32, device=device)

    def _alignment(self, backend: str) -> int:
        if backend == "deep_gemm":
            from kernels.moe import deep_gemm_ops

            return deep_gemm_ops.mk_alignment()
        return BLOCK

    def _decode_kernel_runs(self, backend: str, masked: bool, num_tokens: int) -> bool:
        from kernels.moe.triton_grouped_gemm import DECODE_MAX_TOKENS

        return masked and num_tokens <= DECODE_MAX_TOKENS and (backend == "triton" or self.decode_kernel == "triton")

    def _gemm(self, backend, a, w, s, out, plan, num_tokens: int, k: int, a_row_map=None,
              plan_written_before_predecessor: bool = False) -> None:
        """out = the grouped GEMM of A with W (K = k real columns of w.shape[2]) on the plan's layout."""
        from kernels.moe import fp8_quant, triton_grouped_gemm

        masked = plan.layout == "masked"
        num_pairs = plan.row_of_pair.numel()
        rows_per_expert = num_pairs / self.num_local
        if not masked and 0 < rows_per_expert <= self.segments_max_rows:
            triton_grouped_gemm.grouped_gemm_segments(a, w, s, out, plan.counts, plan.psum,
                                                      triton_grouped_gemm.segments_block_t(rows_per_expert),
                                                      plan_written_before_predecessor=plan_written_before_predecessor,
                                                      k_valid=None if fp8_quant.READ_K_PADDING else k)
        elif self._decode_kernel_runs(backend, masked, num_tokens):
            triton_grouped_gemm.grouped_gemm_decode(a, w, s, out, plan.counts, plan.active, plan.num_active, num_tokens,
                                                    a_row_map=a_row_map,
                                                    plan_written_before_predecessor=plan_written_before_predecessor,
                                                    k_valid=None if fp8_quant.READ_K_PADDING else k)
        elif backend == "deep_gemm":
            from kernels.moe import deep_gemm_ops as dg

            if masked:
                dg.grouped_gemm_masked(a, w, s, out, plan.counts, -(-num_pairs // self.num_local))
            elif self.use_psum:
                dg.grouped_gemm_contiguous(a, w, s, out, psum=plan.psum)
            else:
                dg.grouped_gemm_contiguous(a, w, s, out, m_indices=plan.m_indices)
        else:
            triton_grouped_gemm.grouped_gemm(a, w, s, out, plan.counts if masked else plan.m_indices, masked,
                                             expected_m=-(-num_pairs // self.num_local))

    def extra_repr(self) -> str:
        return (f"experts=[{self.first_expert}, {self.first_expert + self.num_local}), hidden={self.hidden}, "
                f"intermediate={self.intermediate}, backend={self.backend}, masked_max_tokens={self.masked_max_tokens}"
                + (f", mxfp4_max_tokens={self.mxfp4_max_tokens}" if self._mxfp4 is not None else ""))
