"""Running Triton kernels on CPU tensors under Triton's interpreter, for the *_interpreter_cases.py files.

Parent side: `run_cases(name)` runs tests/kernels/<name> in a fresh Python with TRITON_INTERPRET=1 (it
must be set before triton is imported, so the cases cannot share the main test process).
Child side: importing this module with TRITON_INTERPRET=1 swaps the interpreter's float casts for
torch's: the interpreter rounds 0b1...1 mantissas without carrying into the exponent (128 -> 64 in
e4m3), GPUs convert in hardware; and its tl.dot multiplies bf16 operands as their raw uint16 storage
(Triton 3.9), so bf16 operands are widened to fp32 first, as the tensor cores read them exactly. Everything else in the kernels runs as written. `fresh_seed` is an
autouse fixture for the case files: fresh random inputs every run, the seed printed (replay a failure
with GPTOSS_TEST_SEED).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_cases(name: str, timeout_s: int = 600) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
                           str(ROOT / "tests" / "kernels" / name)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int(os.environ.get("GPTOSS_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"seed {seed}")


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _TORCH_FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
                     "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
    _INT_OF_WIDTH = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
    _interpreter_convert = interpreter._convert_float

    def _torch_convert_float(data, src_dtype, dst_dtype, rounding_mode):
        src, dst = _TORCH_FLOATS.get(src_dtype.name), _TORCH_FLOATS.get(dst_dtype.name)
        if src is None or dst is None:
            return _interpreter_convert(data, src_dtype, dst_dtype, rounding_mode)
        src_bits, dst_bits = src_dtype.primitive_bitwidth, dst_dtype.primitive_bitwidth
        raw = torch.from_numpy(np.ascontiguousarray(data).view(f"uint{src_bits}").astype(np.int64))
        out = raw.to(_INT_OF_WIDTH[src_bits]).view(src).to(dst).view(_INT_OF_WIDTH[dst_bits]).numpy()
        return out.view(f"uint{dst_bits}").reshape(data.shape)

    interpreter._convert_float = _torch_convert_float

    _interpreter_dot = interpreter.InterpreterBuilder.create_dot

    def _dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def widened(x):
            if x.dtype.scalar == tl.bfloat16:
                return interpreter.TensorHandle(_torch_convert_float(x.data, tl.bfloat16, tl.float32, None)
                                                .view(np.float32), tl.float32)
            return x
        return _interpreter_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = _dot_widening_bf16
