"""Mixture-of-experts: routing and expert MLPs (pure torch here; FP8 DeepGEMM/Triton on Hopper)."""

import torch

from kernels.moe import reference
from kernels.moe.reference import TorchExperts, clamped_swiglu


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] and weights [T, k] (fp32 softmax over the k chosen logits): one Triton
    launch on CUDA tensors (ties to the lower expert id), reference.route elsewhere."""
    if router_logits.is_cuda:
        from kernels.moe import routing_triton

        return routing_triton.topk_softmax(router_logits, top_k)
    return reference.route(router_logits, top_k)


__all__ = ["TorchExperts", "clamped_swiglu", "route"]
