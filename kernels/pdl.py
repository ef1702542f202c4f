"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step (Hopper and later).

In a CUDA graph a kernel still starts only after its predecessor has fully drained and its own blocks
have been scheduled: at batch 1 a decode step is ~300 dependent launches of a few us each, and that
ramp is a large part of each small kernel's time. Launched with PDL, a kernel's blocks may be
scheduled while its predecessor finishes. Every kernel taking part starts with `pdl_prologue`:
griddepcontrol.wait (the predecessor grid complete, its writes visible) before it touches any memory
that an earlier kernel of the step writes, then griddepcontrol.launch_dependents (the next kernel may be
scheduled now). Only loads of memory that the predecessor does not write may come before the wait:
weights (the slab GEMV's slabs, the router's rows in the decode front, a norm's scale), and what a kernel
two or more back wrote (the rotary kernel's cos / sin and slots, the down GEMM's expert plan): every
kernel waits before it triggers, so when a kernel starts, all but its predecessor are complete. Those
loads then arrive while the predecessor finishes; nothing is written early.

`launch(t)` gives the launch options and the kernel's PDL flag for tensors on `t`'s device: on when
ENABLED, the device is SM90+ and this Triton has the GDC intrinsics; off elsewhere (CPU, the
interpreter), and only while a CUDA graph is being captured unless CAPTURE_ONLY is False. Set
ENABLED = False to compare (bench/decode_ab.py).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # an older Triton: PDL stays off
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

ENABLED = True
# Only launches being captured into a CUDA graph use PDL by default: that is where kernels run back to
# back (decode); eager prefill is host-bound at small sizes, and PDL there measured within noise
# (20b TTFT off / all launches / capture only: 1k 32.9 / 34.1 / 31.6 ms, 8k 85.8 / 86.4 / 93.6 ms,
# Triton grouped GEMMs, H200 2026-11-30, bench/results/pdl_prefill_ab_h200.json).
CAPTURE_ONLY = True
_CAPABLE: dict = {}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def active(t: torch.Tensor) -> bool:
    if not (ENABLED and HAVE_GDC and t.is_cuda):
        return False
    if CAPTURE_ONLY and not torch.cuda.is_current_stream_capturing():
        return False
    if t.device not in _CAPABLE:
        _CAPABLE[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _CAPABLE[t.device]


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on `t`'s device: the PDL constexpr, and launch_pdl when on."""
    on = active(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@contextlib.contextmanager
def switched(on: bool):
    """ENABLED set to `on` inside the block (e.g. while capturing graphs that must not use PDL)."""
    global ENABLED
    before, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = before
