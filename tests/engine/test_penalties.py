"""Presence and frequency penalties: the sampler against a per-row counting reference (special ids
exempt), the engine's greedy tokens against a full-recompute loop that applies the same rule, the same
tokens with the lookahead asked for (it steps aside for penalized rows), and parameter checks."""

from collections import Counter

import pytest
import torch

from engine.request import InvalidRequestError, SamplingParams
from engine.sampler import Sampler, SamplingBatch, apply_penalties
from tests.engine.engine_testlib import VOCAB, random_prompt, request, run_to_end


def counted(logits: list[float], history: list[int], presence: float, frequency: float, exempt_from: int) -> list[float]:
    counts = Counter(t for t in history if t < exempt_from)
    return [x - frequency * counts[i] - presence * (counts[i] > 0) for i, x in enumerate(logits)]


def test_penalties_match_a_counting_reference():
    g = torch.Generator().manual_seed(3)
    vocab, rows, exempt = 41, 6, 33
    logits = torch.randn(rows, vocab, generator=g) * 2
    histories = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (0, 1, 5, 17, 40, 9)]
    histories[3] += [35, 35, 40]  # special ids: never penalized
    presence = [0.0, 0.5, -1.0, 2.0, 0.3, 0.0]
    frequency = [0.0, 1.5, 0.2, -0.7, 2.0, 0.0]
    width = max(map(len, histories))
    padded = torch.tensor([h + [vocab] * (width - len(h)) for h in histories])
    got = apply_penalties(logits, padded, torch.tensor(presence), torch.tensor(frequency), exempt)
    for b in range(rows):
        want = counted(logits[b].tolist(), histories[b], presence[b], frequency[b], exempt)
        assert got[b].tolist() == pytest.approx(want, abs=1e-5), b


def test_sampler_applies_penalties_to_greedy_and_sampled_rows_but_not_to_logprobs():
    vocab = 23
    logits = torch.zeros(3, vocab)
    logits[:, 5], logits[:, 9] = 3.0, 2.5  # 5 wins unless penalized
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),  # 5 seen once: 2.0 < 2.5
              SamplingParams(temperature=0.0, logprobs=0),  # no penalties: 5
              SamplingParams(temperature=1.0, top_k=1, presence_penalty=2.0, seed=1, logprobs=0)]  # top-1 after: 9
    histories = [[5], [5, 5, 5], [5, 5]]
    batch = SamplingBatch.build(params, [0, 0, 0], [1, 3, 2], "cpu", histories, vocab)
    out = Sampler(vocab, "cpu")(logits, batch)
    assert out.token_ids.tolist() == [9, 5, 9]
    raw = torch.log_softmax(logits, dim=-1)  # logprobs stay the model's own distribution
    assert out.logprobs.tolist() == pytest.approx([raw[0, 9].item(), raw[1, 5].item(), raw[2, 9].item()])
    with pytest.raises(ValueError, match="rebuilt every step"):
        batch.next_step()
    with pytest.raises(ValueError, match="histories"):
        SamplingBatch.build(params, [0, 0, 0], [1, 3, 2], "cpu")


def test_engine_greedy_with_penalties_matches_a_recompute_loop(model, make_engine):
    # Negative: this random model hardly repeats a token by itself, so positive penalties would rarely bite;
    # negative ones pull toward repeats, and the same rule decides either way.
    presence, frequency = -1.5, -0.5
    prompts = [random_prompt(n, 300 + n) for n in (3, 11, 25)]
    engine = make_engine()
    reqs = [request(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=10, presence_penalty=presence,
                                                frequency_penalty=frequency)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    got = {rid: out["ids"] for rid, out in run_to_end(engine).items()}
    plain = make_engine()
    for i, p in enumerate(prompts):
        plain.add_request(request(f"q{i}", p, SamplingParams(temperature=0.0, max_tokens=10)))
    unpenalized = {rid: out["ids"] for rid, out in run_to_end(plain).items()}
    for i, p in enumerate(prompts):
        out: list[int] = []
        for _ in range(10):  # the rule, one token at a time, on a full recompute of the text so far
            logits = model.full_logits(p + out)[-1].float().tolist()
            out.append(max(range(VOCAB), key=counted(logits, out, presence, frequency, VOCAB).__getitem__))
        assert got[f"q{i}"] == out, i
    assert got != unpenalized  # the penalties changed something in 30 tokens
    assert any(len(set(ids)) < len(ids) for ids in got.values())  # and made repeats


def test_lookahead_samples_penalized_rows_once_the_token_in_flight_is_read(make_engine):
    """Asked for (CPU default is off), the lookahead gives the same tokens. The step after a penalized row's
    is launched ahead but samples only once that row's token is read (the engine raises if a penalized history
    ever held a token in flight when its batch was built), so steps run ahead while the penalized rows decode,
    not only after them (the unpenalized row outlives them by 14 steps)."""
    def run(**overrides) -> tuple[dict, int]:
        engine = make_engine(**overrides)
        for i, n in enumerate((4, 9, 16)):
            penalized = i != 1
            engine.add_request(request(f"l{i}", random_prompt(n, 500 + i), SamplingParams(
                temperature=0.9, seed=i, max_tokens=6 if penalized else 20, presence_penalty=-1.0 if penalized else 0.0,
                frequency_penalty=-0.6 if penalized else 0.0)))
        out = {rid: out["ids"] for rid, out in run_to_end(engine).items()}
        return out, engine.metrics.lookahead_steps_total

    (ahead, looked), (plain, none) = run(async_decode=True), run(async_decode=False)
    assert ahead == plain and none == 0
    assert looked > 20 - 6, looked


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("presence_penalty", float("nan"))])
def test_penalties_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()


def test_logit_bias_is_added_to_the_raw_logits_and_survives_the_next_step():
    g = torch.Generator().manual_seed(8)
    vocab = 29
    logits = torch.randn(3, vocab, generator=g)
    params = [SamplingParams(temperature=0.0, logit_bias=((3, 100.0),)),  # forced
              SamplingParams(temperature=0.0, logit_bias=tuple((i, -100.0) for i in range(vocab) if i != 17)),  # only 17 left
              SamplingParams(temperature=0.0, logit_bias=((int(logits[2].argmax()), -100.0), (0, 0.5)))]
    batch = SamplingBatch.build(params, [0, 0, 0], [0, 0, 0], "cpu", None, vocab)
    sampler = Sampler(vocab, "cpu")
    want_last = logits[2].clone()
    want_last[int(logits[2].argmax())] -= 100
    want_last[0] += 0.5
    for b in (batch, batch.next_step()):  # an unchanged batch one token later keeps its biases
        assert sampler(logits, b).token_ids.tolist() == [3, 17, int(want_last.argmax())]


@pytest.mark.parametrize("bias,why", [(((5, 101.0),), "between -100 and 100"), (((-1, 1.0),), "token ids"),
                                      (((7, 1.0),) * 301, "up to 300")])
def test_bad_logit_bias_is_refused(bias, why):
    with pytest.raises(InvalidRequestError, match=why):
        SamplingParams(logit_bias=bias).validate(vocab_size=50)
    with pytest.raises(InvalidRequestError, match="token ids in"):
        SamplingParams(logit_bias=((50, 1.0),)).validate(vocab_size=50)
