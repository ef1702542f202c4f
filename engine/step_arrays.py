"""A scheduled step as host arrays (the flat batch and the paging metadata of kernels/attention/metadata.py),
then as device tensors.

`build_step_arrays` is the one definition: it turns a scheduled step into arrays for the pure-torch
backend and the GPU one alike; with several ranks, rank 0 sends these arrays and every rank builds
identical inputs from them. `StepArrayBuilder` gives the same arrays faster for large batches: for the
common decode step (the sequences of the previous step, one new token each) it updates the previous
step's arrays with numpy over the batch and redoes only the table rows whose pages changed; when the
batch changed (sequences joined, finished or were preempted, a prefill chunk rides along: under steady
traffic most steps) it carries the table rows of the sequences that go on decoding and builds only the
others' (tests/engine/test_step_arrays.py holds both to build_step_arrays).

Legend: T = new tokens in the step, B = sequences, N = sequences that sample, P = pages in a table row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.scheduler import ScheduledSeq
from kernels.attention import AttentionBatch, KVGroupMeta


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attention: AttentionBatch
    logits_indices: torch.Tensor  # int64 [N]: the last token of each sequence that samples
    sample_rows: list[int]  # host: which scheduled entries sample, in logits order
    host: "StepArrays | None" = None  # what these were built from (rank 0 sends it to the other ranks)


@dataclass
class StepArrays:
    """A scheduled step as host arrays, before any device copy. With several ranks, rank 0 sends these
    (engine/distributed/wire.py packs them) and every rank builds identical StepInputs from them."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    full_tables: np.ndarray  # int32 [B, P], padded with page 0
    full_lens: np.ndarray  # int32 [B]
    full_slots: np.ndarray  # int64 [T]
    sliding_tables: np.ndarray  # int32 [B, P]
    sliding_lens: np.ndarray  # int32 [B]
    sliding_slots: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [N]
    sample_rows: list[int]

    def to_inputs(self, device) -> StepInputs:
        """The step's device tensors: on CUDA from one pinned buffer in one copy (`upload`)."""
        query_lens = np.diff(self.query_start_loc).tolist()
        (ids, positions, qsl, logits_indices, full_tables, full_lens, full_slots, sliding_tables, sliding_lens,
         sliding_slots) = upload(device, [self.input_ids, self.positions, self.query_start_loc, self.logits_indices,
                                          self.full_tables, self.full_lens, self.full_slots, self.sliding_tables,
                                          self.sliding_lens, self.sliding_slots])
        attention = AttentionBatch(
            query_start_loc=qsl,
            query_lens_cpu=query_lens,
            full=KVGroupMeta(full_tables, full_lens, full_slots, self.full_lens.tolist()),
            sliding=KVGroupMeta(sliding_tables, sliding_lens, sliding_slots, self.sliding_lens.tolist()),
            is_decode=all(n == 1 for n in query_lens),
        )
        return StepInputs(ids, positions, attention, logits_indices, list(self.sample_rows), self)


