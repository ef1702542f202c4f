"""bench/launch_floor on the CPU: the line fit, and (under Triton's interpreter, in a subprocess) its kernel."""

from __future__ import annotations

from bench.launch_floor import fit_line
from tests.kernels.interpreter import run_cases


def test_fit_line_recovers_a_fixed_cost_and_a_slope():
    a, b = fit_line([(0.0, 2.5), (1e6, 2.5 + 0.25), (4e6, 2.5 + 1.0)])
    assert abs(a - 2.5) < 1e-12 and abs(b - 0.25e-6) < 1e-18
    assert fit_line([(3.0, 1.0), (3.0, 2.0)]) == (1.5, 0.0)  # one x: no slope, the mean


def test_chain_kernel_under_interpreter():
    run_cases("launch_floor_interpreter_cases.py", timeout_s=300)
