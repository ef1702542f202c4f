"""kernels/sampling on CPU: the Triton kernels under the interpreter (sampling_interpreter_cases.py)."""

from __future__ import annotations


def test_sampling_triton_kernels_under_the_interpreter():
    from tests.kernels.interpreter import run_cases

    run_cases("sampling_interpreter_cases.py")