def to_device(device, array: np.ndarray) -> torch.Tensor:
    """A host array on `device` (an asynchronous copy where the device allows)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


UPLOAD_ALIGN = 64  # bytes between arrays in an upload: Triton specializes pointers on 16-byte alignment


def upload(device, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Host arrays as tensors on `device`. On CUDA in one copy: packed into one pinned buffer (`pack`), copied
    asynchronously into one device buffer and viewed back per array (`unpack`): one copy per step instead of one
    per array, and none from pageable memory, which CUDA may stage synchronously with the host (the H200 trace of
    an engine decode step, bench.engine_step_profile 2026-12-03, had ten pageable copies per step). The pinned
    block returns to torch's caching host allocator only once its copy has run. Elsewhere each array is
    torch.from_numpy(...).to(device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [to_device(device, a) for a in arrays]
    host, offsets = pack(arrays, pin=True)
    return unpack(host.to(device, non_blocking=True), arrays, offsets)


def pack(arrays: list[np.ndarray], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(one uint8 host tensor holding every array, each at a UPLOAD_ALIGN-aligned byte offset; the offsets)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // UPLOAD_ALIGN) * UPLOAD_ALIGN
    host = torch.empty(max(total, UPLOAD_ALIGN), dtype=torch.uint8, pin_memory=pin)
    flat = host.numpy()
    for a, off in zip(arrays, offsets):
        flat[off: off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offsets


def unpack(buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """Views of a packed uint8 buffer (on any device) with the arrays' dtypes and shapes."""
    return [buffer[off: off + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, off in zip(arrays, offsets)]


def _tables(rows: list) -> np.ndarray:
    width = max(1, max(len(r) for r in rows))
    tables = np.zeros((len(rows), width), dtype=np.int32)  # [B, P], padded with page 0
    for b, row in enumerate(rows):
        if len(row):
            tables[b, : len(row)] = row
    return tables


def _chunk_slots(pages, first_page: int, start: int, end: int, bs: int) -> list[int]:
    """Cache slots of positions start .. end - 1 through a table whose entry 0 is logical page first_page."""
    if end - start <= 16:  # decode rows and short chunks: Python ints beat a dozen tiny numpy calls
        return [int(pages[p // bs - first_page]) * bs + p % bs for p in range(start, end)]
    pos = np.arange(start, end, dtype=np.int64)
    return (np.asarray(pages, dtype=np.int64)[pos // bs - first_page] * bs + pos % bs).tolist()


def _entries(scheduled: list[ScheduledSeq]):
    """(scheduled index, sequence, start, end, token ids or None: the sequence's own, whether it samples) per
    query entry. A chunk is one entry and samples when it reaches the last known token; a decode token with
    a draft (engine/speculative.py) is one single-token entry per position, each sampling, all over the
    sequence's pages."""
    for b, s in enumerate(scheduled):
        if not s.draft:
            yield b, s.seq, s.start, s.end, None, s.end == s.seq.num_tokens
            continue
        for j, token in enumerate((s.seq.token_slice(s.start, s.start + 1)[0], *s.draft)):
            yield b, s.seq, s.start + j, s.start + j + 1, [token], True


def build_step_arrays(scheduled: list[ScheduledSeq], block_size: int) -> StepArrays:
    """Flat batch + paging metadata for both layer kinds, on the host. Call after the scheduler
    allocated pages.

    Full tables hold every page; sliding tables start at the first live page, and their kv_lens
    count from that page's first position. A kind the model lacks gets tables no layer reads. Rows
    are query entries (_entries): a scheduled sequence with a draft has several."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    full_rows, sliding_rows, full_slots, sliding_slots = [], [], [], []
    full_lens, sliding_lens, starts, sample_rows, logits_indices = [], [], [0], [], []
    for b, seq, start, end, tokens, samples in _entries(scheduled):
        ids += seq.token_slice(start, end) if tokens is None else tokens
        positions += range(start, end)
        full = seq.full_pages.array()
        full_rows.append(full)
        full_lens.append(end)
        full_slots += _chunk_slots(full, 0, start, end, bs) if len(full) else [0] * (end - start)
        live = seq.sliding_pages
        sliding_rows.append(live if not len(live) else np.fromiter(live, dtype=np.int32, count=len(live)))
        if len(live):
            sliding_lens.append(end - seq.sliding_first * bs)
            sliding_slots += _chunk_slots(sliding_rows[-1], seq.sliding_first, start, end, bs)
        else:
            sliding_lens.append(0)
            sliding_slots += [0] * (end - start)
        starts.append(starts[-1] + end - start)
        if samples:
            sample_rows.append(b)
            logits_indices.append(starts[-1] - 1)
    return StepArrays(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        query_start_loc=np.asarray(starts, dtype=np.int32),
        full_tables=_tables(full_rows),
        full_lens=np.asarray(full_lens, dtype=np.int32),
        full_slots=np.asarray(full_slots, dtype=np.int64),
        sliding_tables=_tables(sliding_rows),
        sliding_lens=np.asarray(sliding_lens, dtype=np.int32),
        sliding_slots=np.asarray(sliding_slots, dtype=np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        sample_rows=sample_rows,
    )


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int, device) -> StepInputs:
    """StepInputs (device tensors) of a scheduled step: build_step_arrays, then one copy per array."""
    return build_step_arrays(scheduled, block_size).to_inputs(device)


class StepArrayBuilder:
    """build_step_arrays with two fast paths for batches of >= 24.

    `_advance` applies when the step schedules the previous step's sequences in the same order, each
    for exactly the token after the previous one, every row holding pages of both kinds. Otherwise
    `_carry` (a sequence joining, finishing or preempted, a prefill chunk in the step) takes the table
    rows of the sequences that decode the token after their previous step's from that step, rebuilds the
    rest row by row, and computes positions and cache slots with numpy over the whole step. A step with
    drafts (speculative decoding), or after one, builds from scratch. Arrays handed out are never
    modified afterwards.

    Step metadata per decode step inside the engine at context 8k (`python -m bench.engine`, decode
    fast paths section; this machine's CPU, 2026-11-30): batch 64 370 -> 205 us, batch 256 1,391 ->
    528 us, incl. the tensor wrapping; at batch 16 the from-scratch build was cheaper (125 vs 139 us),
    the two crossing near 20."""

    MIN_BATCH = 24

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seqs: list = []
        self._arrays: StepArrays | None = None
        self._full_counts = np.zeros(0, dtype=np.int64)
        self._sliding_firsts = np.zeros(0, dtype=np.int64)
        self._sliding_counts = np.zeros(0, dtype=np.int64)
        self._preemptions = np.zeros(0, dtype=np.int64)
        self.carry = True  # _carry on (the A/B in bench/engine.py and the tests switch it off)
        # After a fast-path build: (the previous arrays, rows whose full table changed, rows whose
        # sliding table changed), what rank 0 needs to send other ranks the step as a delta.
        self.last_delta: tuple[StepArrays, np.ndarray, np.ndarray] | None = None
        # After a _carry build: (the previous arrays, each row's row there or -1, the full and the sliding table rows
        # built here), what rank 0 needs to send the step as the rows it carries (wire.pack_step_carry).
        self.last_carry: tuple[StepArrays, np.ndarray, np.ndarray, np.ndarray] | None = None

    def build(self, scheduled: list[ScheduledSeq]) -> StepArrays:
        self.last_delta = self.last_carry = None
        if len(scheduled) < self.MIN_BATCH:
            self._arrays = None
            return build_step_arrays(scheduled, self.block_size)
        seqs = [s.seq for s in scheduled]
        full_counts = np.fromiter((len(q.full_pages) for q in seqs), dtype=np.int64, count=len(seqs))
        sliding_firsts = np.fromiter((q.sliding_first for q in seqs), dtype=np.int64, count=len(seqs))
        sliding_counts = np.fromiter((len(q.sliding_pages) for q in seqs), dtype=np.int64, count=len(seqs))
        preemptions = np.fromiter((q.num_preemptions for q in seqs), dtype=np.int64, count=len(seqs))
        if self._continues(scheduled, seqs) and full_counts.all() and sliding_counts.all() \
                and np.array_equal(preemptions, self._preemptions):
            full_changed = np.flatnonzero(full_counts != self._full_counts)
            sliding_changed = np.flatnonzero((sliding_counts != self._sliding_counts)
                                             | (sliding_firsts != self._sliding_firsts))
            self.last_delta = (self._arrays, full_changed, sliding_changed)
            arrays = self._advance(seqs, full_counts, sliding_firsts, sliding_counts, full_changed, sliding_changed)
        elif self._arrays is not None and self.carry and not any(s.draft for s in scheduled):
            arrays = self._carry(scheduled, seqs, full_counts, sliding_firsts, sliding_counts, preemptions)
        else:
            arrays = build_step_arrays(scheduled, self.block_size)
            if any(s.draft for s in scheduled):  # rows are query entries, not sequences: nothing to carry from
                self._arrays = None
                return arrays
        self._seqs, self._arrays, self._preemptions = seqs, arrays, preemptions
        self._full_counts, self._sliding_firsts, self._sliding_counts = full_counts, sliding_firsts, sliding_counts
        return arrays

    def _continues(self, scheduled: list[ScheduledSeq], seqs: list) -> bool:
        prev = self._arrays
        if prev is None or len(seqs) != len(self._seqs) or len(prev.input_ids) != len(seqs) \
                or len(prev.sample_rows) != len(seqs):
            return False
        # each row: the same sequence, one token, one position further, its last known one (the properties
        # `end` and `num_tokens` and numpy's scalar reads inlined: this runs for every row every step)
        for s, was, last in zip(scheduled, self._seqs, prev.positions.tolist()):
            seq = s.seq
            if seq is not was or s.num_tokens != 1 or s.start != last + 1 or not seq.output_ids \
                    or s.start + 1 != len(seq.prompt_ids) + len(seq.output_ids):
                return False
        return True

    def _advance(self, seqs: list, full_counts: np.ndarray, sliding_firsts: np.ndarray, sliding_counts: np.ndarray,
                 full_changed: np.ndarray, sliding_changed: np.ndarray) -> StepArrays:
        prev, bs, rows = self._arrays, self.block_size, np.arange(len(seqs))
        positions = prev.positions + 1
        full = self._patched(prev.full_tables, full_counts, full_changed, lambda q: q.full_pages.array(), seqs)
        sliding = self._patched(prev.sliding_tables, sliding_counts, sliding_changed,
                                lambda q: np.fromiter(q.sliding_pages, dtype=np.int32, count=len(q.sliding_pages)),
                                seqs)
        return StepArrays(
            input_ids=np.fromiter((q.output_ids[-1] for q in seqs), dtype=np.int64, count=len(seqs)),
            positions=positions,
            query_start_loc=prev.query_start_loc,
            full_tables=full,
            full_lens=prev.full_lens + 1,
            full_slots=full[rows, positions // bs].astype(np.int64) * bs + positions % bs,
            sliding_tables=sliding,
            sliding_lens=(positions + 1 - sliding_firsts * bs).astype(np.int32),
            sliding_slots=sliding[rows, positions // bs - sliding_firsts].astype(np.int64) * bs + positions % bs,
            logits_indices=prev.logits_indices,
            sample_rows=prev.sample_rows,
        )

    def _carry(self, scheduled: list[ScheduledSeq], seqs: list, full_counts: np.ndarray, sliding_firsts: np.ndarray,
               sliding_counts: np.ndarray, preemptions: np.ndarray) -> StepArrays:
        """build_step_arrays' arrays, taking from the previous step the table rows of the sequences that decode
        the token after the one they computed there (not preempted since); every other row is built here."""
        prev, bs, n_rows = self._arrays, self.block_size, len(scheduled)
        # (ids are unique: self._seqs holds the previous step's sequences alive)
        row_of = {id(q): j for j, q in enumerate(self._seqs)}
        prev_ends, prev_preemptions = prev.full_lens.tolist(), self._preemptions.tolist()
        source = [-1] * n_rows  # the carried rows' rows in the previous step
        ids: list[int] = []
        starts, ends, sample_rows = [], [], []
        for b, s in enumerate(scheduled):  # (runs for every row of most steps: kept lean)
            seq, start, n = s.seq, s.start, s.num_tokens
            out = seq.output_ids
            end, known = start + n, len(seq.prompt_ids) + len(out)
            starts.append(start)
            ends.append(end)
            if end == known:
                sample_rows.append(b)
                if n == 1:
                    j = row_of.get(id(seq), -1)
                    if j >= 0 and prev_ends[j] == start and prev_preemptions[j] == seq.num_preemptions:
                        source[b] = j
                        ids.append(out[-1] if out else seq.prompt_ids[-1])
                        continue
            ids += seq.token_slice(start, end)
        source_np = np.asarray(source, dtype=np.int64)
        carried = np.flatnonzero(source_np >= 0)
        was = source_np[carried]
        full, full_built = self._carried_table(prev.full_tables, full_counts, carried, was,
                                               (full_counts[carried] != self._full_counts[was]),
                                               lambda q: q.full_pages.array(), seqs)
        sliding, sliding_built = self._carried_table(
            prev.sliding_tables, sliding_counts, carried, was,
            (sliding_counts[carried] != self._sliding_counts[was]) | (sliding_firsts[carried] != self._sliding_firsts[was]),
            lambda q: np.fromiter(q.sliding_pages, dtype=np.int32, count=len(q.sliding_pages)), seqs)
        self.last_carry = (prev, source_np, full_built, sliding_built)
        starts_np, ends_np = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        query_start_loc = np.zeros(n_rows + 1, dtype=np.int32)
        np.cumsum(ends_np - starts_np, out=query_start_loc[1:])
        row = np.repeat(np.arange(n_rows), ends_np - starts_np)  # each token's row
        positions = np.arange(len(row), dtype=np.int64) - query_start_loc[row] + starts_np[row]
        has_full, has_sliding = full_counts[row] > 0, sliding_counts[row] > 0
        full_page = full[row, np.where(has_full, positions // bs, 0)].astype(np.int64)
        sliding_page = sliding[row, np.where(has_sliding, positions // bs - sliding_firsts[row], 0)].astype(np.int64)
        return StepArrays(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=positions,
            query_start_loc=query_start_loc,
            full_tables=full,
            full_lens=ends_np.astype(np.int32),
            full_slots=np.where(has_full, full_page * bs + positions % bs, 0),
            sliding_tables=sliding,
            sliding_lens=np.where(sliding_counts > 0, ends_np - sliding_firsts * bs, 0).astype(np.int32),
            sliding_slots=np.where(has_sliding, sliding_page * bs + positions % bs, 0),
            logits_indices=query_start_loc[1:][sample_rows].astype(np.int64) - 1,
            sample_rows=sample_rows,
        )

    @staticmethod
    def _carried_table(prev: np.ndarray, counts: np.ndarray, carried: np.ndarray, was: np.ndarray,
                       changed: np.ndarray, pages_of, seqs: list) -> tuple[np.ndarray, np.ndarray]:
        """A [B, P] table (as wide as build_step_arrays makes it): the carried rows' from the previous step's
        rows `was` (carried_table), except those `changed`; those and every other row from the sequences' pages.
        And the rows built here."""
        table = carried_table(prev, was, carried, len(seqs), max(1, int(counts.max())))
        built = np.ones(len(seqs), dtype=bool)
        built[carried] = changed
        rows = np.flatnonzero(built)
        _rebuild_rows(table, rows, counts, pages_of, seqs)
        return table, rows

    @staticmethod
    def _patched(prev: np.ndarray, counts: np.ndarray, changed: np.ndarray, pages_of, seqs: list) -> np.ndarray:
        """The previous step's table with the changed rows rebuilt; as wide as build_step_arrays makes it."""
        table = resized_table(prev, max(1, int(counts.max())))
        _rebuild_rows(table, changed, counts, pages_of, seqs)
        return table


def _rebuild_rows(table: np.ndarray, rows: np.ndarray, counts: np.ndarray, pages_of, seqs: list) -> None:
    """Rows `rows` of a page table anew from their sequences' pages (`pages_of`), zero-padded."""
    for b in rows.tolist():
        table[b] = 0
        table[b, : counts[b]] = pages_of(seqs[b])


def carried_table(prev: np.ndarray, was: np.ndarray, rows: np.ndarray, batch: int, width: int) -> np.ndarray:
    """A zero [batch, width] page table whose `rows` hold rows `was` of the previous step's table `prev` (cut or
    zero-padded to `width`): what rank 0's carry path and the other ranks (wire.apply_step_carry) start from."""
    table = np.zeros((batch, width), dtype=np.int32)
    keep = min(width, prev.shape[1])
    table[rows, :keep] = prev[was, :keep]
    return table


def resized_table(prev: np.ndarray, width: int) -> np.ndarray:
    """A copy of a [B, P] page table, cut or zero-padded to `width` columns."""
    table = np.zeros((prev.shape[0], width), dtype=np.int32)
    keep = min(width, prev.shape[1])
    table[:, :keep] = prev[:, :keep]
    return table
