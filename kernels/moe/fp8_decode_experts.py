"""The FP8 experts of a decode step of at most 8 tokens in one CUDA launch (`csrc/fp8_decode_experts.cu`).

After the fused decode front (router, top-k, masked plan, the token rows of x in FP8), `Fp8Experts` ran three
dependent launches per layer: the gate_up decode GEMM, SwiGLU + FP8 quantization, the down decode GEMM. Here a
cluster of 4 CTAs owns one 128-channel block of one active expert's SwiGLU activation: gate_up for its channels,
bias, clamped SwiGLU, the block's FP8 quantization (the per-token amax met across the cluster in distributed
shared memory), then the down GEMM's product over that K block for a quarter of the output rows each. Output:
fp32 partial sums y [Kp2 / 128, T * k, D] (row = pair), which `epilogues_triton.combine` adds in a fixed order,
rounds to bf16 and biases, as it does the split-K partials of the decode GEMM. Numerics are the FP8 path's:
W8A8 with per-128 promotion, the gate_up product rounded to bf16 before the bias, the activation quantized per
token per 128 channels with scale max(amax, 1e-4) / 448; only fp32 summation orders differ.

`decode_experts` runs it (built on first use with torch's cpp_extension, sm_90a only; importing this module
builds nothing). Twin: `decode_partials_reference` (pure torch, any device).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from kernels.moe.fp8_quant import BLOCK, dequantize_rows, dequantize_weight_blocks, quantize_rows
from kernels.moe.reference import clamped_swiglu

MAX_TOKENS = 8  # one 8-column mma tile of tokens
STAGES = 4  # cp.async ring slots per warp (2..4 built)


class FusedDecodeError(ValueError):
    """The fused decode experts cannot run these inputs; the message says which."""


@functools.cache
def _extension():
    """Build (first call, ~1 min) and load csrc/fp8_decode_experts.cu for sm_90a."""
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().parents[2] / "csrc" / "fp8_decode_experts.cu"
    build = Path(os.environ.get("FP8_DECODE_EXPERTS_BUILD_DIR",
                                Path.home() / ".cache" / "gpt_oss_serve" / "fp8_decode_experts"))
    build.mkdir(parents=True, exist_ok=True)
    return load(name="fp8_decode_experts_ext", sources=[str(src)], build_directory=str(build),
                extra_cuda_cflags=["-gencode=arch=compute_90a,code=sm_90a", "-O3"], extra_cflags=["-O3"],
                verbose=False)


def build() -> str:
    """Build the extension now; returns the path of the shared object."""
    return _extension().__file__


def available(device: torch.device) -> bool:
    """An SM90 GPU (the kernel is built for sm_90a)."""
    return device.type == "cuda" and _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def partials(a, ids: torch.Tensor, plan, w13: torch.Tensor, s13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
             s2: torch.Tensor, first_expert: int, alpha: float, limit: float,
             pdl: bool | None = None, stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [Kp2/128, T*k, D] fp32, pair_rows [T*k] int32) for the front's token rows `a` (Fp8Rows, one group of T),
    ids [T, k] and its masked plan (m_cap = T, token_of_row). Only the rows of this rank's pairs are written;
    pair_rows holds p for those pairs and -1 for the others. No host sync: CUDA-graph capturable."""
    t, k = ids.shape
    if plan.layout != "masked" or plan.rows_per_group != t or plan.token_of_row is None or not 0 < t <= MAX_TOKENS:
        raise FusedDecodeError(f"the fused decode experts take the front's masked plan with m_cap = T (1..{MAX_TOKENS}); "
                               f"got layout {plan.layout}, m_cap {plan.rows_per_group}, T {t}")
    if a.groups != 1 or a.rows_per_group != t or a.data.shape[1] != w13.shape[2]:
        raise FusedDecodeError(f"A must be the front's {t} token rows of width {w13.shape[2]}")
    if pdl is None:
        from kernels import pdl as pdl_mod

        pdl = pdl_mod.active(a.data)
    y = torch.empty(w2.shape[2] // BLOCK, t * k, w2.shape[1], dtype=torch.float32, device=a.data.device)
    pair_rows = torch.empty(t * k, dtype=torch.int32, device=a.data.device)
    _extension().fused_experts(a.data, a.scale_storage, a.sf_k_stride, w13, s13, b13, w2, s2, y, plan.counts,
                               plan.active, plan.num_active, plan.token_of_row, ids, plan.row_of_pair, pair_rows,
                               first_expert, float(alpha), float(limit), bool(pdl), stages or STAGES)
    return y, pair_rows


def decode_experts(x: torch.Tensor, a, ids: torch.Tensor, weights: torch.Tensor, plan, w13, s13, b13, w2, s2, b2,
                   first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """This rank's experts for x [T, D] (its FP8 rows `a` from the fused front), then combine: out [T, D]."""
    from kernels.moe import epilogues_triton as epi

    y, pair_rows = partials(a, ids, plan, w13, s13, b13, w2, s2, first_expert, alpha, limit)
    out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    return epi.combine(y, pair_rows, ids, weights, b2, first_expert, out)


def decode_partials_reference(aq: torch.Tensor, sa: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                              s13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                              first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """Twin of `partials`: token rows aq [T, Kp1] fp8 with scales sa [T, Kp1/128] -> y [Kp2/128, T*k, D] fp32,
    zero for pairs of other ranks' experts. Per pair: h = bf16(x @ W13^T) + b13, act = clamped SwiGLU(h), its FP8
    rows per 128 channels, then per 128-deep block kb the product of that block with W2's columns of it."""
    t, k = ids.shape
    e_local, n13, _ = w13.shape
    d, kp2 = w2.shape[1], w2.shape[2]
    y = torch.zeros(kp2 // BLOCK, t * k, d, dtype=torch.float32, device=aq.device)
    x = dequantize_rows(aq, sa)
    local = ids.reshape(-1).long() - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < e_local:
            continue
        pairs = torch.nonzero(local == e).flatten()
        h = (x[pairs // k] @ dequantize_weight_blocks(w13[e:e + 1], s13[e:e + 1])[0].T).bfloat16().float() + b13[e]
        act = clamped_swiglu(h, alpha, limit)  # [P_e, I]
        q, s = quantize_rows(act, kp2)
        hd = dequantize_rows(q, s).view(len(pairs), kp2 // BLOCK, BLOCK)
        wd = dequantize_weight_blocks(w2[e:e + 1], s2[e:e + 1])[0].view(d, kp2 // BLOCK, BLOCK)
        y[:, pairs] = torch.einsum("pkc,nkc->kpn", hd, wd)
    return y
