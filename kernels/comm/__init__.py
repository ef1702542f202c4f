"""Collectives between the ranks of one replica that NCCL serves slowly: small all-reduces of decode."""

from kernels.comm.symm_all_reduce import SymmMemAllReduce, SymmMemUnavailableError

__all__ = ["SymmMemAllReduce", "SymmMemUnavailableError"]
