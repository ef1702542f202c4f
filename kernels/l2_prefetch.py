"""L2 prefetch of decode weights on a side stream, into the gaps the small kernels leave (Hopper).

At batch 1 a decode step is a chain of weight streams (QKV, O, expert GEMMs: 25-70 MB each) and small
latency-bound kernels (rotary, attention on short windows, merges, norms, routing, SwiGLU, combine:
~25 us per 20b layer) during which the memory system is mostly idle. The weights of QKV and O do not
depend on the step's data, and the active experts' down weights are known once the router has run,
so they can be pulled into the 50 MB L2 during those gaps; the GEMM that reads them afterwards hits
L2 for what arrived in time. Nothing waits on a prefetch: it only moves data earlier, so results are
bitwise the same with and without (GPU test).

`issue(tensors, num_tokens)` forks a side stream at the current point of the current stream (it
starts when the kernel launched last has completed) and launches one kernel per tensor there, each
program issuing `cp.async.bulk.prefetch.L2` for CHUNK-byte pieces (the copy engine fetches, no
registers hold the data). `issue_experts` does the same for rows of a stacked [E, ...] weight listed
on the device (the masked plan's active experts). `join(t)` makes the current stream wait for the side
stream: every captured forward calls it before it ends (a graph capture must rejoin its forks).

Active on SM90+ CUDA tensors for steps of at most MAX_TOKENS tokens, only while a CUDA graph is being
captured (like kernels/pdl.py: graph replay is where kernels run back to back) and ENABLED; bench/decode_ab.py
switches it per variant. Never on CPU or under Triton's interpreter (inline PTX).

**Off by default: measured slower.** H200, 2026-11-30, 20b at 8k (`bench/decode_ab --variants
fused+pdl,pdl+l2,pdl+l2@gate_up,pdl+l2+down`, `bench/results/decode_ab_l2_prefetch_gpt-oss-20b_h200.json`):
step 2.192 ms without, 2.298 / 2.296 / 2.336 ms with the three placements (0.94-0.95x at b=1, 0.91-0.98x
at b=4-16). The probe (`python -m bench.l2_prefetch_probe`, `bench/results/l2_prefetch_probe_h200.json`)
says why: after a flush, the 29.5 MB QKV weight read by cuBLAS at T=1 takes 12.3 us cold, 3.9 us when
the previous call left it in L2, but 9.9 us (8.6 with 64 KB pieces) after this prefetch and a 50 us
wait: the bulk prefetches land only a fraction of the bytes in L2, so the side stream adds traffic and
graph edges for little. Kept (with ENABLED False) as the harness for a load-based variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = False
MAX_TOKENS = 16
CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16)
CHUNKS_PER_PROGRAM = 32  # one warp, one chunk per lane
# When the next layer's QKV weight is prefetched: after the MoE's "gate_up" or "down" GEMM is launched
# (the side stream starts when that GEMM has completed). bench/decode_ab compares the two.
QKV_AFTER = "down"
# Also the active experts' down weights, after the gate_up GEMM (read by the down GEMM two launches on).
PREFETCH_DOWN = False

_SIDE: dict = {}
_CAPABLE: dict = {}
_FORKED: set = set()


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Bulk-prefetch bytes [0, nbytes) of base_ptr (uint8, 16-byte aligned, nbytes a multiple of 16)."""
    pid = tl.program_id(0)
    offs = (pid * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, ((nbytes - 1) // CHUNK) * CHUNK)  # lanes past the end repeat the last piece
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    done = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                     [base_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(done))  # keeps the asm; the sink is never read


@triton.jit
def _prefetch_rows_kernel(base_ptr, row_bytes, rows_ptr, count_ptr, sink_ptr, CHUNK: tl.constexpr,
                          PER: tl.constexpr):
    """Bulk-prefetch rows rows_ptr[0 .. count) of a [R, row_bytes] uint8 tensor; grid (max rows, pieces)."""
    slot, part = tl.program_id(0), tl.program_id(1)
    if slot < tl.load(count_ptr):
        row = tl.load(rows_ptr + slot).to(tl.int64)
        offs = (part * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
        offs = tl.minimum(offs, ((row_bytes - 1) // CHUNK) * CHUNK)
        size = tl.minimum(row_bytes - offs, CHUNK).to(tl.int32)
        done = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                         [base_ptr + row * row_bytes + offs, size], dtype=tl.int32, is_pure=False,
                                         pack=1)
        tl.store(sink_ptr + slot, tl.sum(done))


def active(t: torch.Tensor, num_tokens: int) -> bool:
    if not (ENABLED and t.is_cuda and 0 < num_tokens <= MAX_TOKENS and torch.cuda.is_current_stream_capturing()):
        return False
    if t.device not in _CAPABLE:
        _CAPABLE[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _CAPABLE[t.device]


def _side(device: torch.device) -> tuple[torch.cuda.Stream, torch.Tensor]:
    if device not in _SIDE:
        _SIDE[device] = (torch.cuda.Stream(device), torch.zeros(4096, dtype=torch.int32, device=device))
    return _SIDE[device]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"prefetch needs a contiguous, 16-byte aligned tensor, got strides {t.stride()}")
    return t.view(-1).view(torch.uint8)


def _fork(device: torch.device) -> tuple[torch.cuda.Stream, torch.Tensor]:
    stream, sink = _side(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    _FORKED.add(device)
    return stream, sink


def issue(tensors: list[torch.Tensor], num_tokens: int) -> None:
    """Prefetch whole tensors into L2 once the work queued so far on the current stream has completed."""
    if not tensors or not active(tensors[0], num_tokens):
        return
    stream, sink = _fork(tensors[0].device)
    with torch.cuda.stream(stream):
        for t in tensors:
            flat = _bytes(t)
            nbytes = flat.numel() // 16 * 16
            grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK), CHUNKS_PER_PROGRAM),)
            if nbytes and grid[0] <= sink.numel():
                _prefetch_kernel[grid](flat, nbytes, sink, CHUNK=CHUNK, PER=CHUNKS_PER_PROGRAM, num_warps=1)


def issue_experts(weight: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, max_rows: int, num_tokens: int) -> None:
    """Prefetch weight[rows[i]] for i < count[0] (device tensors; max_rows bounds the count)."""
    if max_rows <= 0 or not active(weight, num_tokens):
        return
    stream, sink = _fork(weight.device)
    row_bytes = weight[0].numel() * weight.element_size()
    if row_bytes % 16:
        raise ValueError(f"expert rows of {row_bytes} bytes are not 16-byte multiples")
    grid = (min(max_rows, sink.numel()), triton.cdiv(triton.cdiv(row_bytes, CHUNK), CHUNKS_PER_PROGRAM))
    with torch.cuda.stream(stream):
        _prefetch_rows_kernel[grid](_bytes(weight), row_bytes, rows, count, sink, CHUNK=CHUNK,
                                    PER=CHUNKS_PER_PROGRAM, num_warps=1)


def join(t: torch.Tensor) -> None:
    """The current stream waits for the prefetches issued on t's device (no-op when none were)."""
    if t.is_cuda and t.device in _FORKED:
        _FORKED.discard(t.device)
        torch.cuda.current_stream(t.device).wait_stream(_side(t.device)[0])
