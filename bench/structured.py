"""What structured output costs: the host's mask per token, and one request's decode through the engine.

    python -m bench.structured                                   # CPU, the tiny model (smoke; minutes)
    python -m bench.structured --device cuda --model gpt-oss-20b # one GPU, random weights of the real shapes

1. Host: HarmonyConstraint.allowed_tokens() (llguidance's mask over the 201,088 Harmony ids, cut and
   patched) and accept() along random walks through three schemas; microseconds per token.
2. Engine: one request (1k prompt tokens, N output tokens, greedy, ignore_eos) stepped alone through the
   same LLMEngine three ways: no constraint (the engine's lookahead as configured), a constraint in its free
   phase (a response format whose constraint has seen `<|channel|>analysis<|message|>`, as after a real
   model's first three tokens, and stays in that body: the random model never ends it; what a reasoning
   model's analysis costs), and a grammar active from the first token (a string of at least 1000
   characters: it stays active for the whole run; no token is ever forced), and the same with 60 required
   boolean keys (the keys' tokens are forced: the engine runs them as drafts, jump-forward, and the same
   without jump-forward, one forced token per step); and a request with
   presence/frequency penalties (no constraint: the sampler needs each token's history); and a forced tool call
   (tool_choice) in its reasoning (the forced-call grammar holds every token, the random model stays in the
   analysis body). Milliseconds per output token and the ratio to the unconstrained run, same process.
3. Engine, `--batch B` (> 1): B requests at once, unconstrained against all of them forced tool calls in their
   reasoning (every row then sends a mask each step, so the sampling batch is rebuilt each step): milliseconds
   per decode step and the ratio, same process.

JSON and a PNG under bench/results/ (structured_<device>.{json,png}); a table printed last.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams
from serve_app.harmony.constrain import (FINAL, FORCED_CALL, HARMONY_VOCAB_SIZE, HarmonySchemaSpec,
                                         check_json_schema, forced_call_grammar, harmony_tokenizer)
from serve_app.harmony.encoding import load_harmony_encoding

SCHEMAS = {
    "weather (flat, enums, bounded ints)": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit", "days", "alerts"],
        "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}, "alerts": {"type": "boolean"}}},
    "nested (array of objects)": {
        "type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
            "type": "object", "required": ["name", "qty", "tags"],
            "properties": {"name": {"type": "string"}, "qty": {"type": "number"},
                           "tags": {"type": "array", "items": {"type": "string"}}}}}}},
    "json_object": {"type": "object"},
}
LONG_STRING = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string", "minLength": 1000}}}
MANY_KEYS = {"type": "object", "additionalProperties": False, "required": [f"field_{i:02d}" for i in range(60)],
             "properties": {f"field_{i:02d}": {"type": "boolean"} for i in range(60)}}


def allowed_ids(words: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:HARMONY_VOCAB_SIZE])


def host_costs(tokens: int, walks: int) -> list[dict]:
    t0 = time.perf_counter()
    harmony_tokenizer()
    build_s = time.perf_counter() - t0
    rows = []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = check_json_schema(schema, "bench")
        compile_ms = 1e3 * (time.perf_counter() - t0)
        masks, accepts, lengths = [], [], []
        for walk in range(walks):
            rng = np.random.default_rng(walk)
            c = HarmonySchemaSpec(final=grammar, start_in=FINAL).start(HARMONY_VOCAB_SIZE)
            for n in range(tokens):
                t = time.perf_counter()
                words = c.allowed_tokens()
                masks.append(time.perf_counter() - t)
                token = int(rng.choice(allowed_ids(words)))
                t = time.perf_counter()
                c.accept(token)
                accepts.append(time.perf_counter() - t)
                if not c.active:
                    break
            lengths.append(n + 1)
        rows.append({"schema": name, "walks": walks, "tokens": len(masks), "mean_walk_tokens": float(np.mean(lengths)),
                     "compile_ms": compile_ms, "tokenizer_build_s": build_s,
                     **{f"mask_us_{k}": float(np.percentile(masks, q) * 1e6) for k, q in (("p50", 50), ("p90", 90), ("max", 100))},
                     "accept_us_p50": float(np.median(accepts) * 1e6)})
        print(f"host {name}: mask p50 {rows[-1]['mask_us_p50']:.0f} us, p90 {rows[-1]['mask_us_p90']:.0f}, "
              f"accept {rows[-1]['accept_us_p50']:.0f} us", flush=True)
    return rows


@dataclass(frozen=True)
class InAnalysis:
    """A spec whose constraint starts as if the model had written the analysis channel's header."""

    spec: HarmonySchemaSpec

    def start(self, vocab_size: int):
        constraint = self.spec.start(vocab_size)
        for token in load_harmony_encoding().encode("<|channel|>analysis<|message|>", allowed_special="all"):
            constraint.accept(token)
        return constraint


