"""Sampler: filter masks against a direct per-row implementation, exact Gumbel-max frequencies,
per-request seed reproducibility independent of the batch, greedy rows, logprobs."""

import math

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingBatch, filter_logits, hash32, uniform_noise


def direct_keep(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The kept token set, one row, written out the slow obvious way."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[:top_k] if top_k > 0 else order
    m = max(logits[i] for i in kept)
    weights = {i: math.exp(logits[i] - m) for i in kept}
    total = sum(weights.values())
    if top_p < 1:
        mass, nucleus = 0.0, []
        for i in kept:  # most likely first, until the mass reaches top_p
            nucleus.append(i)
            mass += weights[i] / total
            if mass >= top_p:
                break
        kept = nucleus
    best = max(weights[i] for i in kept)
    return {i for i in kept if weights[i] >= min_p * best}


@pytest.mark.parametrize("vocab", [1, 19, 99, 989])
def test_filter_masks_match_direct_implementation(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.randint(0, vocab + 2, (rows,), generator=g)
    top_k[::4] = 0
    top_p = torch.rand(rows, generator=g).clamp(min=0.05)
    top_p[1::4] = 1.0
    min_p = torch.rand(rows, generator=g) * 0.5
    min_p[2::4] = 0.0
    filtered = filter_logits(logits, top_k, top_p, min_p)
    for r in range(rows):
        got = set(torch.nonzero(filtered[r] > float("-inf")).flatten().tolist())
        want = direct_keep(logits[r].tolist(), int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert got == want, (r, int(top_k[r]), float(top_p[r]), float(min_p[r]))
        kept = sorted(got)
        assert torch.equal(filtered[r, kept], logits[r, kept])  # kept logits are untouched


def _batch(params, seeds, steps):
    return SamplingBatch.build(params, seeds, steps, "cpu")


def test_uniform_noise_range_and_moments():
    token_hash = hash32(torch.arange(5000, dtype=torch.int64))
    assert len(set(token_hash.tolist())) == 5000  # the hash is a bijection
    u = uniform_noise(torch.tensor([1, 2**31 + 5]), torch.tensor([0, 7]), torch.tensor([0, 99]), token_hash)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1])


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2)])
def test_sampling_frequencies_match_the_filtered_softmax(temperature, top_k, top_p, min_p):
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0, 1.0])
    draws = 20000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * draws
    # One request seed, successive steps: the draws a single request makes over a long generation.
    out = Sampler(7, "cpu")(logits.expand(draws, 7), _batch(params, [1234] * draws, list(range(draws))))
    counts = torch.bincount(out.token_ids, minlength=7).double()
    filtered = filter_logits((logits / temperature)[None], torch.tensor([top_k]), torch.tensor([top_p]),
                             torch.tensor([min_p]))[0]
    p = torch.softmax(filtered.double(), dim=-1)
    assert counts[p == 0].sum() == 0  # never a filtered-out token
    sigma = (draws * p * (1 - p)).sqrt()
    assert ((counts - draws * p).abs() <= 4.5 * sigma + 1).all(), (counts / draws, p)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(0)
    vocab = 211
    logits = torch.randn(6, vocab, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=s) for s in range(6)]
    seeds, steps = [11, 12, 13, 11, 2**64 - 1, 0], [0, 0, 5, 1, 3, 9]
    sampler = Sampler(vocab, "cpu")
    together = sampler(logits, _batch(params, seeds, steps)).token_ids
    for r in range(6):  # alone, and inside a permuted batch
        alone = sampler(logits[r:r + 1], _batch(params[r:r + 1], seeds[r:r + 1], steps[r:r + 1])).token_ids
        assert alone.item() == together[r].item()
    perm = [5, 3, 1, 0, 2, 4]
    shuffled = sampler(logits[perm], _batch([params[i] for i in perm], [seeds[i] for i in perm],
                                            [steps[i] for i in perm])).token_ids
    assert shuffled.tolist() == together[perm].tolist()
    # Different seeds or steps give different draws (flat logits: any token is equally likely).
    flat = torch.zeros(64, 5000)
    draws = Sampler(5000, "cpu")(flat, _batch([SamplingParams(temperature=1.0)] * 64, list(range(64)), [0] * 64)).token_ids
    assert len(set(draws.tolist())) > 60


def test_greedy_rows_in_a_mixed_batch_and_logprobs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 37, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, logprobs=5)]
    out = Sampler(37, "cpu")(logits, _batch(params, [1, 2, 3, 4], [0, 0, 0, 0]))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    top, ids = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, ids) and torch.allclose(out.top_logprobs, top)


@pytest.mark.parametrize("vocab", [50, 989])
def test_top_k_candidate_path_picks_what_the_full_vocabulary_path_picks(vocab):
    """With top_k on every sampled row the sampler looks at max(top_k) candidates only; the token
    must be the one Gumbel-max over the whole filtered vocabulary picks (same noise per token id)."""
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 2
    params = [SamplingParams(temperature=0.5 + (r % 5) / 4, top_k=1 + (r * 7) % 40, top_p=[1.0, 0.9, 0.5][r % 3],
                             min_p=[0.0, 0.1][r % 2]) for r in range(rows)]
    params[5] = SamplingParams(temperature=0.0, top_k=3)  # a greedy row rides along
    seeds, steps = list(range(100, 100 + rows)), [r * 3 for r in range(rows)]
    batch = _batch(params, seeds, steps)
    assert batch.top_k_cap == 40
    got = Sampler(vocab, "cpu")(logits, batch).token_ids
    tempered = logits / batch.temperature.clamp(min=1e-9)[:, None]
    full = filter_logits(tempered, batch.top_k, batch.top_p, batch.min_p)
    u = uniform_noise(batch.seed_lo, batch.seed_hi, batch.current_step(), hash32(torch.arange(vocab)))
    want = (full - torch.log(-torch.log(u))).argmax(dim=-1)
    want[5] = logits[5].argmax()
    assert got.tolist() == want.tolist()
