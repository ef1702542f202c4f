"""Mixture-of-experts: routing and expert MLPs (pure torch here; FP8 DeepGEMM on Hopper)."""

from kernels.moe.reference import TorchExperts, clamped_swiglu, route

__all__ = ["TorchExperts", "clamped_swiglu", "route"]
