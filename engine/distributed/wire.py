"""What rank 0 tells the other ranks, and how it travels.

Every command is one broadcast of a fixed header (opcode, payload kind, length) over the control group,
then, when there is one, a broadcast of the payload: raw bytes or int64 for the per-step messages
(numpy arrays, no pickling) or a pickled object for the rare ones (load). The control
group is always gloo on CPU tensors, so metadata never waits behind the device's queue, and it has a
long timeout because a worker may sit idle between requests for hours.

Legend: T = new tokens, B = sequences, N = sequences that sample.
"""

from __future__ import annotations

import enum
import pickle

import numpy as np
import torch
import torch.distributed as dist

from engine.sequence import PLACEHOLDER
from engine.step_arrays import StepArrays, carried_table, resized_table


class Op(enum.IntEnum):
    LOAD = 1  # object: LoadSpec; build the model shard and its runner
    KV_BUDGET = 2  # none; all-reduce MIN of each rank's KV byte budget
    ALLOCATE = 3  # int64 [num_full_pages, num_sliding_pages]
    STEP = 4  # bytes: pack_step(StepArrays); run the forward
    IMPORT_KV = 5  # int64: pack_slots; then a scatter of each rank's K/V heads
    EXPORT_KV = 6  # int64: pack_slots; then a gather of each rank's K/V heads to rank 0
    UNLOAD = 7  # none; drop the model and its cache (the process stays for the next LOAD)
    SHUTDOWN = 8  # none; leave the loop
    STEP_DELTA = 9  # bytes: pack_step_delta; the previous step one token further, with its changed table rows
    STEP_CARRY = 14  # bytes: pack_step_carry; a step whose batch changed: the table rows it takes from the previous one
    CAPTURE = 10  # int64 buckets; capture the decode step's CUDA graphs at them (their collectives pair up)
    CAPTURE_PREFILL = 11  # int64 token buckets; capture the piecewise prefill graphs (engine/prefill_graphs.py)
    ALLOCATE_HOST = 12  # int64 [host slots per kind]; the prefix cache's host tier (engine/host_kv_tier.py)
    KV_MOVES = 13  # int64: host_kv_tier.pack_moves; copy pages between the K/V cache and the host tier


_NONE, _INT64, _BYTES, _PICKLE = 0, 1, 2, 3


class ControlChannel:
    """Rank 0 sends, every other rank receives, in the same order (one gloo group, CPU tensors)."""

    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank
        self._header = torch.zeros(3, dtype=torch.int64)

    def send(self, op: Op, payload: np.ndarray | object | None = None) -> None:
        """payload: an int64 or uint8 array (sent as is), None, or any picklable object."""
        if isinstance(payload, np.ndarray) and payload.dtype in (np.int64, np.uint8):
            kind = _INT64 if payload.dtype == np.int64 else _BYTES
            data = torch.from_numpy(np.ascontiguousarray(payload))
        elif payload is None:
            kind, data = _NONE, None
        else:
            kind = _PICKLE
            data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
        self._header[0], self._header[1], self._header[2] = int(op), kind, 0 if data is None else data.numel()
        dist.broadcast(self._header, 0, group=self.group)
        if data is not None and data.numel():
            dist.broadcast(data, 0, group=self.group)

    def recv(self) -> tuple[Op, np.ndarray | object | None]:
        dist.broadcast(self._header, 0, group=self.group)
        op, kind, n = (int(x) for x in self._header.tolist())
        if kind == _NONE:
            return Op(op), None
        data = torch.empty(n, dtype=torch.int64 if kind == _INT64 else torch.uint8)
        if n:
            dist.broadcast(data, 0, group=self.group)
        if kind == _PICKLE:
            return Op(op), pickle.loads(data.numpy().tobytes())
        return Op(op), data.numpy()


