"""Eager prefill TTFT with programmatic dependent launch off, on for every launch, and on only under
CUDA-graph capture (kernels/pdl.py's default), same process, 20b random weights. Without DG_USE=1
in scripts/device_env.sh the prefill GEMMs are the Triton grouped GEMM (as in the committed result).

    python -m bench.pdl_prefill_ab --out bench/results/pdl_prefill_ab_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.e2e import Harness
from kernels import pdl
from model.config import GptOssConfig

MODES = {"off": (False, True), "all launches": (True, False), "capture only": (True, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--lens", default="1024,2048,8192")
    p.add_argument("--out", default="bench/results/pdl_prefill_ab.json")
    args = p.parse_args(argv)
    h = Harness(args.model, GptOssConfig.preset(args.model), torch.device("cuda"), 1, 8192 + 64, 10.0)
    rows = []
    for n in [int(x) for x in args.lens.split(",")]:
        row = {"tokens": n}
        for name, (enabled, capture_only) in MODES.items():
            pdl.ENABLED, pdl.CAPTURE_ONLY = enabled, capture_only
            row[name] = h.prefill(n, profile=False, chunk=8192)["ttft_ms"]
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "model": args.model, "ttft_ms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
