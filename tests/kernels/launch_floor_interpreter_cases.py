"""Interpreter cases (run by tests/kernels/test_launch_floor_cpu.py under TRITON_INTERPRET=1): bench/launch_floor's
chain kernel equals its twin bit for bit on fresh inputs, a chain of them included."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_launch_floor_cpu.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from bench.launch_floor import BLOCK, chain_reference, chain_step  # noqa: E402


@pytest.mark.parametrize("grid,blocks", [(1, 0), (3, 1), (5, 3)])
def test_chain_step_is_the_twin(grid, blocks):
    src = torch.randn(grid, BLOCK, dtype=torch.bfloat16)
    weights = torch.randn(grid, blocks * BLOCK, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    chain_step(src, dst, weights, False)
    assert torch.equal(dst, chain_reference(src, weights))


def test_a_chain_reads_each_predecessor():
    grid = 2
    bufs = [torch.randn(grid, BLOCK, dtype=torch.bfloat16), torch.empty(grid, BLOCK, dtype=torch.bfloat16)]
    slabs = [torch.randn(grid, BLOCK, dtype=torch.bfloat16) for _ in range(3)]
    want = bufs[0].clone()
    for i, w in enumerate(slabs):
        chain_step(bufs[i % 2], bufs[(i + 1) % 2], w, False)
        want = chain_reference(want, w)
    assert torch.equal(bufs[len(slabs) % 2], want)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        chain_step(torch.zeros(2, BLOCK), torch.zeros(2, BLOCK), torch.zeros(2, BLOCK + 1), False)