class _Reader:
    """Consecutive arrays out of one uint8 message, each an owned, writable copy (torch.from_numpy wants that)."""

    def __init__(self, buf: np.ndarray, at: int):
        self.buf, self.at = buf, at

    def take(self, count: int, dtype, shape=None) -> np.ndarray:
        size = count * np.dtype(dtype).itemsize
        out = self.buf[self.at: self.at + size].view(dtype).copy()
        self.at += size
        return out.reshape(shape) if shape is not None else out

    def end(self, what: str) -> None:
        if self.at != len(self.buf):
            raise ValueError(f"{what} has {len(self.buf)} bytes, its header describes {self.at}")


def _message(parts_int64: tuple, parts_int32: tuple) -> np.ndarray:
    """int64 arrays first (every part stays aligned), then int32 ones, as one uint8 array."""
    parts = [np.ascontiguousarray(x, dtype=np.int64) for x in parts_int64] + \
        [np.ascontiguousarray(x, dtype=np.int32) for x in parts_int32]
    return np.concatenate([x.reshape(-1).view(np.uint8) for x in parts])


# ---- a step as one byte array --------------------------------------------------------------------------
# Each array keeps its dtype (page tables stay int32: they are most of the bytes at long contexts);
# int64 arrays come first so every part stays aligned.
_STEP_HEADER = 5  # B, T, N, full table width, sliding table width (int64)


def pack_step(a: StepArrays) -> np.ndarray:
    b, t, n = len(a.full_lens), len(a.input_ids), len(a.logits_indices)
    header = np.array([b, t, n, a.full_tables.shape[1], a.sliding_tables.shape[1]], dtype=np.int64)
    return _message((header, a.input_ids, a.positions, a.full_slots, a.sliding_slots, a.logits_indices,
                     np.asarray(a.sample_rows, dtype=np.int64)),
                    (a.query_start_loc, a.full_tables, a.full_lens, a.sliding_tables, a.sliding_lens))


def unpack_step(buf: np.ndarray) -> StepArrays:
    if buf.dtype != np.uint8 or len(buf) < 8 * _STEP_HEADER:
        raise ValueError(f"a step message is at least {8 * _STEP_HEADER} bytes (uint8); got {len(buf)} {buf.dtype} "
                         "values: rank 0 and this worker run different code")
    b, t, n, pf, ps = (int(x) for x in buf[: 8 * _STEP_HEADER].view(np.int64))
    r = _Reader(buf, 8 * _STEP_HEADER)
    ids, positions, full_slots, sliding_slots = (r.take(t, np.int64) for _ in range(4))
    logits_indices, sample_rows = r.take(n, np.int64), r.take(n, np.int64).tolist()
    a = StepArrays(
        input_ids=ids, positions=positions, query_start_loc=r.take(b + 1, np.int32),
        full_tables=r.take(b * pf, np.int32, (b, pf)), full_lens=r.take(b, np.int32), full_slots=full_slots,
        sliding_tables=r.take(b * ps, np.int32, (b, ps)), sliding_lens=r.take(b, np.int32),
        sliding_slots=sliding_slots, logits_indices=logits_indices, sample_rows=sample_rows)
    r.end("step message")
    return a


def fed_on_device(a: StepArrays) -> bool:
    """The step's host input ids hold placeholders (engine/sequence.PLACEHOLDER): the engine's lookahead
    put tokens not read yet into rank 0's device ids, which rank 0 broadcasts before the forward."""
    return bool((a.input_ids == PLACEHOLDER).any())


# ---- a decode step as a delta of the previous one ----------------------------------------------------------
# Consecutive decode steps of one batch (engine/step_arrays.py's fast path) differ by one position per row
# and a few table rows: the message carries the new ids and slots, the sliding lengths and those rows, not
# every table again (256 sequences at 32k: ~0.1 MB instead of 2.1 MB). Receivers apply it to the step
# they ran last.
_DELTA_HEADER = 6  # B, full width, sliding width, changed full rows, changed sliding rows, base step number


