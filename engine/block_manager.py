"""KV page accounting: two pools (full-attention layers, sliding-window layers) and each sequence's tables.

Full layers keep every page of a sequence. Sliding layers keep a deque of live pages: once the next
query (at position p = num_computed) can no longer see any key of a page (it sees p - window + 1 .. p),
the page goes back to the pool. A decoding sequence therefore holds at most
ceil((window - 1) / block_size) + 1 sliding pages, whatever its length; a prefill chunk of c tokens
holds the pages covering window - 1 + c tokens for the duration of the step.

Prefix caching (opt-in, EngineConfig.enable_prefix_caching): each whole prompt block computed is
registered in both pools under a chain hash of every token up to its end, and a new sequence starts
from the longest prefix whose blocks are cached: every full-layer page of it, and the sliding-layer
pages its first query still sees (the window before the cut). Pages nobody holds stay readable until
an allocation evicts them. At least one prompt token is always computed (its logits give the first
sample). The K/V is the same as computing the prefix again (chunked prefill reads it the same way).

With a host tier (engine/host_kv_tier.py) an evicted cached page is first copied to a host slot, and a new
sequence whose prefix goes on past what the GPU holds takes those blocks back into fresh pages
(`extend_from_host`); the copies are recorded in `moves` for the runner to perform before the next forward.

The pools themselves (reference counts, evictable cached pages) are engine/page_pool.py. Only page ids move
here; the tensors live in kernels/attention/kv_cache.py (PagedKVCache).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from engine.host_kv_tier import HostPool, KVMoves
from engine.page_pool import KVCacheError, PagePool, cdiv, chained_block_hashes, prefix_block_hashes
from engine.sequence import PLACEHOLDER, Sequence

MAX_CUTS = 65_536  # cut points remembered (BlockManager._cuts)


class BlockManager:
    """Allocates and frees the pages of sequences in both pools.

    A model without layers of one kind (a 1-layer test model has no full layer) gets no pool for it,
    and that kind never limits scheduling. `host_slots` (full, sliding) > 0 (with prefix caching) adds the host
    tier: that many host slots of each kind (engine/host_kv_tier.host_slots_for)."""

    def __init__(self, block_size: int, sliding_window: int, num_full_pages: int, num_sliding_pages: int,
                 has_full: bool = True, has_sliding: bool = True, prefix_caching: bool = False,
                 host_slots: tuple[int, int] = (0, 0)):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.full = PagePool("full", num_full_pages) if has_full else None
        self.sliding = PagePool("sliding", num_sliding_pages) if has_sliding else None
        self.prefix_caching = prefix_caching
        self.prefix_query_tokens = 0  # prompt tokens of admitted sequences, and how many came from the cache
        self.prefix_hit_tokens = 0
        self.host_hit_tokens = 0  # of those, how many came from the host tier
        self.host: dict[str, HostPool] = {}  # kind -> its host pool (the host tier; empty: none)
        self.moves = KVMoves()  # page copies decided, not yet performed (the runner takes them before a step)
        # hashes of blocks that end a prefix some prompt was cut at (a hit, or a full-layer hit the sliding
        # window missed) or that a request's cache_cuts named: their windows are kept longer (_kept_sliding);
        # least recently noted out
        self._cuts: OrderedDict[bytes, None] = OrderedDict()
        if any(host_slots) and prefix_caching:
            for pool, slots in zip((self.full, self.sliding), host_slots):
                if pool is not None and slots:
                    self.host[pool.kind] = HostPool(pool.kind, slots)
                    pool.on_evict = self._offloader(pool.kind)

    def _offloader(self, kind: str):
        host, moves = self.host[kind], self.moves

        def offload(page: int, block_hash: bytes, kept: bool) -> None:
            """An evicted cached block: copy it to a host slot, unless the host tier holds it already; of the
            sliding pool only the windows it kept (the others a later prompt needs only if it leaves this one
            exactly there: the first prompt to do so computes it, and its window is kept from then on)."""
            if kind == "sliding" and not kept:
                return
            slot = host.lookup(block_hash)
            if slot is not None:
                host.touch(slot)
                return
            slot = host.store(block_hash)
            if slot is not None:
                moves.add(kind, True, page, slot)
        return offload

    # ---- capacity queries -----------------------------------------------------------------------
    def _full_needed(self, seq: Sequence, total: int) -> int:
        return max(0, cdiv(total, self.block_size) - len(seq.full_pages))

    def _sliding_needed(self, seq: Sequence, total: int) -> int:
        return max(0, cdiv(total, self.block_size) - (seq.sliding_first + len(seq.sliding_pages)))

    def can_hold(self, seq: Sequence, total: int) -> bool:
        """Whether free pages suffice for `seq` to have slots for positions 0 .. total - 1."""
        if self.full is not None and self._full_needed(seq, total) > self.full.num_free:
            return False
        if self.sliding is not None and self._sliding_needed(seq, total) > self.sliding.num_free:
            return False
        return True

    def max_new_tokens(self, seq: Sequence, limit: int) -> int:
        """The largest n <= limit such that positions num_computed .. num_computed + n - 1 get slots."""
        bs, n = self.block_size, limit
        if self.full is not None:
            n = min(n, (len(seq.full_pages) + self.full.num_free) * bs - seq.num_computed)
        if self.sliding is not None:
            held = seq.sliding_first + len(seq.sliding_pages)
            n = min(n, (held + self.sliding.num_free) * bs - seq.num_computed)
        return max(0, n)

    def first_visible_position(self, num_computed: int) -> int:
        """The oldest position the next query (at num_computed) still sees in a sliding layer."""
        return max(0, num_computed - self.sliding_window + 1)

    # ---- changes ----------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, total: int) -> None:
        """Give `seq` slots for positions up to total - 1 in both kinds (no-op where it has them)."""
        need_full = self._full_needed(seq, total) if self.full is not None else 0
        need_sliding = self._sliding_needed(seq, total) if self.sliding is not None else 0
        if not need_full and not need_sliding:  # most decode steps: the last page has room
            return
        if (need_full and need_full > self.full.num_free) or (need_sliding and need_sliding > self.sliding.num_free):
            raise KVCacheError(f"request {seq.request_id}: not enough free pages for {total} tokens")
        if need_full:
            seq.full_pages.extend(self.full.allocate(need_full))
        if need_sliding:
            seq.sliding_pages.extend(self.sliding.allocate(need_sliding))

    def allocate_next_tokens(self, seqs: list[Sequence]) -> bool:
        """Slots for one more token (position num_computed) for every one of `seqs`, or for none of them
        (False: not enough free pages). Same pages as allocate(seq, num_computed + 1) one by one; batched
        for the decode step, where most sequences need no new page."""
        # _full_needed / _sliding_needed at total = num_computed + 1, inlined: this runs for every decoding
        # sequence every step, and the calls doubled the scheduler's time (bench/engine.py, 2026-11-30).
        bs = self.block_size
        need_full = [(s, n) for s in seqs if (n := -(-(s.num_computed + 1) // bs) - len(s.full_pages)) > 0] \
            if self.full is not None else []
        need_sliding = [(s, n) for s in seqs
                        if (n := -(-(s.num_computed + 1) // bs) - s.sliding_first - len(s.sliding_pages)) > 0] \
            if self.sliding is not None else []
        if (need_full and sum(n for _, n in need_full) > self.full.num_free) or \
                (need_sliding and sum(n for _, n in need_sliding) > self.sliding.num_free):
            return False
        for s, n in need_full:
            s.full_pages.extend(self.full.allocate(n))
        for s, n in need_sliding:
            s.sliding_pages.extend(self.sliding.allocate(n))
        return True

    def start_sliding_at(self, seq: Sequence, position: int) -> None:
        """For a sequence with no pages yet whose sliding layers hold K/V from `position` on (an import)."""
        if len(seq.full_pages) or seq.sliding_pages:
            raise KVCacheError(f"request {seq.request_id} already holds pages")
        seq.sliding_first = position // self.block_size
        seq.sliding_named_from = cdiv(position, self.block_size)  # the first page may be partly unwritten

    def release_out_of_window(self, seq: Sequence) -> int:
        """Free the sliding pages the next query can no longer see; returns how many were freed."""
        if self.sliding is None:
            return 0
        first_needed_page = self.first_visible_position(seq.num_computed) // self.block_size
        if seq.sliding_first >= first_needed_page:  # most steps: nothing left the window
            return 0
        freed, first_freed = [], seq.sliding_first
        while seq.sliding_pages and seq.sliding_first < first_needed_page:
            freed.append(seq.sliding_pages.popleft())
            seq.sliding_first += 1
        if not seq.sliding_pages:
            seq.sliding_first = max(seq.sliding_first, first_needed_page)
        self.sliding.release(freed, self._kept_sliding(seq, first_freed, freed))
        return len(freed)

    def after_forward(self, seqs: list[Sequence]) -> None:
        """register_blocks then release_out_of_window for each of `seqs` (their num_computed just advanced by a
        step), with both early outs inlined: at a decode step most sequences complete no prompt block and leave
        no page behind the window, and the two calls per sequence were a tenth of the host's step at batch 512
        (bench/engine.py)."""
        bs, caching = self.block_size, self.prefix_caching
        window = self.sliding_window if self.sliding is not None else None
        for seq in seqs:
            computed = seq.num_computed
            if caching and min(computed, len(seq.prompt_ids)) // bs > seq.num_registered:
                self.register_blocks(seq)
            if window is not None and (computed - window + 1) // bs > seq.sliding_first:
                self.release_out_of_window(seq)

    # ---- prefix caching ------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence) -> list[bytes]:
        if seq.block_hashes is None:
            seq.block_hashes = prefix_block_hashes(seq.prompt_ids, self.block_size, salt=seq.cache_salt)
        return seq.block_hashes

    def _first_sliding_block(self, num_blocks: int) -> int:
        return self.first_visible_position(num_blocks * self.block_size) // self.block_size

    def take_cached_prefix(self, seq: Sequence) -> int:
        """A new sequence (no pages, nothing computed) takes the pages of its longest cached prompt prefix
        (whole blocks, at least one prompt token left to compute); returns the tokens it skips."""
        if not self.prefix_caching or seq.num_computed or len(seq.full_pages) or seq.sliding_pages:
            return 0
        hashes = self._hashes(seq)
        k, full_k = self._longest_cached(hashes, (len(seq.prompt_ids) - 1) // self.block_size)
        if self.sliding is not None:
            # where this prompt leaves the cached ones, and where its sender expects others to leave it: keep
            # the windows there
            cuts = {full_k, k} | {p // self.block_size for p in seq.cache_cuts}  # (validated: p <= len(prompt))
            for cut in cuts - {0}:
                self._cuts[hashes[cut - 1]] = None
                self._cuts.move_to_end(hashes[cut - 1])
            while len(self._cuts) > MAX_CUTS:
                self._cuts.popitem(last=False)
            if self.full is not None:  # the full-layer pages past the window's cut are computed again, not
                for b in range(k, full_k):  # taken: keep the cached ones as fresh as if they had been
                    self.full.touch(self.full.lookup(hashes[b]))
        if k == 0:
            return 0
        if self.full is not None:
            seq.full_pages.extend([self.full.take(self.full.lookup(h)) for h in hashes[:k]])
        if self.sliding is not None:
            seq.sliding_first = self._first_sliding_block(k)
            seq.sliding_pages.extend(self.sliding.take(self.sliding.lookup(hashes[j]))
                                     for j in range(seq.sliding_first, k))
        seq.num_computed, seq.num_registered = k * self.block_size, k
        return k * self.block_size

    def _longest_cached(self, hashes: list[bytes], k: int) -> tuple[int, int]:
        """(the blocks of the longest prefix of at most `k` blocks whose full-layer pages and last-window sliding
        pages are all cached, the blocks whose full-layer pages are)."""
        if self.full is not None:
            k = next((i for i in range(k) if self.full.lookup(hashes[i]) is None), k)
        full_k = k
        if self.sliding is not None:
            while k and any(self.sliding.lookup(hashes[j]) is None for j in range(self._first_sliding_block(k), k)):
                k -= 1
        return k, full_k

    def cached_prefix(self, prompt_ids: list[int], cache_salt: str = "") -> tuple[int, bool]:
        """(the tokens of a prompt that take_cached_prefix would find cached now, whether the last of their blocks
        is one a request here generated: the prompt continues an output of this engine), changing nothing (a hint
        for another thread: the pages may go before the prompt is admitted)."""
        if not self.prefix_caching or len(prompt_ids) < 2:
            return 0, False
        k = (len(prompt_ids) - 1) // self.block_size
        hashes = prefix_block_hashes(prompt_ids, self.block_size, k, salt=cache_salt)
        k = self._longest_cached(hashes, k)[0]
        pool = self.full if self.full is not None else self.sliding
        return k * self.block_size, k > 0 and pool.lookup(hashes[k - 1]) in pool.output_pages

    def _kept_sliding(self, seq: Sequence, first_block: int, pages) -> set[int]:
        """Of the sliding pages holding blocks first_block, first_block + 1, ... of `seq`, those a later prompt is
        likely to need: in the window before the end of this prompt (its next turn continues it whole, the same
        prompt again stops a token short) or before a cut some prompt was seen to be cut at (a shared system
        prompt's end). A prompt's other windows are needed only by a prompt that leaves it exactly there, and
        cost as many pages as its full layers do (each 2k-token prompt ~128 pages), so they go first: four
        prompts of other tenants evicted a shared 2k-token prefix's window from 20b's sliding pool, while its
        full-layer pages stayed (2026-12-05)."""
        if not self.prefix_caching or not pages:
            return set()
        hashes = self._hashes(seq)
        # the prompt's whole blocks: where a next turn cuts it; one block less: where the same prompt again does
        ends = [len(seq.prompt_ids) // self.block_size, (len(seq.prompt_ids) - 1) // self.block_size]
        span = cdiv(self.sliding_window, self.block_size) + 1  # blocks of the window before a cut, at most
        last = min(first_block + len(pages) + span, len(hashes))
        ends += [c for c in range(first_block + 1, last + 1) if hashes[c - 1] in self._cuts]
        keep = set()
        for i, page in enumerate(pages):
            b = first_block + i
            if b < len(hashes) and any(self._first_sliding_block(c) <= b < c for c in ends):
                keep.add(page)
        return keep

    def extend_from_host(self, seq: Sequence, budget: int) -> int:
        """After take_cached_prefix: take the blocks that follow from the host tier (or from the GPU, once a
        host block bridged a gap), as far as the pages allow with room left for a first chunk of
        min(rest of the prompt, budget) tokens, copying each host block into a fresh page (recorded in
        `moves`). Returns the tokens gained (0 without a host tier)."""
        if not self.host or seq.num_computed != seq.num_registered * self.block_size:
            return 0  # (not a sequence just admitted with its cached prefix)
        bs, hashes = self.block_size, self._hashes(seq)
        k0, top = seq.num_computed // bs, (len(seq.prompt_ids) - 1) // bs
        host_full, host_sliding = self.host.get("full"), self.host.get("sliding")

        def cached(pool: PagePool, host: HostPool | None, block_hash: bytes) -> bool:
            return pool.lookup(block_hash) is not None or (host is not None and host.lookup(block_hash) is not None)

        def uses_free_page(pool: PagePool, b: int) -> bool:  # taking block b: a fresh or revived page, not a held one
            return (p := pool.lookup(hashes[b])) is None or not pool.is_held(p)

        k = k0
        if self.full is not None:
            while k < top and cached(self.full, host_full, hashes[k]):
                k += 1
            new_full = np.cumsum([0] + [uses_free_page(self.full, b) for b in range(k0, k)])
        else:
            k = top
        while k > k0:  # the longest extension whose sliding window is cached and whose pages fit
            chunk = cdiv(min(seq.num_tokens - k * bs, budget), bs)  # (a preempted sequence recomputes its output too)
            window = range(self._first_sliding_block(k), k)
            fits = self.full is None or new_full[k - k0] + chunk <= self.full.num_free
            if fits and self.sliding is not None:
                fits = all(cached(self.sliding, host_sliding, hashes[j]) for j in window) \
                    and sum(uses_free_page(self.sliding, j) for j in window) + chunk <= self.sliding.num_free
            if fits:
                break
            k -= 1
        if k == k0:
            return 0
        if self.full is not None:
            seq.full_pages.extend(self._take_blocks(self.full, host_full, hashes, range(k0, k), {}))
        if self.sliding is not None:
            held = {seq.sliding_first + i: p for i, p in enumerate(seq.sliding_pages)}
            first = self._first_sliding_block(k)
            pages = self._take_blocks(self.sliding, host_sliding, hashes, range(first, k), held)
            self.sliding.release([p for j, p in held.items() if j < first])  # the old window's first pages
            seq.sliding_first, seq.sliding_pages = first, deque(pages)
        seq.num_computed, seq.num_registered = k * bs, k
        self.host_hit_tokens += (k - k0) * bs
        return (k - k0) * bs

    def _take_blocks(self, pool: PagePool, host: HostPool | None, hashes: list[bytes], blocks, held: dict[int, int]
                     ) -> list[int]:
        """Pages holding `blocks` for a sequence: its own (`held`, by block), cached ones taken, the rest
        fresh pages the host tier's copies are moved into. Every cached page is taken, and the host slots to
        read are pinned, before the fresh pages are allocated, so the evictions that makes cannot drop them."""
        pages: dict[int, int] = {}
        from_host = []
        for b in blocks:
            if b in held:
                pages[b] = held[b]
            elif (p := pool.lookup(hashes[b])) is not None:
                pages[b] = pool.take(p)
            else:
                from_host.append((b, host.lookup(hashes[b])))
        host_slots = [slot for _, slot in from_host]
        if host is not None:
            host.pin(host_slots)
        try:
            for (b, slot), page in zip(from_host, pool.allocate(len(from_host))):
                pages[b] = page
                pool.register(page, hashes[b])
                self.moves.add(pool.kind, False, page, slot)
                host.touch(slot)
        finally:
            if host is not None:
                host.unpin_all()
        return [pages[b] for b in blocks]

    def register_blocks(self, seq: Sequence) -> None:
        """Name the whole prompt blocks `seq` has computed since the last call (after a step's forward is
        queued: whoever reads them later is queued after it)."""
        if not self.prefix_caching:
            return
        done = min(seq.num_computed, len(seq.prompt_ids)) // self.block_size
        if done <= seq.num_registered:
            return
        hashes = self._hashes(seq)
        for b in range(seq.num_registered, done):
            self._register_block(seq, b, hashes[b])
        seq.num_registered = done

    def _register_block(self, seq: Sequence, b: int, block_hash: bytes, output: bool = False) -> None:
        """Block `b` of `seq` is `block_hash`: its full-layer page, and its sliding page where one holds it whole."""
        if self.full is not None:
            self.full.register(seq.full_pages[b], block_hash, output)
        if self.sliding is not None and max(seq.sliding_first, seq.sliding_named_from) <= b \
                < seq.sliding_first + len(seq.sliding_pages):
            self.sliding.register(seq.sliding_pages[b - seq.sliding_first], block_hash, output)

    def _name_output_blocks(self, seq: Sequence) -> int:
        """Name (register) the whole blocks past the prompt whose K/V `seq` computed and whose tokens are known (not
        placeholders of steps in flight), chained after the prompt's: a later prompt that continues this output (a
        conversation's next turn, a stream taken up elsewhere) starts from them. The blocks named up to (0: none)."""
        bs, out = self.block_size, seq.output_ids
        known = len(out)
        while known and out[known - 1] == PLACEHOLDER:
            known -= 1
        first, end = len(seq.prompt_ids) // bs, min(seq.num_computed, len(seq.prompt_ids) + known) // bs
        if end <= first or seq.num_registered != first or (self.full is not None and len(seq.full_pages) < end):
            return 0  # (the prompt's own blocks are all named by now; a sequence retired early holds no pages)
        prompt_hashes = self._hashes(seq)
        hashes = chained_block_hashes(seq.token_slice(first * bs, end * bs), bs, end - first,
                                      prompt_hashes[first - 1] if first else None, seq.cache_salt)
        for b, block_hash in enumerate(hashes, start=first):
            self._register_block(seq, b, block_hash, output=True)
        return end

    def blocks_computed(self, seq: Sequence, start: int, end: int) -> set[bytes]:
        """Hashes of the whole prompt blocks positions start .. end - 1 complete (a step's chunk)."""
        if not self.prefix_caching:
            return set()
        bs, hashes = self.block_size, self._hashes(seq)
        return {hashes[b] for b in range(start // bs, min(end, len(seq.prompt_ids)) // bs) if b * bs >= start}

    def next_block(self, seq: Sequence) -> bytes | None:
        """The hash of the whole prompt block `seq` computes next (None: no whole block left)."""
        hashes = self._hashes(seq) if self.prefix_caching else []
        b = seq.num_computed // self.block_size
        return hashes[b] if b < len(hashes) else None

    def take_moves(self) -> list[tuple[str, bool, list[int], list[int]]]:
        """The page copies decided since the last call, in order (engine/host_kv_tier.py), to perform now."""
        return self.moves.take() if self.moves else []

    def reset_counters(self) -> None:
        """The prefix cache's and the host tier's counters back to zero (LLMEngine.reset_metrics)."""
        self.prefix_query_tokens = self.prefix_hit_tokens = self.host_hit_tokens = 0
        self.moves.pages_to_host = self.moves.pages_to_device = 0

    def note_admitted(self, seq: Sequence, hit_tokens: int) -> None:
        if self.prefix_caching:
            self.prefix_query_tokens += len(seq.prompt_ids)
            self.prefix_hit_tokens += hit_tokens

    def free(self, seq: Sequence) -> None:
        """Return every page of `seq` (finish, abort, preemption, export), its output's whole blocks named first."""
        named = self._name_output_blocks(seq) if self.prefix_caching and seq.output_ids else 0
        seq.num_registered = seq.sliding_named_from = 0
        full = seq.full_pages.clear()
        if self.full is not None:
            self.full.release(full)
        if self.sliding is not None:
            keep = self._kept_sliding(seq, seq.sliding_first, seq.sliding_pages)
            if named:  # the window before the output's end: where the next turn of a conversation continues it
                first = self._first_sliding_block(named)
                keep |= {p for i, p in enumerate(seq.sliding_pages) if first <= seq.sliding_first + i < named}
            self.sliding.release(seq.sliding_pages, keep)
        seq.sliding_pages = deque()
        seq.sliding_first = 0

    # ---- sizes ------------------------------------------------------------------------------------
    def sliding_pages_per_decode(self) -> int:
        """Live sliding pages of one decoding sequence at most (the window may straddle a page edge)."""
        return cdiv(self.sliding_window - 1, self.block_size) + 1

    def too_small_for(self, max_model_len: int) -> str | None:
        """Why one max_model_len sequence cannot fit the pools alone (a long request would never run: a
        deadlock), in the engine config's terms; None when it fits."""
        bs = self.block_size
        if self.full is not None and self.full.num_pages < cdiv(max_model_len, bs):
            return (f"the full-layer pool has {self.full.num_pages} pages of {bs} tokens, fewer than one max_model_len="
                    f"{max_model_len} sequence needs ({cdiv(max_model_len, bs)}): raise kv_cache_bytes "
                    f"(or num_full_pages) or lower max_model_len")
        if self.sliding is not None and self.sliding.num_pages < self.sliding_pages_per_decode():
            return (f"the sliding-layer pool has {self.sliding.num_pages} pages; one sequence needs "
                    f"{self.sliding_pages_per_decode()} to cover the window: raise num_sliding_pages")
        return None

    def usage(self) -> dict[str, int]:
        out = {}
        for pool in (self.full, self.sliding):
            if pool is not None:
                out[f"{pool.kind}_pages_used"] = pool.num_used
                out[f"{pool.kind}_pages_free"] = pool.num_free
                out[f"{pool.kind}_pages_total"] = pool.num_pages
                if self.prefix_caching:
                    out[f"{pool.kind}_pages_cached"] = pool.num_cached
        if self.prefix_caching:
            out["prefix_query_tokens"], out["prefix_hit_tokens"] = self.prefix_query_tokens, self.prefix_hit_tokens
        for kind, host in self.host.items():
            out[f"host_{kind}_slots_used"], out[f"host_{kind}_slots_total"] = host.num_used, host.num_slots
        if self.host:
            out["host_hit_tokens"] = self.host_hit_tokens
            out["host_pages_stored"], out["host_pages_loaded"] = self.moves.pages_to_host, self.moves.pages_to_device
        return out
