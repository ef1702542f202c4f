"""The prefix cache's second tier: copies of evicted K/V pages in host memory, found again by block hash.

The GPU pools keep a cached prompt block readable until an allocation needs its page (engine/block_manager.py).
With a host tier (EngineConfig.host_kv_cache_bytes), that eviction first copies the page to a host slot, and a
new request whose prefix continues past what the GPU still holds gets those blocks copied back into fresh pages
instead of computing them again. Moving a page is a copy of bytes over PCIe (~70 KB per token for gpt-oss-120b,
both kinds of layers, bf16); computing it again is the prefill's compute, ~15 us per token for 120b at 8k.

Only page ids and slot numbers live here: a `HostPool` per kind of layer (full, sliding) maps block hashes to
slots, least recently stored or read out first, and `KVMoves` records the copies the block manager decided, in
order. The runner (engine/runner.py) performs them before the next step's forward, on every rank
(engine/distributed), in that order, on the step's stream: each copy sees the pages as the decisions before it
left them, so a page evicted, then reused for another block within one step is read before it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from engine.config import EngineConfigError

KINDS = ("full", "sliding")


SLIDING_SLOTS_PER_FULL_SLOT = 0.25


def host_slots_for(host_bytes: int, page_bytes: tuple[int, int]) -> tuple[int, int]:
    """(full, sliding) host slots that `host_bytes` hold (a kind the model lacks: 0 slots, 0 bytes). The full pool
    sends the host every page of a cached prefix, the sliding pool only the windows it keeps (before a prompt's end
    or a cut: ~9 pages of 16 tokens; BlockManager._kept_sliding), so a sliding slot per 4 full ones: room for the
    windows of prefixes of 36 blocks (576 tokens) or more, and 1.6x the prefixes of an even split."""
    full_b, sliding_b = page_bytes
    if not host_bytes:
        return 0, 0
    if not full_b or not sliding_b:
        n = host_bytes // (full_b or sliding_b)
        full, sliding = (n, 0) if full_b else (0, n)
    else:
        full = int(host_bytes // (full_b + SLIDING_SLOTS_PER_FULL_SLOT * sliding_b))
        sliding = int(full * SLIDING_SLOTS_PER_FULL_SLOT)
    if not (full or sliding) or (full_b and sliding_b and not sliding):
        raise EngineConfigError(f"host_kv_cache_bytes={host_bytes} is too small for the host tier: it takes "
                                f"{full_b + sliding_b} bytes per page of each kind, and a sliding page per "
                                f"{1 / SLIDING_SLOTS_PER_FULL_SLOT:g} full ones")
    return full, sliding


class HostPool:
    """`num_slots` host slots of one kind of layer holding copies of cached blocks, by hash. A slot holds one
    block; storing into a full pool drops its least recently used block that is not pinned (pinned: slots a
    decision in progress is about to read)."""

    def __init__(self, kind: str, num_slots: int):
        self.kind = kind
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, 2, ...: runs of adjacent slots
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding a block, least recently used first
        self._pinned: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._hash_of)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(slot)

    def store(self, block_hash: bytes) -> int | None:
        """A slot for `block_hash` (its existing one, touched; else a free one, else the least recently used
        unpinned one, whose block is forgotten). None: every slot is pinned (the block is not kept)."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self.touch(slot)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._lru if s not in self._pinned), None)
            if slot is None:
                return None
            del self._slot_of[self._hash_of.pop(slot)]
            del self._lru[slot]
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._lru[slot] = None
        return slot

    def pin(self, slots) -> None:
        self._pinned.update(slots)

    def unpin_all(self) -> None:
        self._pinned.clear()


class KVMoves:
    """Page copies between the GPU pools and the host pools, in the order they were decided, grouped into
    batches the runner performs as one copy each: consecutive moves of one kind and direction whose
    destinations differ (a batch's copies are unordered among themselves)."""

    def __init__(self):
        self.batches: list[tuple[str, bool, list[int], list[int]]] = []  # (kind, to_host, pages, slots)
        self._open: dict[str, tuple[bool, list[int], list[int], set[int]]] = {}  # per kind: its last batch
        self.pages_to_host = 0
        self.pages_to_device = 0

    def __bool__(self) -> bool:
        return bool(self.batches)

    def add(self, kind: str, to_host: bool, page: int, slot: int) -> None:
        last = self._open.get(kind)
        dest = slot if to_host else page
        if last is None or last[0] != to_host or dest in last[3]:
            last = (to_host, [], [], set())
            self._open[kind] = last
            self.batches.append((kind, to_host, last[1], last[2]))
        last[1].append(page)
        last[2].append(slot)
        last[3].add(dest)
        if to_host:
            self.pages_to_host += 1
        else:
            self.pages_to_device += 1

    def take(self) -> list[tuple[str, bool, list[int], list[int]]]:
        """The batches decided so far (to perform now); starts a new record."""
        out, self.batches, self._open = self.batches, [], {}
        return out


def pack_moves(batches) -> np.ndarray:
    """Batches -> int64 [kind index, to_host, n, pages (n), slots (n), ...] (the wire form for other ranks)."""
    parts = []
    for kind, to_host, pages, slots in batches:
        parts.append(np.asarray([KINDS.index(kind), int(to_host), len(pages)], dtype=np.int64))
        parts.append(np.asarray(pages, dtype=np.int64))
        parts.append(np.asarray(slots, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def unpack_moves(buf: np.ndarray) -> list[tuple[str, bool, list[int], list[int]]]:
    out, i = [], 0
    while i < len(buf):
        kind, to_host, n = (int(x) for x in buf[i:i + 3])
        pages, slots = buf[i + 3:i + 3 + n], buf[i + 3 + n:i + 3 + 2 * n]
        out.append((KINDS[kind], bool(to_host), pages.tolist(), slots.tolist()))
        i += 3 + 2 * n
    return out
