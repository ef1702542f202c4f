"""Token constraints (structured output) in the sampler and the engine: masked ids are never sampled, greedy
rows take the best allowed id, the constraint sees every token in order (here, after a lookahead, and across a
prefill -> decode hand-off), and the engine builds a constrained row's mask only after the token in flight is
read or known (deferred sampling). Jump-forward drafts: test_jump_forward.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from engine.request import InvalidRequestError, SamplingParams
from engine.sampler import Sampler, SamplingBatch, bitmask_words, unpack_bitmask
from tests.engine.engine_testlib import VOCAB, random_prompt, request, run_to_end


def pack(allowed: set[int], vocab: int) -> np.ndarray:
    bits = np.zeros(bitmask_words(vocab) * 32, dtype=np.uint8)
    bits[sorted(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


class ResidueConstraint:
    """Step k allows the ids congruent to (k + offset) mod `modulus`: every step a different set."""

    def __init__(self, spec: "ResidueSpec", vocab: int):
        self.spec, self.vocab, self.seen = spec, vocab, []

    def allowed_set(self) -> set[int]:
        r = (len(self.seen) + self.spec.offset) % self.spec.modulus
        return set(range(r, self.vocab, self.spec.modulus))

    def allowed_tokens(self) -> np.ndarray:
        return pack(self.allowed_set(), self.vocab)

    def accept(self, token_id: int) -> None:
        assert token_id in self.allowed_set(), (token_id, len(self.seen))
        self.seen.append(token_id)
        STARTED[self.spec.tag] = self

    def can_look_ahead(self) -> bool:
        return False  # every mask depends on the count of tokens seen


class LateConstraint(ResidueConstraint):
    """Free for the first `free` tokens, then residues: the engine may look ahead while the next mask is
    still None whatever the token in flight."""

    def allowed_tokens(self) -> np.ndarray | None:
        return None if len(self.seen) < self.spec.free else super().allowed_tokens()

    def allowed_set(self) -> set[int]:
        return set(range(self.vocab)) if len(self.seen) < self.spec.free else super().allowed_set()

    def can_look_ahead(self) -> bool:
        return len(self.seen) + 1 < self.spec.free


STARTED: dict[str, ResidueConstraint] = {}  # the last constraint each spec started (tests read what it saw)


@dataclass(frozen=True)
class ResidueSpec:
    tag: str
    modulus: int = 7
    offset: int = 0
    vocab: int = VOCAB

    free: int | None = None  # LateConstraint: free for this many tokens first

    def start(self, vocab_size: int) -> ResidueConstraint:
        if vocab_size != self.vocab:
            raise InvalidRequestError(f"built for {self.vocab} ids, the model has {vocab_size}", "constraint")
        return (ResidueConstraint if self.free is None else LateConstraint)(self, vocab_size)


def test_unpack_bitmask_is_the_packed_set():
    g = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 999):
        sets = [set(np.flatnonzero(g.random(vocab) < p).tolist()) for p in (0.0, 0.3, 1.0)]
        words = torch.from_numpy(np.stack([pack(s, vocab) for s in sets]).view(np.int32))
        got = unpack_bitmask(words, vocab)
        assert got.shape == (3, vocab)
        assert [set(torch.nonzero(r).flatten().tolist()) for r in got] == sets


def test_sampler_never_picks_a_masked_id_and_logprobs_stay_the_models():
    vocab, rows = 389, 6
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=g) * 4
    allowed = [{3, 50, 388}, None, {7}, set(range(0, vocab, 5)), {100, 101}, set(range(200, 300))]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.7, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.2, logprobs=2)]
    masks = [pack(a, vocab) if a is not None else None for a in allowed]
    sampler = Sampler(vocab, "cpu")
    for step in range(40):  # fresh noise each step: sampled rows wander, and must stay inside their sets
        batch = SamplingBatch.build(params, list(range(rows)), [step] * rows, "cpu", vocab_size=vocab, masks=masks)
        out = sampler(logits, batch)
        ids = out.token_ids.tolist()
        for r, (a, i) in enumerate(zip(allowed, ids)):
            if a is not None:
                assert i in a, (step, r, i)
        assert ids[0] == max(allowed[0], key=lambda t: logits[0, t])  # greedy: the best allowed id
        assert ids[1] == int(logits[1].argmax())  # an unconstrained row in the same batch is untouched
        assert ids[2] == 7
        assert torch.allclose(out.logprobs[5], torch.log_softmax(logits[5], -1)[ids[5]])  # the raw distribution
    with pytest.raises(ValueError, match="32-bit words"):
        SamplingBatch.build(params[:1], [0], [0], "cpu", vocab_size=vocab, masks=[np.zeros(3, dtype=np.uint32)])
    with pytest.raises(ValueError, match="rebuilt every step"):
        SamplingBatch.build(params[:1], [0], [0], "cpu", vocab_size=vocab, masks=masks[:1]).next_step()


def test_engine_greedy_under_a_constraint_matches_a_recompute_loop(model, make_engine):
    prompts = [random_prompt(n, 40 + n) for n in (3, 12, 26)]
    engine = make_engine()
    for i, p in enumerate(prompts):
        engine.add_request(request(f"c{i}", p, SamplingParams(temperature=0.0, max_tokens=9,
                                                               constraint=ResidueSpec(f"c{i}", offset=i))))
    engine.add_request(request("free", prompts[0], SamplingParams(temperature=0.0, max_tokens=9)))
    got = {rid: out["ids"] for rid, out in run_to_end(engine).items()}
    for i, p in enumerate(prompts):
        out: list[int] = []
        for k in range(9):  # the rule, one token at a time, on a full recompute of the text so far
            logits = model.full_logits(p + out)[-1].float()
            r = (k + i) % 7
            out.append(max(range(r, VOCAB, 7), key=lambda t: logits[t]))
        assert got[f"c{i}"] == out == STARTED[f"c{i}"].seen, i
    plain = model.full_logits(prompts[0])[-1].argmax().item()
    assert got["free"][0] == plain  # the unconstrained request in the same batch


def test_lookahead_samples_constrained_rows_once_the_token_in_flight_is_read(make_engine):
    """With the lookahead on, the step after a constrained row's is launched ahead but samples only once that
    row's token in flight is read (deferred sampling): its mask (a different residue each step) is built after
    the constraint saw every earlier token, so the tokens equal the run without the lookahead, and steps run
    ahead while the constrained rows decode, not only after them (the free row outlives them by 14 steps)."""
    def run(**overrides) -> tuple[dict, int]:
        engine = make_engine(**overrides)
        for i, n in enumerate((4, 9, 16)):
            constrained = i != 1
            engine.add_request(request(f"l{i}", random_prompt(n, 600 + i), SamplingParams(
                temperature=0.9, seed=i, max_tokens=6 if constrained else 20,
                constraint=ResidueSpec(f"l{i}", modulus=5) if constrained else None)))
        return {rid: out["ids"] for rid, out in run_to_end(engine).items()}, engine.metrics.lookahead_steps_total

    (ahead, looked), (plain, none) = run(async_decode=True), run(async_decode=False)
    assert ahead == plain and none == 0
    assert looked > 20 - 6, looked
    for i in (0, 2):
        assert all(t % 5 == k % 5 for k, t in enumerate(ahead[f"l{i}"]))


def test_lookahead_runs_while_the_constraint_allows_it(make_engine):
    """A constraint free for its first 10 tokens: the engine looks ahead there (its masks are None whatever
    the token in flight, sampled at once) and past it (masked steps sample once the token before is read),
    and the tokens equal the run without the lookahead."""
    def run(**overrides) -> tuple[list[int], int]:
        engine = make_engine(**overrides)
        engine.add_request(request("late", random_prompt(7, 90), SamplingParams(
            temperature=1.0, seed=1, max_tokens=16, constraint=ResidueSpec("late", modulus=4, free=10))))
        return run_to_end(engine)["late"]["ids"], engine.metrics.lookahead_steps_total

    (ahead, looked), (plain, none) = run(async_decode=True), run(async_decode=False)
    assert ahead == plain and none == 0
    assert looked > 10, looked
    assert all(t % 4 == k % 4 for k, t in enumerate(ahead) if k >= 10)


def test_constraint_follows_the_prefill_to_decode_hand_off(make_engine):
    """The prefill side samples the first token under the constraint; the decode side starts its own from the
    spec and replays that token before sampling the next: tokens equal one engine doing both."""
    prompt = random_prompt(21, 77)
    sampling = SamplingParams(temperature=1.0, seed=5, max_tokens=8, constraint=ResidueSpec("h", modulus=3))
    one = make_engine()
    one.add_request(request("h", prompt, sampling))
    whole = run_to_end(one)["h"]["ids"]
    prefill, decode = make_engine(), make_engine()
    prefill.add_request(request("h", prompt, sampling), prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    payload = prefill.export_kv("h")
    (first,) = decode.import_prefilled(request("h", prompt, sampling), payload)
    rest = run_to_end(decode)["h"]["ids"]
    assert first.token_ids + rest == whole
    assert STARTED["h"].seen == whole  # the decode side's constraint saw the prefill's token first


def test_preempted_constrained_requests_keep_their_constraint(make_engine):
    """A pool too small for ten constrained requests at once: sequences are preempted and recomputed, their
    constraints keep their state (every token allowed; the engine's PLACEHOLDER check never fires), the tokens
    equal a roomy pool's, and the pools end empty."""
    specs = [(3, 30), (9, 25), (1, 20), (17, 12), (6, 28), (2, 33), (11, 21), (5, 26), (8, 19), (4, 31)]

    def run(**pool) -> tuple[dict, int]:
        engine = make_engine(max_num_seqs=12, max_model_len=48, async_decode=True, **pool)
        for i, (n, m) in enumerate(specs):
            engine.add_request(request(f"p{i}", random_prompt(n, 900 + i), SamplingParams(
                temperature=0.8, seed=i, max_tokens=m, constraint=ResidueSpec(f"p{i}", modulus=3 + i % 4, offset=i,
                                                                             free=None if i % 2 else 5))))
        out = {rid: o["ids"] for rid, o in run_to_end(engine).items()}
        usage = engine.block_manager.usage()
        assert usage["full_pages_used"] == 0 and usage["sliding_pages_used"] == 0
        return out, engine.metrics.snapshot()["preemptions_total"]

    (tight, preempted), (roomy, _) = run(num_full_pages=36, num_sliding_pages=36, max_num_batched_tokens=32), run()
    assert preempted > 0 and tight == roomy, preempted
    for i, (n, m) in enumerate(specs):
        ids, modulus, free = tight[f"p{i}"], 3 + i % 4, 0 if i % 2 else 5
        assert len(ids) == m
        assert all(t % modulus == (k + i) % modulus for k, t in enumerate(ids) if k >= free), i


@dataclass(frozen=True)
class PreparedSpec(ResidueSpec):
    """A spec with one-time work: records the thread it ran on."""

    def prepare(self) -> None:
        import threading

        PREPARED.append(threading.current_thread().name)


PREPARED: list[str] = []


def test_async_engine_prepares_constraints_on_a_worker_thread(make_engine):
    """ConstraintSpec.prepare (compiling grammars) runs once per request before the engine loop sees it,
    neither on the event loop's thread nor on the engine's; the tokens are the ones without it."""
    import asyncio
    import threading

    from engine.async_engine import AsyncEngine

    prompt = random_prompt(9, 3)
    engine = AsyncEngine(make_engine())

    async def run() -> list[int]:
        ids = []
        async for d in engine.generate(request("pp", prompt, SamplingParams(
                temperature=0.0, max_tokens=5, constraint=PreparedSpec("pp", modulus=3)))):
            ids += d.token_ids
        return ids

    PREPARED.clear()
    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(PREPARED) == 1 and PREPARED[0] not in (threading.current_thread().name, "gptoss-engine")
    plain = make_engine()
    plain.add_request(request("pp", prompt, SamplingParams(temperature=0.0, max_tokens=5,
                                                           constraint=ResidueSpec("pp", modulus=3))))
    assert got == run_to_end(plain)["pp"]["ids"]


def test_a_constraint_for_another_vocabulary_is_refused(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="built for 50 ids"):
        engine.add_request(request("v", [1, 2, 3], SamplingParams(constraint=ResidueSpec("v", vocab=50))))
    with pytest.raises(InvalidRequestError, match="ConstraintSpec"):
        engine.add_request(request("w", [1, 2, 3], SamplingParams(constraint="json")))
    assert not engine.has_unfinished()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_masked_sampling_on_the_gpu_equals_the_cpu():
    """The same logits, masks and seeds at the Harmony vocabulary's size: the same tokens on both devices
    (integer-hash noise), every one allowed."""
    vocab, rows = 201088, 8
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, vocab, generator=g) * 3
    rng = np.random.default_rng(3)
    allowed = [set(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, 2, 50, 5000, 100000, 7, 300, 90)]
    allowed[3] = None
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9), (1.2, 0, 1.0), (0.0, 0, 1.0),
               (0.7, 5, 0.5), (1.0, 100, 1.0)]]
    masks = [pack(a, vocab) if a is not None else None for a in allowed]
    picks = {}
    for device in ("cpu", "cuda"):
        batch = SamplingBatch.build(params, list(range(rows)), [4] * rows, device, vocab_size=vocab, masks=masks)
        picks[device] = Sampler(vocab, device)(logits.to(device), batch).token_ids.tolist()
    assert picks["cpu"] == picks["cuda"]
    assert all(a is None or t in a for a, t in zip(allowed, picks["cuda"]))


