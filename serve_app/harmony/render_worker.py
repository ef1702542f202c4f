"""Tokenizing long prompts in worker processes, off the ingress' event loop.

openai-harmony's tokenizer holds the GIL while it encodes: on this project's 2-core CPU a 90k-token prompt takes
55 ms to render and a 179k-token one 103 ms, and the event loop of the same process does not run meanwhile
(`python -m bench.ingress_render`, bench/RESULTS.md). Rendered on the ingress' event loop, every long prompt would
stop the token streams of all requests that replica serves for that long. `RenderWorkers.run` hands the tokenizing of a long request (a render
function and its picklable arguments) to one of a few worker processes and waits for it in a thread, so the loop
goes on; short prompts are tokenized in place, where the round trip (~1 ms) would cost more than it saves.

A worker is `python -m serve_app.harmony.render_worker`: once warmed up it writes `ready`, then reads
length-prefixed pickled calls `(function, args)` on stdin and writes `(ok, result or exception)` back on stdout; it exits when its stdin closes (the
ingress closed it, or died). Each thread of the pool owns one worker, started on its first call (~1 s: the
vocabulary and the tokenizer-limit table load), and started again if it died. Errors raised by the render
function (a 400 for text the tokenizer would stall on, a Harmony render error) come back as themselves; a
worker that dies during a call is `RenderWorkerDied` (a 500), and the next call starts a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import weakref
from typing import IO, Any, Callable, TypeVar

T = TypeVar("T")

_HEADER = struct.Struct("<Q")
DEFAULT_RENDER_WORKERS = 1
# Below this many characters of prompt text a render takes ~5 ms or less (bench.ingress_render): done in place.
DEFAULT_OFF_LOOP_CHARS = 16_384
# A call that takes longer is stopped (RenderWorkerDied): the largest body the ingress takes (8 MB of text) renders
# in ~3 s here, and text_limits refuses the text that would take the tokenizer longer.
DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0  # a worker's start (imports, the vocabulary, the tokenizer-limit table): ~1 s here
READY = b"ready"  # a worker's first frame, once it has warmed up


class RenderWorkerDied(RuntimeError):
    """The worker process stopped while it rendered a prompt (the next call starts a new one)."""


def _write_frame(stream: IO[bytes], data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's bytes; None at the end of the stream (the other side closed it or died)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    size, = _HEADER.unpack(head)
    data = stream.read(size)
    return data if len(data) == size else None


class _Worker:
    """One worker process, used by one thread at a time."""

    def __init__(self, registry: set):
        self.proc: subprocess.Popen | None = None
        self.registry = registry  # every live process of the pool, for close()

    def start(self) -> None:
        # The worker imports what this process imports, from the same places (a Ray worker's path included).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "serve_app.harmony.render_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.registry.add(self.proc)
        ready, _ = _reply_within(self.proc, START_TIMEOUT_S)  # its warm-up done (~1 s): the call's clock starts
        if ready != READY:
            code = self.proc.poll()
            self.stop()
            raise RenderWorkerDied(f"the prompt-rendering worker did not start (exit code {code})")

    def stop(self) -> None:
        if self.proc is not None:
            self.registry.discard(self.proc)
            _close_process(self.proc)
            self.proc = None

    def call(self, fn: Callable[..., T], args: tuple, timeout_s: float) -> T:
        if self.proc is None or self.proc.poll() is not None:  # first call, or it died between calls
            self.stop()
            self.start()
        proc = self.proc
        try:
            _write_frame(proc.stdin, pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
            reply, late = _reply_within(proc, timeout_s)
        except (OSError, ValueError):  # a broken pipe; ValueError: the pool closed its pipes meanwhile
            reply, late = None, False
        if reply is None:
            code = proc.poll()
            self.stop()
            raise RenderWorkerDied(f"the prompt-rendering worker took longer than {timeout_s:g} s and was stopped"
                                   if late else
                                   f"the prompt-rendering worker process stopped during a call (exit code {code})")
        ok, value = pickle.loads(reply)
        if ok:
            return value
        raise value


def _reply_within(proc: subprocess.Popen, timeout_s: float) -> tuple[bytes | None, bool]:
    """(the worker's next frame or None, whether it was killed for taking longer than timeout_s)."""
    late = threading.Event()

    def stop_late() -> None:
        late.set()
        proc.kill()

    timer = threading.Timer(timeout_s, stop_late)
    timer.daemon = True
    timer.start()
    try:
        return _read_frame(proc.stdout), late.is_set()
    except (OSError, ValueError):  # ValueError: the pool closed the pipe meanwhile
        return None, late.is_set()
    finally:
        timer.cancel()


def _close_process(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=2)  # it exits at the end of its stdin
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _close_all(procs: set, executor: concurrent.futures.ThreadPoolExecutor) -> None:
    executor.shutdown(wait=False, cancel_futures=True)
    for proc in list(procs):
        procs.discard(proc)
        _close_process(proc)


class RenderWorkers:
    """Tokenizes prompts of at least `min_chars` characters in `workers` processes (0: always in place).
    One per ingress replica, shared by its models' apps."""

    def __init__(self, workers: int = DEFAULT_RENDER_WORKERS, min_chars: int = DEFAULT_OFF_LOOP_CHARS,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if workers < 0 or min_chars < 0 or timeout_s <= 0:
            raise ValueError(f"workers ({workers}) and min_chars ({min_chars}) must be >= 0, timeout_s ({timeout_s}) "
                             "positive")
        self.workers, self.min_chars, self.timeout_s = workers, min_chars, timeout_s
        self._procs: set[subprocess.Popen] = set()
        self._local = threading.local()
        self._executor = concurrent.futures.ThreadPoolExecutor(max(workers, 1), thread_name_prefix="render")
        # Processes end with the pool (an app dropped in a test) or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _close_all, self._procs, self._executor)

    @property
    def started(self) -> int:
        """Worker processes running now."""
        return sum(1 for proc in self._procs.copy() if proc.poll() is None)

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        worker = getattr(self._local, "worker", None)
        if worker is None:
            worker = self._local.worker = _Worker(self._procs)
        return worker.call(fn, args, self.timeout_s)

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args): in place for fewer than min_chars characters of prompt text, else in a worker process
        (fn a module-level function, args picklable), the event loop free meanwhile. A caller cancelled while
        a worker renders leaves it to finish; a call still queued is dropped."""
        if self.workers == 0 or chars < self.min_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def warm(self) -> None:
        """Start every worker now (each thread of the pool starts its own), so the first long prompt does not
        wait ~1 s for one. Returns at once."""
        for _ in range(self.workers):
            self._executor.submit(self._call, len, ((),))

    def close(self) -> None:
        self._finalizer()


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    while (frame := _read_frame(requests)) is not None:
        fn, args = pickle.loads(frame)
        try:
            reply = (True, fn(*args))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - a Rust panic in the tokenizer is a BaseException
            reply = (False, err)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            if not reply[0]:
                pickle.loads(data)  # an exception whose class cannot be rebuilt from its args
        except Exception as err:  # noqa: BLE001 - then its text goes back instead
            data = pickle.dumps((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({err})")))
        _write_frame(replies, data)


def main() -> None:
    # Ctrl-C on `serve run` reaches the whole process group: the worker leaves when its stdin closes instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, not into the replies
    requests = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    # Load what a first render would (the vocabulary, the tokenizer-limit class table) before the first call.
    from serve_app.harmony.render import Prompt, UserMessage, render_prompt

    render_prompt(Prompt(history=[UserMessage("warm up")]))
    _write_frame(replies, READY)
    _serve(requests, replies)


if __name__ == "__main__":
    main()
