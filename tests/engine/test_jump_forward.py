"""Jump-forward decoding (EngineConfig.jump_forward_tokens): a constraint's forced tokens (each mask allows one
id) run as a draft of the decode step, all accepted. The tokens, logprobs and finish reasons equal the engine
without it (one forced token per step), with and without the lookahead, at stop tokens, limits and under
preemption; and the drafts really ran (the metric, and fewer deltas per request). The Harmony constraint's
own forced_tokens: tests/serve_app/test_harmony_constrain.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfigError
from engine.metrics import PrometheusCollector
from engine.request import FINISH_LENGTH, FINISH_STOP, SamplingParams
from engine.sequence import PLACEHOLDER
from tests.engine.engine_testlib import assert_pool_full, random_prompt, request, run_to_end, with_requests
from tests.engine.test_constraints import pack
from tests.engine.test_speculative import assert_same


class Forcing:
    """Position k (0-based output index) is forced to one id unless k % period == period - 1, where any id
    of one residue class goes. Like HarmonyConstraint it knows the forced tokens after the positions whose
    masks it gave only while each of those positions was forced (else that token is unknown)."""

    def __init__(self, spec: "ForcingSpec", vocab: int):
        self.spec, self.vocab, self.seen, self.handed = spec, vocab, [], 0

    def forced_id(self, k: int) -> int | None:
        if k % self.spec.period == self.spec.period - 1:
            return None
        return (k * 37 + self.spec.offset) % self.vocab

    def allowed_tokens(self):
        k = len(self.seen) + self.handed
        self.handed += 1
        f = self.forced_id(k)
        return pack({f} if f is not None else set(range(k % 3, self.vocab, 3)), self.vocab)

    def accept(self, token_id: int) -> None:
        k = len(self.seen)
        f = self.forced_id(k)
        assert token_id == f if f is not None else token_id % 3 == k % 3, (k, token_id)
        self.seen.append(token_id)
        self.handed = max(0, self.handed - 1)

    def _known(self) -> bool:  # every position whose mask was given has a forced token
        return all(self.forced_id(len(self.seen) + i) is not None for i in range(self.handed))

    def can_look_ahead(self) -> bool:
        return self.handed > 0 and self._known()

    def forced_tokens(self, limit: int) -> list[int]:
        if not self._known():
            return []
        out, k = [], len(self.seen) + self.handed
        while len(out) < limit and (f := self.forced_id(k)) is not None:
            out.append(f)
            k += 1
        return out


@dataclass(frozen=True)
class ForcingSpec:
    period: int = 4
    offset: int = 0

    def start(self, vocab_size: int) -> Forcing:
        return Forcing(self, vocab_size)


def forcing(max_tokens: int, period: int = 4, offset: int = 0, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=offset, max_tokens=max_tokens, logprobs=2,
                          constraint=ForcingSpec(period, offset), **kw)


def both(make_engine, reqs, **overrides) -> tuple[dict, dict, object]:
    """(without jump-forward, with it, the engine with it)."""
    outs, engine = [], None
    for jump in (0, 8):
        engine = make_engine(jump_forward_tokens=jump, **overrides)
        for r in reqs:
            engine.add_request(r)
        outs.append(run_to_end(engine))
        assert_pool_full(engine)
    return outs[0], outs[1], engine


@pytest.mark.parametrize("lookahead", [False, True])
def test_forced_tokens_run_as_drafts_with_the_same_tokens(make_engine, lookahead):
    reqs = [request("f4", random_prompt(9, 1), forcing(30, period=4, offset=1)),
            request("f8", random_prompt(5, 2), forcing(25, period=8, offset=2)),
            request("free", random_prompt(7, 3), SamplingParams(temperature=0.0, max_tokens=20))]
    plain, jumped, engine = both(make_engine, reqs, async_decode=lookahead)
    assert_same(jumped, plain)
    snap = engine.metrics.snapshot()
    assert snap["jump_forward_tokens_total"] >= 20, snap
    assert snap["draft_tokens_total"] == 0  # (not speculative drafts)
    for rid in ("f4", "f8"):
        assert jumped[rid]["deltas"] < plain[rid]["deltas"] - 3, (rid, jumped[rid]["deltas"], plain[rid]["deltas"])
    if lookahead:
        assert engine.lookahead_steps > 0
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(engine.metrics))
    assert registry.get_sample_value("gptoss_engine_jump_forward_tokens_total") == snap["jump_forward_tokens_total"]


def test_a_stop_token_among_forced_tokens_and_the_length_limit(make_engine):
    probe = run_to_end(with_requests(make_engine(jump_forward_tokens=0), [request("s", random_prompt(6, 4), forcing(30))]))
    ids = probe["s"]["ids"]
    stop = next(t for k, t in enumerate(ids) if k >= 5 and k % 4 != 3 and t not in ids[:k])  # a forced one
    reqs = [request("s", random_prompt(6, 4), forcing(30, stop_token_ids=(stop,))),
            request("len", random_prompt(8, 5), forcing(11, offset=3))]  # ends inside a forced run
    plain, jumped, engine = both(make_engine, reqs, async_decode=True)
    assert_same(jumped, plain)
    assert jumped["s"]["finish"] == FINISH_STOP and jumped["s"]["ids"][-1] == stop
    assert jumped["len"]["finish"] == FINISH_LENGTH and len(jumped["len"]["ids"]) == 11
    assert engine.metrics.snapshot()["jump_forward_tokens_total"] > 0


def test_preemption_and_a_tiny_pool_keep_the_tokens(make_engine):
    reqs = [request(f"p{i}", random_prompt(n, 40 + i), forcing(m, period=3 + i % 3, offset=i))
            for i, (n, m) in enumerate([(5, 30), (9, 22), (14, 26), (3, 18)])]
    tiny = dict(max_model_len=48, num_full_pages=14, num_sliding_pages=9, max_num_batched_tokens=16,
                async_decode=True)
    plain, jumped, engine = both(make_engine, reqs, **tiny)
    assert_same(jumped, plain)
    snap = engine.metrics.snapshot()
    assert snap["preemptions_total"] > 0 and snap["jump_forward_tokens_total"] > 0, snap


def test_typed_errors():
    from engine.config import EngineConfig

    for bad in (-1, 17, 1.5, True):
        with pytest.raises(EngineConfigError, match="jump_forward_tokens"):
            EngineConfig(jump_forward_tokens=bad)


def test_abort_while_forced_rows_are_in_flight_returns_only_read_tokens(make_engine):
    engine = make_engine(async_decode=True)
    engine.add_request(request("a", random_prompt(6, 11), forcing(40, period=6)))
    got = []
    for _ in range(50):
        got += [t for d in engine.step() for t in d.token_ids]
        inflight = engine._inflight
        if inflight is not None and inflight.forced:
            break
    else:
        raise AssertionError("no forced rows were ever in flight")
    delta = engine.abort("a")
    assert PLACEHOLDER not in delta.token_ids
    tokens = got + delta.token_ids
    expected = run_to_end(with_requests(make_engine(jump_forward_tokens=0), [request("a", random_prompt(6, 11),
                                                                             forcing(40, period=6))]))["a"]["ids"]
    assert tokens == expected[: len(tokens)]
    assert not engine.has_unfinished()
    assert_pool_full(engine)
    assert engine.step() == [] and engine._inflight is None  # the step in flight is read and dropped


def test_forced_drafts_on_the_decode_side_of_a_hand_off(make_engine):
    """Prefill on one engine, decode on another (disaggregated serving): the decode side's constraint replays
    the first token, then runs forced tokens as drafts; the tokens equal one engine without jump-forward."""
    prompt, sampling = random_prompt(19, 12), forcing(24, period=5, offset=4)
    whole = run_to_end(with_requests(make_engine(jump_forward_tokens=0), [request("h", prompt, sampling)]))["h"]["ids"]
    prefill, decode = make_engine(), make_engine(async_decode=True)
    prefill.add_request(request("h", prompt, sampling), prefill_only=True)
    run_to_end(prefill, prefill.step_prefill)
    (first,) = decode.import_prefilled(request("h", prompt, sampling), prefill.export_kv("h"))
    rest = run_to_end(decode)["h"]["ids"]
    assert first.token_ids + rest == whole
    assert decode.metrics.snapshot()["jump_forward_tokens_total"] > 0
    assert_pool_full(decode)
