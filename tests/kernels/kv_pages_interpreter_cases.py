"""kernels/attention/kv_pages.py's Triton kernel against its torch twin, on CPU tensors under Triton's
interpreter. Run by tests/kernels/test_kv_pages.py in a subprocess (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_kv_pages.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

from tests.kernels.interpreter import fresh_seed  # noqa: E402,F401  (autouse fixture)
from tests.kernels.kv_pages_common import make_pages  # noqa: E402
from kernels.attention import kv_pages  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_kernel_matches_the_twin(n, dtype):
    srcs, dsts, src_pages, dst_pages = make_pages(n, dtype, layers=3, src_blocks=40, dst_blocks=37)
    want = [d.clone() for d in dsts]
    kv_pages.copy_pages(srcs, src_pages, dsts, dst_pages, use_kernel=True)
    kv_pages.copy_pages_reference(srcs, src_pages, want, dst_pages)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dsts, want))
