"""kernels/sampling Triton kernels against their torch twins, on CPU tensors under Triton's interpreter. Run by
tests/kernels/test_sampling_cpu.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_sampling_cpu.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from kernels.sampling.argmax_triton import BLOCK, RowArgmax  # noqa: E402
from tests.kernels.sampling_common import awkward_rows  # noqa: E402


@pytest.mark.parametrize("vocab", [1, 300, BLOCK, BLOCK + 1, 3 * BLOCK - 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax(vocab, dtype):
    argmax = RowArgmax("cpu")
    for rows in (1, 6, 3):  # the tickets grow, then serve a smaller batch
        x = awkward_rows(rows, vocab, dtype) if vocab > 5 else torch.randn(rows, vocab).to(dtype)
        got = argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
        assert int(argmax.tickets.abs().sum()) == 0
    view = awkward_rows(4, vocab + 3, dtype)[:, 2:vocab + 2] if vocab > 5 else torch.randn(4, vocab + 3)[:, :vocab]
    assert torch.equal(argmax(view), view.argmax(dim=-1))  # a row stride past the vocabulary