def pack_step_delta(a: StepArrays, full_rows: np.ndarray, sliding_rows: np.ndarray, base: int) -> np.ndarray:
    """`a` as a delta of the step numbered `base` (the previous message): rows are the table rows that changed."""
    b, pf, ps = len(a.full_lens), a.full_tables.shape[1], a.sliding_tables.shape[1]
    header = np.array([b, pf, ps, len(full_rows), len(sliding_rows), base], dtype=np.int64)
    return _message((header, a.input_ids, a.full_slots, a.sliding_slots, full_rows, sliding_rows),
                    (a.sliding_lens, a.full_tables[full_rows], a.sliding_tables[sliding_rows]))


def apply_step_delta(prev: StepArrays | None, prev_number: int, buf: np.ndarray) -> StepArrays:
    """The step a delta message describes, from `prev` (this rank's last step, numbered prev_number)."""
    if buf.dtype != np.uint8 or len(buf) < 8 * _DELTA_HEADER:
        raise ValueError(f"a step delta is at least {8 * _DELTA_HEADER} bytes (uint8); got {len(buf)} {buf.dtype}")
    b, pf, ps, nf, ns, base = (int(x) for x in buf[: 8 * _DELTA_HEADER].view(np.int64))
    if prev is None or base != prev_number or len(prev.full_lens) != b:
        raise ValueError(f"step delta against step {base} of {b} sequences, but this rank last ran step "
                         f"{prev_number} ({'none' if prev is None else len(prev.full_lens)} sequences): "
                         "rank 0 and this worker are out of step")
    r = _Reader(buf, 8 * _DELTA_HEADER)
    ids, full_slots, sliding_slots = (r.take(b, np.int64) for _ in range(3))
    full_rows, sliding_rows = r.take(nf, np.int64), r.take(ns, np.int64)
    sliding_lens = r.take(b, np.int32)
    full, sliding = resized_table(prev.full_tables, pf), resized_table(prev.sliding_tables, ps)
    full[full_rows] = r.take(nf * pf, np.int32, (nf, pf))
    sliding[sliding_rows] = r.take(ns * ps, np.int32, (ns, ps))
    r.end("step delta")
    return StepArrays(input_ids=ids, positions=prev.positions + 1, query_start_loc=prev.query_start_loc,
                      full_tables=full, full_lens=prev.full_lens + 1, full_slots=full_slots, sliding_tables=sliding,
                      sliding_lens=sliding_lens, sliding_slots=sliding_slots, logits_indices=prev.logits_indices,
                      sample_rows=prev.sample_rows)


# ---- a step whose batch changed, as the table rows it carries from the previous one ------------------------
# Under steady traffic most steps change the batch (engine/step_arrays.py's carry path): the message carries the
# step's flat arrays, each row's row in the previous step (-1: new) and the table rows built anew; receivers gather
# the rest from the step they ran last (512 sequences at 8k: ~40 KB instead of ~1 MB).
_CARRY_HEADER = 8  # B, T, N, full width, sliding width, rebuilt full rows, rebuilt sliding rows, base step number


def pack_step_carry(a: StepArrays, source: np.ndarray, full_rows: np.ndarray, sliding_rows: np.ndarray,
                    base: int) -> np.ndarray:
    """`a` as the rows it takes from the step numbered `base` (source[b]: row b's row there, or -1) plus the table
    rows built anew (every row that is not carried, and carried rows whose pages changed)."""
    b, t, n = len(a.full_lens), len(a.input_ids), len(a.logits_indices)
    pf, ps = a.full_tables.shape[1], a.sliding_tables.shape[1]
    header = np.array([b, t, n, pf, ps, len(full_rows), len(sliding_rows), base], dtype=np.int64)
    return _message((header, a.input_ids, a.positions, a.full_slots, a.sliding_slots, a.logits_indices,
                     np.asarray(a.sample_rows, dtype=np.int64), source, full_rows, sliding_rows),
                    (a.query_start_loc, a.full_lens, a.sliding_lens, a.full_tables[full_rows],
                     a.sliding_tables[sliding_rows]))


