"""What the multi-process path costs per decode step, on the tiny model (CPU, gloo) or a checkpoint.

    python -m engine.distributed.bench_step [--world 2] [--batch 8] [--steps 30] [--json out.json]

Prints ms per decode step (median) per split, world 1 (the single-process engine) being the baseline,
and the size and pack + unpack time of decode-step messages at serving-like batch and context sizes.
On CPU the step times measure host overhead and gloo latency, not what a GPU replica would see.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.distributed.executor import Executor
from engine.distributed.wire import apply_step_delta, pack_step, pack_step_delta, unpack_step
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from engine.step_arrays import StepArrays

TINY = dict(vocab_size=1000, sliding_window=8, dtype="float32", hidden_size=64, head_dim=16, intermediate_size=64,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, seed=3)


def decode_step_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median ms per decode step of `batch` sequences (16-token prompts), over `steps` steps."""
    for i in range(batch):
        prompt = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(GenerateRequest(f"b{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8,
                                                                           ignore_eos=True)))
    while any(s.is_prefill for s in engine.seqs.values()):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for rid in list(engine.seqs):
        engine.abort(rid)
    return statistics.median(times)


def message_us(batch: int, context: int, block_size: int, repeat: int = 200) -> tuple[float, int, float, int]:
    """(us to pack + unpack one decode-step message, its bytes; the same for the step as a delta of the
    previous one, one sequence in block_size crossing a page edge) for `batch` sequences of `context` tokens."""
    pages = -(-context // block_size)
    g = np.random.default_rng(0)
    arrays = StepArrays(g.integers(0, 1000, batch), np.full(batch, context - 1), np.arange(batch + 1, dtype=np.int32),
                        g.integers(0, 1 << 16, (batch, pages), dtype=np.int32), np.full(batch, context, np.int32),
                        g.integers(0, 1 << 20, batch), g.integers(0, 1 << 16, (batch, 9), dtype=np.int32),
                        np.full(batch, 128, np.int32), g.integers(0, 1 << 20, batch), np.arange(batch),
                        list(range(batch)))
    t0 = time.perf_counter()
    for _ in range(repeat):
        buf = pack_step(arrays)
        unpack_step(buf)
    full_us = (time.perf_counter() - t0) / repeat * 1e6
    rows = np.arange(0, batch, block_size)
    t0 = time.perf_counter()
    for _ in range(repeat):
        delta = pack_step_delta(arrays, rows, rows, 0)
        apply_step_delta(arrays, 0, delta)
    return full_us, buf.nbytes, (time.perf_counter() - t0) / repeat * 1e6, delta.nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.distributed.bench_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="checkpoint folder (default: a tiny fp32 model)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    folder = args.model_dir
    if folder is None:
        from model.tiny import make_tiny

        folder = tempfile.mkdtemp(prefix="bench-step-")
        make_tiny(folder, **TINY)
    base = dict(block_size=16, max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.batch),
                max_model_len=16 + args.steps + 16, num_full_pages=args.batch * 8, num_sliding_pages=args.batch * 8,
                device=args.device)
    rows = []
    single = LLMEngine.from_checkpoint(folder, EngineConfig(**base))
    rows.append({"split": "world 1", "step_ms": decode_step_ms(single, args.batch, args.steps)})
    single.close()
    w = args.world
    executor = Executor.spawn(w, args.device)
    try:
        for tp, ep in ((w, 1), (1, w), (w, w)):
            engine = executor.start_engine(folder, EngineConfig(**base, tp_size=tp, ep_size=ep))
            rows.append({"split": f"tp{tp} ep{ep}", "step_ms": decode_step_ms(engine, args.batch, args.steps)})
            engine.close()
    finally:
        executor.shutdown()
    print(f"decode steps, batch {args.batch}, {args.device}, median of {args.steps}")
    print(f"{'split':<12}{'ms/step':>10}")
    for r in rows:
        print(f"{r['split']:<12}{r['step_ms']:>10.2f}")
    messages = []
    for batch, context in ((8, 1024), (64, 8192), (256, 32768)):
        us, nbytes, delta_us, delta_bytes = message_us(batch, context, 16)
        messages.append({"batch": batch, "context": context, "bytes": nbytes, "pack_unpack_us": us,
                         "delta_bytes": delta_bytes, "delta_pack_apply_us": delta_us})
        print(f"step message: batch {batch}, context {context}: {nbytes} bytes, pack + unpack {us:.0f} us; "
              f"as a decode delta: {delta_bytes} bytes, pack + apply {delta_us:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "device": args.device, "world": w, "rows": rows, "messages": messages},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
