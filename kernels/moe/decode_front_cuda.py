"""The MoE decode front of one token as one 8-CTA cluster (csrc/decode_front.cu, sm_90a): router GEMV + bias ->
top-k softmax -> masked plan -> the token's FP8 row of A, the outputs of decode_front_triton.decode_front at T = 1.

Each warp owns whole router rows (loaded before the PDL wait) so a logit is one warp's dot; the cluster's 64
warps hand their logits to CTA 0 through distributed shared memory and one cluster barrier, and one warp routes:
no global partial sums, fence, ticket or re-read as in the Triton front. A layer's `Fp8Experts.cuda_front` makes
routed_forward take it for single-token steps on CUDA; engine/model_factory.py sets it from EngineConfig.decode_front
(`wanted`: auto = routers of at least AUTO_MIN_EXPERTS experts, where it measured faster; kernels/moe/NOTES.md).

Numerics: logits are exact-product fp32 sums in this kernel's order (equal to the Triton front's whenever the
sums are exact, e.g. on coarse-grid inputs), then the same bias add and bf16 rounding, top-k (ties to the lower
id), softmax (ex2.approx, IEEE division) and quantization (IEEE divisions, satfinite e4m3) instructions.
Built with torch's cpp_extension (needs nvcc and ninja; 30 s on the H200 node, kernel and binding compiled apart;
then loaded from the build folder): `build_in_background()` while a model loads, `scripts/prebuild_cuda_kernels.py` where nodes are set up.
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch

from kernels import pdl
from kernels.moe.epilogues_triton import Fp8Rows
from kernels.moe.routing_triton import MoePlan

# auto turns it on for routers of at least this many experts: 120b's 128 measured 1.02x per batch-1 step, 20b's
# 32 0.99x (half the warps idle in the dot; H200, 2026-12-04, kernels/moe/NOTES.md)
AUTO_MIN_EXPERTS = 128
MAX_EXPERTS = 128
MAX_HIDDEN = 3072
MAX_TOP_K = 8


@functools.cache
def _extension():
    from kernels import cuda_extension

    # the kernel (nvcc, no torch headers) and its binding (host compiler) build in parallel
    return cuda_extension.load(["decode_front.cu", "decode_front_binding.cpp"], "decode_front_ext",
                               "DECODE_FRONT_CUDA_BUILD_DIR", "decode_front")


def build_in_background() -> concurrent.futures.Future:
    """Start building (or loading) the extension in a thread; the compile runs in nvcc / ninja subprocesses, so a
    model can load meanwhile. The future's result() is the module, or raises what the build raised."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode_front_build")
    future = pool.submit(_extension)
    pool.shutdown(wait=False)
    return future


def wanted(choice: str, num_experts: int, device: torch.device, moe_backend: str) -> bool:
    """Whether a model's single-token decode steps should take this front: choice "cuda" always (the caller
    refuses devices it cannot run on), "triton" never, "auto" on SM90+ CUDA devices with the FP8 MoE and a
    router of at least AUTO_MIN_EXPERTS (and at most MAX_EXPERTS) experts."""
    if choice not in ("auto", "triton", "cuda"):
        raise ValueError(f"decode front must be 'auto', 'triton' or 'cuda', got {choice!r}")
    if choice != "auto":
        return choice == "cuda"
    return (device.type == "cuda" and moe_backend == "fp8" and AUTO_MIN_EXPERTS <= num_experts
            and torch.cuda.get_device_capability(device)[0] >= 9)


def model_outside_range(num_experts: int, hidden: int, top_k: int, device: torch.device) -> str | None:
    """Why a model or device cannot take this front (None: it can)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return f"it needs an SM90+ CUDA device, got {device}"
    if not (num_experts <= MAX_EXPERTS and hidden % 8 == 0 and hidden <= MAX_HIDDEN and 0 < top_k <= MAX_TOP_K):
        return (f"{num_experts} experts, hidden {hidden}, top-{top_k} are outside its range (<= {MAX_EXPERTS} experts, "
                f"hidden a multiple of 8 up to {MAX_HIDDEN}, top-k <= {MAX_TOP_K})")
    return None


def supports(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, k_padded: int) -> bool:
    """Whether this kernel runs the step: one bf16 token on an SM90+ GPU, shapes within its limits."""
    e, d = router_weight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape == (1, d) and router_weight.dtype == torch.bfloat16
            and top_k <= e and k_padded % 128 == 0 and d <= k_padded <= 64 * 128
            and x.data_ptr() % 16 == 0 and router_weight.data_ptr() % 16 == 0  # 16-byte vector loads
            and model_outside_range(e, d, top_k, x.device) is None)


def decode_front(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int,
                 first_expert: int, num_local: int, k_padded: int) -> tuple[torch.Tensor, torch.Tensor, MoePlan, Fp8Rows]:
    """x [1, D] bf16, router [E, D] / [E] bf16 -> (ids [1, k] int32, weights [1, k] fp32, the masked plan with
    m_cap = 1 and token_of_row, the token's row [1, Kp] fp8 of the gate_up GEMM's A): decode_front_triton's."""
    if not supports(x, router_weight, top_k, k_padded) or router_bias.shape != router_weight.shape[:1]:
        raise ValueError(f"decode_front_cuda: x {tuple(x.shape)} {x.dtype}, router {tuple(router_weight.shape)} "
                         f"{router_weight.dtype}, k={top_k}, Kp={k_padded}: outside this kernel's range")
    dev = x.device
    ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(num_local + 1, dtype=torch.int32, device=dev)  # last: number of active experts
    active = torch.empty(max(1, min(top_k, num_local)), dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(top_k, dtype=torch.int32, device=dev)
    token_of_row = torch.empty(num_local, dtype=torch.int32, device=dev)
    a = Fp8Rows.empty(1, 1, k_padded, dev)
    _extension().front(x.contiguous(), router_weight.contiguous(), router_bias.contiguous(), ids, weights, counts,
                       active, row_of_pair, token_of_row, a.data, a.scale_storage, a.sf_k_stride, first_expert,
                       num_local, pdl.active(x))
    plan = MoePlan("masked", row_of_pair, counts[:num_local], num_local, 1, active=active,
                   num_active=counts[num_local:], token_of_row=token_of_row)
    return ids, weights, plan, a