def apply_step_carry(prev: StepArrays | None, prev_number: int, buf: np.ndarray) -> StepArrays:
    """The step a carry message describes, from `prev` (this rank's last step, numbered prev_number)."""
    if buf.dtype != np.uint8 or len(buf) < 8 * _CARRY_HEADER:
        raise ValueError(f"a step carry is at least {8 * _CARRY_HEADER} bytes (uint8); got {len(buf)} {buf.dtype}")
    b, t, n, pf, ps, nf, ns, base = (int(x) for x in buf[: 8 * _CARRY_HEADER].view(np.int64))
    if prev is None or base != prev_number:
        raise ValueError(f"step carry from step {base}, but this rank last ran step {prev_number}: rank 0 and this "
                         "worker are out of step")
    r = _Reader(buf, 8 * _CARRY_HEADER)
    ids, positions, full_slots, sliding_slots = (r.take(t, np.int64) for _ in range(4))
    logits_indices, sample_rows = r.take(n, np.int64), r.take(n, np.int64).tolist()
    source, full_rows, sliding_rows = r.take(b, np.int64), r.take(nf, np.int64), r.take(ns, np.int64)
    if len(source) and source.max() >= len(prev.full_lens):
        raise ValueError(f"step carry takes row {source.max()} of a step of {len(prev.full_lens)} rows: rank 0 and "
                         "this worker are out of step")
    query_start_loc, full_lens, sliding_lens = r.take(b + 1, np.int32), r.take(b, np.int32), r.take(b, np.int32)
    carried = np.flatnonzero(source >= 0)
    full = carried_table(prev.full_tables, source[carried], carried, b, pf)
    sliding = carried_table(prev.sliding_tables, source[carried], carried, b, ps)
    full[full_rows] = r.take(nf * pf, np.int32, (nf, pf))
    sliding[sliding_rows] = r.take(ns * ps, np.int32, (ns, ps))
    r.end("step carry")
    return StepArrays(input_ids=ids, positions=positions, query_start_loc=query_start_loc, full_tables=full,
                      full_lens=full_lens, full_slots=full_slots, sliding_tables=sliding, sliding_lens=sliding_lens,
                      sliding_slots=sliding_slots, logits_indices=logits_indices, sample_rows=sample_rows)


# ---- K/V slots of one sequence --------------------------------------------------------------------------
def pack_slots(slots: dict[bool, np.ndarray]) -> np.ndarray:
    """{is_sliding: slots} of the kinds the model has -> [has_full, n_full, has_sliding, n_sliding, ...]."""
    full, sliding = slots.get(False), slots.get(True)
    header = [full is not None, 0 if full is None else len(full), sliding is not None,
              0 if sliding is None else len(sliding)]
    return np.concatenate([np.asarray(header, dtype=np.int64), *(s for s in (full, sliding) if s is not None)])


def unpack_slots(buf: np.ndarray) -> dict[bool, np.ndarray]:
    has_full, n_full, has_sliding, n_sliding = (int(x) for x in buf[:4])
    out = {}
    if has_full:
        out[False] = buf[4: 4 + n_full]
    if has_sliding:
        out[True] = buf[4 + n_full: 4 + n_full + n_sliding]
    return out


def flatten_kv(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer K and V [rows, Hkv, Dh] -> their bytes as one flat uint8 tensor (K of every layer, then V),
    for one collective. Bytes, whatever the K/V dtype: float8 pages travel as they are stored (gloo and
    NCCL move uint8 everywhere, float8 not)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in (*ks, *vs)])


def kv_wire_bytes(rows: list[int], heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of flatten_kv's output for these per-layer row counts (K and V)."""
    return 2 * sum(rows) * heads * head_dim * dtype.itemsize


def unflatten_kv(flat: torch.Tensor, rows: list[int], heads: int, head_dim: int,
                 dtype: torch.dtype) -> tuple[list, list]:
    """Inverse of flatten_kv: views of `flat` (uint8) as per-layer K and V of `dtype`; rows[layer] rows."""
    values = flat.view(dtype)
    shapes = [(r, heads, head_dim) for r in rows] * 2
    parts = [p.view(shape) for p, shape in zip(values.split([a * b * c for a, b, c in shapes]), shapes)]
    return parts[: len(rows)], parts[len(rows):]
