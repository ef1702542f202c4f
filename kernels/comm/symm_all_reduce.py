"""One-shot all-reduce over torch's symmetric memory, for the small sums of a decode step.

A TP/EP decode step sums 2 x 36 + 1 activations of [B, 2880] bf16 over the ranks (O projection,
experts, embedding). NCCL's ring LL all-reduce took 9.9 us a call inside a 120b TP2/EP2 decode graph on
2x H200 (0.72 ms of a 5.2 ms step, bench/results/parallel_h200x2_120b_graphs.json). A one-shot
all-reduce writes this rank's part into a buffer every rank can read over NVLink (torch's symmetric
memory: the same allocation mapped in every process of the group), meets the others at a barrier in
that memory, and has every rank read and sum all parts: one kernel, no ring steps. Here that kernel is
torch's `symm_mem::one_shot_all_reduce_copy` (copy in + barrier + sum); this module owns the buffer,
the size limit (above it NCCL's bandwidth wins) and the fallback.

Bytes per call per rank: it writes B x 2880 x 2 and reads world x that. Capturable in CUDA graphs (no
host sync). Multicast (NVLS) is not used: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stays set.
Measured on 2x H200 (2026-11-30, bench/RESULTS.md, "Tensor and expert parallelism on 2x H200"): in a 120b TP2/EP2 decode graph
9.5 us a call against NCCL's 15.4 us on that instance (step sums 1,124 -> 696 us), the same tokens; the
default `all_reduce="auto"` picks it where every rank sees the group's GPUs (engine/distributed/worker.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Above this a one-shot read of every rank's part loses to NCCL's bandwidth-optimal rings (to be tuned
# by bench/allreduce.py): 256 KiB is 45 rows of 2880 bf16, the decode batches of a latency-bound replica.
DEFAULT_MAX_BYTES = 256 * 1024


class SymmMemUnavailableError(RuntimeError):
    """This torch build, device or host cannot set symmetric memory up; the message says what failed."""


class SymmMemAllReduce:
    """Sums contiguous tensors of `dtype` up to `max_bytes` over `group` (all ranks call it in the same
    order, like any collective). Construction is itself collective (the buffer's rendezvous)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.bfloat16, max_bytes: int = DEFAULT_MAX_BYTES,
                 group=None):
        device = torch.device(device)
        if device.type != "cuda":
            raise SymmMemUnavailableError(f"symmetric-memory all-reduce needs CUDA devices, got {device}")
        if not dist.is_initialized():
            raise SymmMemUnavailableError("torch.distributed is not initialized: join the group first")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as err:
            raise SymmMemUnavailableError(f"this torch has no symmetric memory: {err}") from None
        ops = torch.ops.symm_mem
        # one_shot_all_reduce_copy (copy in + sum in one kernel) is newer than one_shot_all_reduce.
        self._fused = hasattr(ops, "one_shot_all_reduce_copy")
        if not self._fused and not hasattr(ops, "one_shot_all_reduce"):
            raise SymmMemUnavailableError(f"torch {torch.__version__} has no symm_mem one-shot all-reduce")
        group = group if group is not None else dist.group.WORLD
        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        try:
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, a no-op after
                symm_mem.enable_symm_mem_for_group(self.group_name)
            self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
            symm_mem.rendezvous(self.buffer, self.group_name)
        except Exception as err:  # driver / IPC handle exchange failures come as RuntimeError of many kinds
            raise SymmMemUnavailableError(f"symmetric memory over group {self.group_name!r} on {device} failed: "
                                          f"{err!r}") from err
        self.calls = 0  # sums done here (tests, benchmarks)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x` (a new tensor of x's shape); `takes(x)` must hold."""
        self.calls += 1
        buf = self.buffer[: x.numel()]
        if self._fused:
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.view(-1), "sum", self.group_name)
        else:
            buf.copy_(x.view(-1))
            out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        return out.view(x.shape)
