"""The MoE layer of one decode token as one persistent CUDA kernel (csrc/moe_decode_layer.cu, sm_90a): router,
top-k softmax, gate_up + SwiGLU, FP8 activation, down and the weighted sum over the k experts in one launch.

One CTA per SM stays resident for the layer: a producer warp streams 16-row weight tiles of the active experts into
a shared-memory ring with bulk copies from the moment the routing is known, through the gate_up -> down hand-off,
while eight warps multiply on the tensor cores; the stages meet at three grid barriers. The split path it replaces
at T = 1 (CUDA front, gate_up decode GEMM, SwiGLU + quantization, down decode GEMM, combine) pays a ramp and a tail
per launch with no weight bytes in flight between them (kernels/moe/NOTES.md).

Numerics: routing and the token's FP8 row are the CUDA front's bit for bit; the rest is the split path's arithmetic
with the products summed in another order (outputs agree to fp32 rounding before the bf16 roundings). A layer's
`Fp8Experts.fused_decode_layer` makes routed_forward take it for single-token steps on CUDA.
Built with torch's cpp_extension on first use (nvcc + ninja; kernel and binding compiled apart), or ahead of time
by scripts/prebuild_cuda_kernels.py.
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch

from kernels import pdl

MAX_EXPERTS = 128
MAX_TOP_K = 4
MAX_HIDDEN = 3072
MAX_SLOTS = 4  # the kernel's scratch holds this many local experts per token
# the kernel's trace stamps per CTA (csrc/moe_decode_layer.cuh, kTracePoints)
TRACE_POINTS = ("entry", "pdl_wait", "b1", "routed", "first_tile", "gate_up_done", "b2", "act_quantized", "down_done",
                "b3", "combined", "last_copy_issued")
_NO_TRACE: dict = {}
# How weight rows reach the ring: "bulk" (a cp.async.bulk per row, issued by one warp), "cp_async" (16-byte cp.async by
# four warps), "bulk_tile" (one bulk copy per 16-row tile, K padding included: copy_only probes only)
PRODUCERS = {"bulk": 0, "bulk_tile": 1, "cp_async": 2}
PRODUCER = "bulk"


@functools.cache
def _extension():
    from kernels import cuda_extension

    return cuda_extension.load(["moe_decode_layer.cu", "moe_decode_layer_binding.cpp"], "moe_decode_layer_ext",
                               "MOE_DECODE_LAYER_CUDA_BUILD_DIR", "moe_decode_layer")


def build_in_background() -> concurrent.futures.Future:
    """Start building (or loading) the extension in a thread (nvcc / ninja run in subprocesses, so a model can load
    meanwhile); the future's result() is the module, or raises what the build raised."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moe_decode_layer_build")
    future = pool.submit(_extension)
    pool.shutdown(wait=False)
    return future


def model_outside_range(num_experts: int, hidden: int, intermediate: int, top_k: int, device: torch.device) -> str | None:
    """Why a model or device cannot take this kernel (None: it can)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return f"it needs an SM90+ CUDA device, got {device}"
    if not (num_experts <= MAX_EXPERTS and 0 < top_k <= MAX_TOP_K and hidden % 64 == 0 and intermediate % 64 == 0
            and hidden <= MAX_HIDDEN and intermediate <= MAX_HIDDEN):
        return (f"{num_experts} experts, hidden {hidden}, intermediate {intermediate}, top-{top_k} are outside its "
                f"range (<= {MAX_EXPERTS} experts, top-k <= {MAX_TOP_K}, hidden and intermediate multiples of 64 up to "
                f"{MAX_HIDDEN})")
    return None


def supports(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, experts) -> bool:
    """Whether the kernel runs this step: one bf16 token on an SM90+ GPU, an Fp8Experts layer within its range."""
    e, d = router_weight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape == (1, d) and router_weight.dtype == torch.bfloat16
            and d == experts.hidden and experts.w13.is_cuda and top_k <= e
            and model_outside_range(e, d, experts.intermediate, top_k, x.device) is None)


def new_barrier(device) -> torch.Tensor:
    """The kernel's grid-barrier state (arrivals, generation): zeros, kept across calls (the kernel leaves the
    arrivals at zero; the generation only grows)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def decode_layer(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int, experts,
                 barrier: torch.Tensor, stages: int = 0,
                 trace: torch.Tensor | None = None, producer: int | None = None,
                 copy_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, D] bf16 -> (this rank's MoE output [1, D] bf16, expert ids [1, k] int32, weights [1, k] fp32).
    `experts`: an Fp8Experts (its w13 / s13 / b13 / w2 / s2 / b2, first_expert, alpha, limit); `barrier`:
    new_barrier(), one per layer; stages: the ring's depth (0: the most that fit); trace: None, or int64 [SMs, 12]
    that gets each CTA's %globaltimer stamps (TRACE_POINTS; bench/moe_decode_layer_probe.py); producer: how weight
    rows reach shared memory (PRODUCERS; None: PRODUCER); copy_only (probe): stream the weights without the math (the
    output is garbage)."""
    if not supports(x, router_weight, top_k, experts) or router_bias.shape != router_weight.shape[:1]:
        raise ValueError(f"moe_decode_layer_cuda: x {tuple(x.shape)} {x.dtype}, router {tuple(router_weight.shape)} "
                         f"{router_weight.dtype}, k={top_k}: outside this kernel's range")
    dev = x.device
    d, inter, ip = experts.hidden, experts.intermediate, experts.w2.shape[2]
    out = torch.empty(1, d, dtype=torch.bfloat16, device=dev)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    logits = torch.empty(router_weight.shape[0], dtype=torch.float32, device=dev)
    act = torch.empty(MAX_SLOTS, inter, dtype=torch.float32, device=dev)
    amax = torch.empty(MAX_SLOTS, ip // 128, dtype=torch.int32, device=dev)
    ybuf = torch.empty(MAX_SLOTS, d, dtype=torch.float32, device=dev)
    _extension().layer(x.contiguous(), router_weight.contiguous(), router_bias.contiguous(), experts.w13, experts.s13,
                       experts.b13, experts.w2, experts.s2, experts.b2, out, ids, weights, logits, act, amax, ybuf,
                       barrier, experts.first_expert, float(experts.alpha), float(experts.limit), stages,
                       pdl.active(x), trace if trace is not None else _NO_TRACE.setdefault(dev, torch.empty(0, dtype=torch.int64, device=dev)),
                       PRODUCERS[PRODUCER if producer is None else producer], int(copy_only))
    return out, ids, weights
