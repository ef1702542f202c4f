"""kernels/attention/kv_rows.py's Triton kernel against its torch twins, on CPU tensors under Triton's
interpreter. Run by tests/kernels/test_kv_rows.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_kv_rows.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from tests.kernels.kv_rows_common import make_case  # noqa: E402
from kernels.attention import kv_rows  # noqa: E402


@pytest.mark.parametrize("shared_slots", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 17, 300])
def test_gather_then_scatter_match_the_twins(rows, dtype, shared_slots):
    """shared_slots: entries reuse two slot tensors, as the runner passes one per layer kind."""
    caches, slots, pads = make_case(rows, dtype, layers=3)
    if shared_slots:
        slots = [slots[0] if i % 2 == 0 else slots[1] for i in range(len(slots))]
    outs = [torch.full((s.numel(), *c.view(torch.uint8).shape[2:]), 7, dtype=torch.uint8).view(dtype)
            for c, s in zip(caches, slots)]
    want = [o.clone() for o in outs]
    kv_rows.gather_rows(caches, slots, outs, use_kernel=True)
    kv_rows.gather_rows_reference(caches, slots, want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs, want))

    srcs = [o[p:].clone() for o, p in zip(outs, pads)]  # rows after each entry's pad
    got = [torch.full_like(c.view(torch.uint8), 3).view(dtype) for c in caches]
    expect = [g.clone() for g in got]
    kv_rows.scatter_rows(got, slots, srcs, pads, use_kernel=True)
    kv_rows.scatter_rows_reference(expect, slots, srcs, pads)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expect))
