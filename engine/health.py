"""Whether an engine can still serve, as its loop sees it: the state a Serve replica's `check_health` reports.

An engine can fail in ways one request's error does not cover, and a replica that keeps accepting requests
it can only fail is worse than one that is replaced:

- a device error: CUDA errors such as an illegal address or a device-side assert leave the context unusable,
  so every later step fails too (torch raises them as `torch.AcceleratorError`);
- a rank of a multi-GPU engine died or went out of step (`WorkerFailedError`, `ExecutorStateError`: the
  engine cannot continue, engine/distributed);
- steps keep failing for any other reason (`max_failed_steps` in a row, none succeeding between them);
- a step never returns (a hung kernel or collective): it has run longer than `step_timeout_s`;
- the loop stopped (shut down, or its thread died).

The engine thread records each step here; the event loop reads `problem()`. Plain attribute writes and reads
on both sides, no lock: a health check that reads a value one step old answers the same a moment later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthPolicy:
    max_failed_steps: int = 3  # failed steps in a row that make the engine unhealthy; 0: never by count
    step_timeout_s: float | None = 300.0  # a step running longer is hung; None: never

    def __post_init__(self):
        if isinstance(self.max_failed_steps, bool) or not isinstance(self.max_failed_steps, int) \
                or self.max_failed_steps < 0:
            raise ValueError(f"max_failed_steps must be an integer >= 0, not {self.max_failed_steps!r}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, not {self.step_timeout_s!r}")


def _fatal_types() -> tuple[type[BaseException], ...]:
    """Errors after which the engine cannot step again (the device's context or the model group is gone)."""
    import torch

    from engine.distributed.executor import ExecutorStateError
    from engine.distributed.handles import WorkerFailedError

    accelerator = getattr(torch, "AcceleratorError", None)  # torch >= 2.8; older builds raise plain RuntimeError
    return (WorkerFailedError, ExecutorStateError) + ((accelerator,) if accelerator is not None else ())


def fatal_cause(exc: BaseException) -> BaseException | None:
    """The error in `exc`'s chain (itself, its causes and contexts) that the engine cannot recover from, if any."""
    fatal = _fatal_types()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, fatal):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else 'no message'}"


class EngineHealth:
    """What the engine thread reports (`step_started`, `step_succeeded`, `step_failed`, `stopped`) and the
    verdict it adds up to (`problem`)."""

    def __init__(self, policy: HealthPolicy | None = None, clock=time.monotonic):
        self.policy = policy or HealthPolicy()
        self._clock = clock
        self._step_since: float | None = None  # when the running step started; None between steps
        self._failed_in_a_row = 0
        self._last_failure: str | None = None
        self._fatal: str | None = None  # set once, never cleared: the engine has to be replaced
        self._stopped: str | None = None

    def step_started(self) -> None:
        self._step_since = self._clock()

    def step_succeeded(self) -> None:
        self._step_since = None
        self._failed_in_a_row = 0

    def step_failed(self, exc: BaseException) -> None:
        self._step_since = None
        self._failed_in_a_row += 1
        self._last_failure = _describe(exc)
        cause = fatal_cause(exc)
        if cause is not None and self._fatal is None:
            self._fatal = _describe(cause)
            log.error("engine unhealthy: %s; it cannot step again (a Serve replica fails its health check and "
                      "is replaced)", self._fatal)
        elif self._failed_in_a_row == self.policy.max_failed_steps:
            log.error("engine unhealthy: %d steps failed in a row, the last with %s", self._failed_in_a_row,
                      self._last_failure)

    def stopped(self, reason: str) -> None:
        self._step_since = None
        self._stopped = reason

    def problem(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        if self._stopped is not None:
            return f"the engine loop stopped: {self._stopped}"
        if self._fatal is not None:
            return f"a step failed with an error the engine cannot recover from ({self._fatal})"
        limit = self.policy.max_failed_steps
        if limit and self._failed_in_a_row >= limit:
            return f"{self._failed_in_a_row} steps failed in a row, the last with {self._last_failure}"
        since, timeout = self._step_since, self.policy.step_timeout_s
        if since is not None and timeout is not None:
            running = self._clock() - since
            if running > timeout:
                return f"a step has been running for {running:.0f} s (step_timeout_s={timeout:g}): hung"
        return None
