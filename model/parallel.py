"""How one model instance is split over the ranks of a replica (tensor and expert parallelism).

TP splits attention heads (q, k, v, sinks), the O projection's input and the vocabulary. EP splits the
experts. Both run over the same ranks: every rank holds all tokens of the step (inputs replicated),
and the partial results of O, the experts and the embedding are summed with an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A TP/EP combination that does not divide the model or the devices."""


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0
    group: object | None = None  # torch.distributed process group; None: the default group
    # A faster sum for small tensors (kernels/comm.SymmMemAllReduce: decode steps), with `takes(x)` and
    # `__call__(x) -> sum`; None or a tensor it does not take: torch.distributed's all_reduce.
    fast_all_reduce: object | None = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    def validate(self, num_heads: int, num_kv_heads: int, num_experts: int, vocab: int) -> None:
        for name, size in (("tp", self.tp_size), ("ep", self.ep_size)):
            if size < 1:
                raise ParallelConfigError(f"{name} size must be >= 1, got {size}")
        world = self.world_size
        if self.tp_size not in (1, world) or self.ep_size not in (1, world):
            raise ParallelConfigError(
                f"tp={self.tp_size} and ep={self.ep_size} must each be 1 or the replica's world size {world}"
            )
        checks = (
            ("num_key_value_heads", num_kv_heads, self.tp_size, "tp"),
            ("num_attention_heads", num_heads, self.tp_size, "tp"),
            ("vocab_size", vocab, self.tp_size, "tp"),
            ("num_local_experts", num_experts, self.ep_size, "ep"),
        )
        for key, value, size, name in checks:
            if value % size:
                raise ParallelConfigError(f"{key}={value} is not divisible by {name}={size}")

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results of a tensor-parallel layer (a no-op when attention is replicated). Use the
        returned tensor: the fast path returns a new one."""
        return self._sum(x) if self.tp_size > 1 else x

    def all_reduce_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the experts' contributions over the expert-parallel ranks (use the returned tensor)."""
        return self._sum(x) if self.ep_size > 1 else x

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        fast = self.fast_all_reduce
        if fast is not None and fast.takes(x):
            return fast(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = Parallel()