def forced_call_spec(out_len: int) -> InAnalysis:
    """A forced tool call (tool_choice naming `lookup`) whose model has opened its analysis: the grammar holds
    the body, whose budget (twice the output) the run never reaches."""
    grammar = forced_call_grammar([("lookup", {"type": "object", "properties": {"q": {"type": "string"}}})],
                                  2 * out_len)
    return InAnalysis(HarmonySchemaSpec(start_in=FORCED_CALL, forced_call=grammar))


def batch_costs(engine: LLMEngine, batch: int, prompt_len: int, out_len: int) -> list[dict]:
    """ms per decode step with `batch` requests decoding together: none constrained, then all forced tool calls in
    their reasoning. Round 0 warms up; round 1 is reported."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, min(engine.vocab_size, 199998), (prompt_len,), generator=g).tolist()
               for _ in range(batch)]
    rows = []
    for rnd in range(2):
        for name, spec in (("no constraint", None), ("forced tool calls, reasoning", forced_call_spec(out_len))):
            for i, p in enumerate(prompts):
                engine.add_request(GenerateRequest(f"b{rnd}-{name}-{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=out_len, ignore_eos=True, constraint=spec)))
            stamps = []
            while engine.has_unfinished():
                deltas = engine.step()
                if deltas and all(len(d.token_ids) > 0 for d in deltas) and len(deltas) == batch:
                    stamps.append(time.perf_counter())  # a step that gave every request its token
            if rnd == 1:
                step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
                rows.append({"variant": name, "batch": batch, "steps_timed": len(stamps) - 1, "step_ms": 1e3 * step})
    for r in rows:
        r["vs_unconstrained"] = r["step_ms"] / rows[0]["step_ms"]
        print(f"engine batch {batch}, {r['variant']}: {r['step_ms']:.3f} ms per step ({r['vs_unconstrained']:.2f}x)",
              flush=True)
    return rows


def engine_costs(engine: LLMEngine, prompt_len: int, out_len: int) -> list[dict]:
    vocab = engine.vocab_size
    prompt = torch.randint(0, min(vocab, 199998), (prompt_len,), generator=torch.Generator().manual_seed(9)).tolist()
    variants = {
        "no constraint": None,
        "constraint, free phase": InAnalysis(HarmonySchemaSpec(final=check_json_schema(SCHEMAS["json_object"],
                                                                                       "bench"))),
        "grammar active": HarmonySchemaSpec(final=check_json_schema(LONG_STRING, "bench"), start_in=FINAL),
        "grammar active, forced keys": HarmonySchemaSpec(final=check_json_schema(MANY_KEYS, "bench"), start_in=FINAL),
        "forced keys, no jump-forward": HarmonySchemaSpec(final=check_json_schema(MANY_KEYS, "bench"), start_in=FINAL),
        "penalties, no constraint": "penalties",  # presence/frequency penalties: the sampler needs the history
        "forced tool call, reasoning": forced_call_spec(out_len),
    }
    rows = []
    jump = engine.config.jump_forward_tokens
    for rnd in range(2):  # round 0 warms everything (graphs, first steps); round 1 is reported
        for name, spec in variants.items():
            engine.config.jump_forward_tokens = 0 if "no jump-forward" in name else jump  # (read per step)
            rid = f"{name}-{rnd}"
            extra = dict(presence_penalty=0.5, frequency_penalty=0.3) if spec == "penalties" else dict(constraint=spec)
            engine.add_request(GenerateRequest(rid, prompt, SamplingParams(
                temperature=0.0, max_tokens=out_len, ignore_eos=True, **extra)))
            times, active, ahead = [], [], engine.lookahead_steps
            jumped = engine.metrics.snapshot()["jump_forward_tokens_total"]
            while engine.has_unfinished():
                seq = engine.seqs.get(rid)
                was_active = bool(seq is not None and getattr(seq.constraint, "active", False))
                for d in engine.step():
                    times += [time.perf_counter()] * len(d.token_ids)
                    active += [was_active] * len(d.token_ids)
            if rnd == 1:
                tpot = (times[-1] - times[0]) / (len(times) - 1)
                rows.append({"variant": name, "out_len": len(times), "tpot_ms": 1e3 * tpot, "tok_s": 1 / tpot,
                             "tokens_with_grammar_active": int(sum(active[1:])),
                             "decode_steps": len(set(times)) - 1,
                             "jump_forward_tokens": engine.metrics.snapshot()["jump_forward_tokens_total"] - jumped,
                             "lookahead_steps": engine.lookahead_steps - ahead})
    engine.config.jump_forward_tokens = jump
    base = rows[0]["tpot_ms"]
    for r in rows:
        r["vs_unconstrained"] = r["tpot_ms"] / base
        print(f"engine {r['variant']}: {r['tpot_ms']:.3f} ms per token ({r['vs_unconstrained']:.2f}x)", flush=True)
    return rows


def build_engine(args) -> LLMEngine:
    from model.tiny import shapes_by_name

    model_config = shapes_by_name(args.model)
    cuda = args.device == "cuda"
    config = EngineConfig(device=args.device, max_num_seqs=max(4, args.batch),
                          max_num_batched_tokens=max(2048, args.prompt_len),
                          max_model_len=args.prompt_len + args.out_len + 8,
                          kv_cache_bytes=(16 << 30) if cuda else (256 << 20) * max(1, args.batch // 4),
                          cuda_graphs=cuda)
    return LLMEngine.with_random_weights(model_config, config)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    host = result["host"]
    a.bar([r["schema"].split(" (")[0] for r in host], [r["mask_us_p50"] for r in host], label="p50")
    a.bar([r["schema"].split(" (")[0] for r in host], [r["mask_us_p90"] - r["mask_us_p50"] for r in host],
          bottom=[r["mask_us_p50"] for r in host], alpha=0.5, label="p90")
    a.set_ylabel("host mask per token, us")
    a.set_title(f"allowed_tokens() ({result['host_cpu']})")
    a.legend()
    eng = result["engine"]
    b.bar([r["variant"] for r in eng], [r["tpot_ms"] for r in eng])
    b.set_ylabel("ms per output token, batch 1")
    b.set_title(f"{result['model']} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", help="tiny, gpt-oss-20b or gpt-oss-120b (random weights)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=128)
    p.add_argument("--host-tokens", type=int, default=200)
    p.add_argument("--walks", type=int, default=5)
    p.add_argument("--batch", type=int, default=1, help="> 1: also time B requests at once (forced calls or not)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or f"bench/results/structured_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
              "host_cpu": platform.processor() or platform.machine(), "model": args.model, "args": vars(args),
              "host": host_costs(args.host_tokens, args.walks)}
    out.write_text(json.dumps(result, indent=1))
    engine = build_engine(args)
    result["engine_async_decode"] = engine.async_decode
    result["engine"] = engine_costs(engine, args.prompt_len, args.out_len)
    out.write_text(json.dumps(result, indent=1))
    if args.batch > 1:
        result["batch"] = batch_costs(engine, args.batch, args.prompt_len, args.out_len)
        out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\n{result['model']} on {device}, {args.prompt_len}-token prompt, {args.out_len} tokens, lookahead "
          f"{'on' if engine.async_decode else 'off'} ({result['date']})")
    print(f"{'schema':40s} {'mask p50 us':>12s} {'p90':>8s} {'max':>8s} {'accept us':>10s} {'walk tokens':>12s}")
    for r in result["host"]:
        print(f"{r['schema']:40s} {r['mask_us_p50']:12.0f} {r['mask_us_p90']:8.0f} {r['mask_us_max']:8.0f} "
              f"{r['accept_us_p50']:10.1f} {r['mean_walk_tokens']:12.1f}")
    print(f"{'engine, batch 1':40s} {'ms/token':>12s} {'vs none':>8s}")
    for r in result["engine"]:
        print(f"{r['variant']:40s} {r['tpot_ms']:12.3f} {r['vs_unconstrained']:8.2f}")
    for r in result.get("batch", []):
        print(f"{'batch ' + str(r['batch']) + ', ' + r['variant']:40s} {r['step_ms']:12.3f} {r['vs_unconstrained']:8.2f}"
              "  (ms per step)")


if __name__ == "__main__":
    main()
