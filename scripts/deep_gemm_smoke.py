"""Smoke-test a deep_gemm build step by step (import, dense, masked, contiguous GEMM), printing as it
goes, so a crash names the step: python -X faulthandler -m scripts.deep_gemm_smoke"""

from __future__ import annotations

import torch

from kernels.moe import deep_gemm_ops
from kernels.moe.epilogues_triton import Fp8Rows


def step(name, fn):
    print(f"-> {name}", flush=True)
    out = fn()
    torch.cuda.synchronize()
    print(f"   ok: {out}", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    step("import", lambda: deep_gemm_ops._dg().__file__)
    step("mk_alignment", deep_gemm_ops.mk_alignment)
    step("tma aligned 257", lambda: deep_gemm_ops._dg().get_tma_aligned_size(257, 4))
    a = Fp8Rows.empty(1, 256, 256, dev)
    a.data.fill_(0.5)
    a.scale_storage.fill_(1.0)
    w = torch.full((256, 256), 0.5, device=dev).to(a.data.dtype)
    ws = torch.ones(2, 2, device=dev)
    out = torch.empty(256, 256, dtype=torch.bfloat16, device=dev)
    step("dense fp8_fp4_gemm_nt 256^3", lambda: float(deep_gemm_ops.gemm(a, w, ws, out).float().mean()))
    am = Fp8Rows.empty(2, 128, 256, dev)
    am.data.fill_(0.5)
    am.scale_storage.fill_(1.0)
    counts = torch.tensor([5, 128], dtype=torch.int32, device=dev)
    outm = torch.zeros(256, 256, dtype=torch.bfloat16, device=dev)
    step("masked 2 groups", lambda: float(deep_gemm_ops.grouped_gemm_masked(am, w[None].expand(2, -1, -1).contiguous(),
                                                                           ws[None].expand(2, -1, -1).contiguous(), outm,
                                                                           counts, 64)[:5].float().mean()))
    psum = torch.tensor([100, 256], dtype=torch.int32, device=dev)
    step("contiguous psum 2 groups", lambda: float(deep_gemm_ops.grouped_gemm_contiguous(
        a, w[None].expand(2, -1, -1).contiguous(), ws[None].expand(2, -1, -1).contiguous(), out, psum=psum)[:100].float().mean()))
    print("why_unavailable:", repr(deep_gemm_ops.why_unavailable()))


if __name__ == "__main__":
    main()