def test_structured_output_benchmark_smoke(tmp_path):
    """bench/structured on the CPU, tiny: its engine runs exist, the grammar stays active for the whole of the
    constrained ones (the forced tool call's too: its analysis body), jump-forward takes steps off the forced keys,
    the batch run times both variants, and it writes its JSON and PNG."""
    import json

    from bench import structured

    out = tmp_path / "structured.json"
    structured.main(["--prompt-len", "24", "--out-len", "6", "--host-tokens", "15", "--walks", "1", "--batch", "3",
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["engine"]] == ["no constraint", "constraint, free phase", "grammar active",
                                                        "grammar active, forced keys", "forced keys, no jump-forward",
                                                        "penalties, no constraint", "forced tool call, reasoning"]
    assert [r["tokens_with_grammar_active"] for r in result["engine"]] == [0, 0, 5, 5, 5, 0, 5]
    assert [(r["variant"], r["batch"]) for r in result["batch"]] == [("no constraint", 3),
                                                                     ("forced tool calls, reasoning", 3)]
    assert all(r["steps_timed"] == 5 and r["step_ms"] > 0 for r in result["batch"])  # the 5 decode steps
    forced, one_by_one = result["engine"][3], result["engine"][4]
    assert forced["jump_forward_tokens"] > 0 and one_by_one["jump_forward_tokens"] == 0
    assert forced["decode_steps"] < one_by_one["decode_steps"] == 5
    assert all(r["out_len"] == 6 and r["tpot_ms"] > 0 for r in result["engine"])
    assert len(result["host"]) == 3 and all(r["mask_us_p50"] > 0 for r in result["host"])
    assert out.with_suffix(".png").stat().st_size > 0
