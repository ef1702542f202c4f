"""Sink attention: metadata, the backend interface, the pure-torch backend, and (on GPUs) the fast one."""

from kernels.attention.backend import AttentionBackend, TorchAttentionBackend
from kernels.attention.kv_cache import PagedKVCache
from kernels.attention.metadata import AttentionBatch, KVGroupMeta

__all__ = ["AttentionBackend", "TorchAttentionBackend", "PagedKVCache", "AttentionBatch", "KVGroupMeta"]
