"""Page ids of one kind (full-attention or sliding-window layers) with reference counts, and the chained block
hashes that name cached prefixes. engine/block_manager.py allocates and frees a sequence's pages from two of these.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


def prefix_block_hashes(token_ids, block_size: int, max_blocks: int | None = None, salt: str = "") -> list[bytes]:
    """Chained hashes of the whole blocks of a token list: out[i] names tokens [0, (i + 1) * block_size), so
    equal hashes mean an equal prefix of that length (the prefix cache's block names; the Serve router's). A
    salt (GenerateRequest.cache_salt) starts the chain elsewhere: equal prefixes of different salts never meet."""
    n = len(token_ids) // block_size if max_blocks is None else min(len(token_ids) // block_size, max_blocks)
    return chained_block_hashes(token_ids, block_size, n, None, salt)


def chained_block_hashes(token_ids, block_size: int, n: int, parent: bytes | None, salt: str = "") -> list[bytes]:
    """prefix_block_hashes of the first `n` whole blocks of `token_ids` when they follow the block named `parent`
    (None: they start the sequence)."""
    tokens = np.asarray(token_ids[:n * block_size], dtype=np.int64)
    if parent is None:
        parent = hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=16).digest() if salt else b""
    out = []
    for b in range(n):
        parent = hashlib.blake2b(parent + tokens[b * block_size:(b + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class KVCacheError(RuntimeError):
    """The page accounting was asked for something impossible (more pages than free, a double free)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagePool:
    """Page ids of one kind with reference counts. Freed pages are reused first (likely still in the GPU's
    cache). With prefix caching a page can carry the hash of the block it holds (register); when its last
    holder lets go it stays readable as an evictable page (counted free, reused last, least recently
    freed first) until an allocation needs it, and `take` revives it for a sequence with that prefix.
    Pages released with `keep` are evicted only after every other evictable page (least recently freed first
    among them too): the sliding pools' windows before likely cuts (BlockManager._kept_sliding)."""

    def __init__(self, kind: str, num_pages: int):
        self.kind = kind
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> hash of the block it holds
        self._page_of: dict[bytes, int] = {}  # block hash -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no holder, still hashed; oldest first
        self._kept: OrderedDict[int, None] = OrderedDict()  # the same, released with `keep`: evicted after those
        self.on_evict = None  # called (page, block hash, kept) when an allocation evicts a cached block (host tier)
        self.output_pages: set[int] = set()  # cached pages whose block a request generated (past its prompt)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable) + len(self._kept)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages holding a registered block (held or evictable)."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise KVCacheError(f"{self.kind} pool: asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:  # evict the least recently freed cached block (kept ones last)
                kept = not self._evictable
                p, _ = (self._kept if kept else self._evictable).popitem(last=False)
                block_hash = self._hash_of.pop(p)
                del self._page_of[block_hash]
                self.output_pages.discard(p)
                if self.on_evict is not None:
                    self.on_evict(p, block_hash, kept)
            self._refs[p] = 1
            pages.append(p)
        return pages

    def release(self, pages, keep=frozenset()) -> None:
        """Drop one holder of each page; a cached page left without holders becomes evictable (`keep`: last)."""
        pages = list(pages)
        if not pages:
            return
        if any(self._refs[p] == 0 for p in pages) or len(set(pages)) != len(pages):
            raise KVCacheError(f"{self.kind} pool: releasing a page that is already free (double free)")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    (self._kept if p in keep else self._evictable)[p] = None
                else:
                    self._free.append(p)

    def register(self, page: int, block_hash: bytes, output: bool = False) -> None:
        """`page` (held) now holds the block `block_hash` names (`output`: a block a request generated); a block
        already cached elsewhere keeps its first page."""
        if block_hash not in self._page_of and page not in self._hash_of:
            self._page_of[block_hash] = page
            self._hash_of[page] = block_hash
            if output:
                self.output_pages.add(page)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._page_of.get(block_hash)

    def touch(self, page: int) -> None:
        """An evictable page becomes the most recently freed (a prompt that recomputes its block wanted it)."""
        for tier in (self._evictable, self._kept):
            if page in tier:
                tier.move_to_end(page)

    def is_held(self, page: int) -> bool:
        return self._refs[page] > 0

    def take(self, page: int) -> int:
        """One more holder of a cached page (reviving it if evictable)."""
        if self._refs[page] == 0:
            del (self._evictable if page in self._evictable else self._kept)[page]
        self._refs[page] += 1
        return page
