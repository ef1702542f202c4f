"""Does a sequence's decode depend on the batch it runs in? Greedy tokens and logprobs of the same requests
decoded alone, 4 and 8 at a time, and as speculative verify rows, on the GPU kernels with random weights.

    python -m bench.batch_shape_probe --device cuda --model gpt-oss-20b

Per request and setting: the first output index that differs from decoding alone, the largest logprob
difference over the tokens before it, and decoding alone's top-2 logprob gap at that index (a near-tie
when small). Decoding alone is also checked against a recompute of its text (prefill path). Rounding
differences leave logprobs within a few hundredths and flip only near-ties; a kernel that mixes rows or
reads wrong K/V moves logprobs by much more. JSON under bench/results/ (batch_shape_probe_<device>.json).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams


def decode(engine: LLMEngine, prompts: list[list[int]], n: int, tag: str, predictions=None) -> list:
    reqs = [GenerateRequest(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2,
                                                           prediction=tuple(predictions[i]) if predictions else ()))
            for i, p in enumerate(prompts)]
    return engine.generate(reqs)


def compare(alone, other) -> dict:
    ids_a, ids_o = alone.output_ids, other.output_ids
    first = next((i for i, (a, b) in enumerate(zip(ids_a, ids_o)) if a != b), None)
    upto = first if first is not None else len(ids_a)
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(alone.logprobs[:upto], other.logprobs[:upto])]
    gap = None
    if first is not None:
        top = alone.logprobs[first].top
        gap = top[0][1] - top[1][1]
    return {"first_difference": first, "max_logprob_diff_before": max(diffs, default=0.0), "alone_gap_there": gap}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--out-len", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from model.tiny import shapes_by_name

    model_config = shapes_by_name(args.model)
    cuda = args.device == "cuda"
    config = EngineConfig(device=args.device, max_num_seqs=48, max_num_batched_tokens=8192,
                          max_model_len=args.prompt_len + args.out_len + 16, speculative_max_seqs=8,
                          kv_cache_bytes=(8 << 30) if cuda else (256 << 20), cuda_graphs=cuda)
    engine = LLMEngine.with_random_weights(model_config, config)
    vocab = min(engine.vocab_size, 199998)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(8)]
    alone = [decode(engine, [q], args.out_len, f"alone{i}-")[0] for i, q in enumerate(prompts)]
    rows = []
    for i, (q, out) in enumerate(zip(prompts, alone)):  # decoding alone against a recompute of the same text
        logits = engine.model.full_logits(q + out.output_ids[:-1]).float()[len(q) - 1:].log_softmax(-1)
        diffs = [abs(lp.logprob - logits[j, t].item()) for j, (lp, t) in enumerate(zip(out.logprobs, out.output_ids))]
        argmax_same = sum(int(logits[j].argmax().item() == t) for j, t in enumerate(out.output_ids))
        rows.append({"setting": "alone vs recompute", "request": i, "max_logprob_diff": max(diffs),
                     "recompute_argmax_agrees": f"{argmax_same}/{len(diffs)}"})
    settings = {"4 at a time": lambda: decode(engine, prompts[:4], args.out_len, "four-"),
                "8 at a time": lambda: decode(engine, prompts, args.out_len, "eight-"),
                "verify rows, k=2": lambda: _spec(engine, prompts[:2], alone[:2], args.out_len, 2),
                "verify rows, k=4": lambda: _spec(engine, prompts[:2], alone[:2], args.out_len, 4),
                "8 at a time, no graphs": lambda: _eager(engine, lambda: decode(engine, prompts, args.out_len, "e8-")),
                "verify rows, k=4, no graphs": lambda: _eager(engine, lambda: _spec(engine, prompts[:2], alone[:2],
                                                                                 args.out_len, 4))}
    for name, fn in settings.items():
        for i, out in enumerate(fn()):
            rows.append({"setting": name, "request": i, **compare(alone[i], out)})
    rows += leak_check(engine, prompts[0], vocab)
    for r in rows:
        print(json.dumps(r))
    out_path = Path(args.out or f"bench/results/batch_shape_probe_{args.device}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args),
                                    "rows": rows}, indent=1))


def _spec(engine: LLMEngine, prompts, alone, n: int, k: int) -> list:
    engine.config.speculative_tokens = k
    return decode(engine, prompts, n, f"spec{k}-", [a.output_ids for a in alone])


def leak_check(engine: LLMEngine, prompt: list[int], vocab: int) -> list[dict]:
    """A verify step's rows against the same step with other draft tokens after them: row j must not depend
    on the tokens of rows after j (bitwise, same batch shape), nor on the run (the same drafts twice)."""
    from engine.scheduler import ScheduledSeq

    engine.async_decode = False  # no step in flight: the sequence's last token is known when the check runs
    engine.add_request(GenerateRequest("leak", prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
    while engine.seqs["leak"].is_prefill:  # (the runs before ended without a step in flight)
        engine.step()
    seq = engine.seqs["leak"]
    out = []
    for k in (2, 4, 7):
        gen = torch.Generator().manual_seed(k)
        drafts = torch.randint(0, vocab, (k,), generator=gen).tolist()
        other = drafts[:1] + torch.randint(0, vocab, (k - 1,), generator=gen).tolist()  # rows 2.. differ
        engine.block_manager.allocate(seq, seq.num_computed + 1 + k)
        logits = []
        for d in (drafts, drafts, other):
            inputs = engine.runner.prepare([ScheduledSeq(seq, seq.num_computed, 1 + k, False, tuple(d))])
            logits.append(engine.runner.execute(inputs).clone())
        torch.cuda.synchronize() if logits[0].is_cuda else None
        out.append({"setting": f"leak check, k={k}", "path": engine.runner.last_path,
                    "rerun_max_diff": (logits[0] - logits[1]).abs().max().item(),
                    "rows_0_1_max_diff_with_other_later_drafts": (logits[0][:2] - logits[2][:2]).abs().max().item()})
    engine.abort("leak")
    return out


def _eager(engine: LLMEngine, fn):
    """fn() with the engine's CUDA graphs set aside: every step launched kernel by kernel."""
    runner = engine.runner
    graphs = runner.decode_graphs, runner.prefill_graphs
    runner.decode_graphs = runner.prefill_graphs = None
    try:
        return fn()
    finally:
        runner.decode_graphs, runner.prefill_graphs = graphs


if __name__ == "__main__":
    main()
