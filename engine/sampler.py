"""Batched sampling: temperature, top-k, top-p, min-p, per-request seeds and top-N logprobs.

Randomness is counter-based: the noise for (request seed, step, token id) is an integer hash of
the three, computed with torch integer ops on the logits' device. Sampling is the Gumbel-max trick,
argmax(logits / T + Gumbel noise) over the tokens the filters keep, which draws exactly from the
filtered softmax. Why this and not torch.multinomial with a Generator per request:
- no host synchronisation and no per-request kernel launches: one batched pass per step, and the
  only device-to-host copy is the engine's single read of the sampled ids;
- reproducible per request whatever the batch it lands in, and across preemption/recompute and
  the prefill -> decode hand-off (the decode side continues at step = tokens generated so far);
- the same numbers on CPU and GPU (integer hashing is exact).

Penalties (OpenAI's presence and frequency penalties, SamplingParams) come first, on the raw logits of
the rows that set them: logit -= frequency * count + presence * (count > 0), with count the times the
token appears among the request's generated tokens (special ids exempt), so greedy rows see them too.
The history travels with the batch (host lists, rebuilt every step); the engine does not look ahead
past a penalized row, so no generated token is missing from it. logit_bias (OpenAI's) is added to the
raw logits too, every step, from (id, bias) pairs that stay with the batch. Then structured output:
rows with a token constraint send a packed bitmask of their allowed ids (computed on the host from the
tokens so far, so such rows, like penalized ones, are rebuilt every step) and every other id drops to
-inf before anything picks a token.

Filters apply in this order on the tempered distribution: top-k, then top-p on what top-k kept
(the smallest set of most likely tokens whose mass reaches top_p), then min-p (keep p >= min_p *
p_max, which renormalisation does not change). Logprobs are those of the model's own distribution
(log_softmax of the raw logits, before temperature and filters).

When every sampling row sets top_k, only the top max(top_k) candidates can win: the sampler works on
`topk` of them and hashes noise for those ids alone, instead of sorting and hashing the whole
vocabulary. The noise of a token does not depend on the path, so both give the same tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from engine.request import SamplingParams
from engine.sequence import PLACEHOLDER, Sequence

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # odd multiplier < 2**31: products of 32-bit values stay inside int64


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mix on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MULT) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MULT) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                  token_hash: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), a pure function of (seed, step, token id): [B, V] for token_hash [V] (every
    token), [B, K] for token_hash [B, K] (each row's candidate tokens)."""
    key = hash32(seed_lo ^ hash32(seed_hi ^ hash32((step + 0x9E3779B9) & _MASK32)))  # [B]
    bits = hash32(key[:, None] ^ token_hash)
    # 23 bits keep (k + 0.5) / 2**23 exactly representable in fp32, so u never rounds to 0 or 1.
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _keep_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k and top-p keep mask [B, W] over logits sorted best first."""
    rank = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    k = torch.where(top_k > 0, top_k, sorted_logits.shape[-1])
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely kept tokens
    # top_p = 1 keeps everything even where the fp32 cumsum overshoots 1.
    return keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    best = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits - best < torch.log(min_p)[:, None], float("-inf"))


def per_token_sums(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] fp32: row b sums values[b, j] at token ids[b, j]; ids [B, L] are padded with `vocab`
    (a spare column, dropped)."""
    sums = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    return sums.scatter_add_(1, ids, values)[:, :vocab]


def padded_rows(rows: list[list], fill) -> list[list]:
    """Rows of one width (at least 1), padded with `fill`."""
    width = max(1, max(map(len, rows)))
    return [list(r) + [fill] * (width - len(r)) for r in rows]


def bitmask_words(vocab: int) -> int:
    """32-bit words of a packed bitmask over `vocab` ids."""
    return (vocab + 31) // 32


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, W] int32 packed masks (bit i % 32 of word i // 32) -> [B, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shifts; & 1 keeps the one bit
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def apply_penalties(logits: torch.Tensor, history: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    exempt_from: int | None) -> torch.Tensor:
    """logits [B, V] fp32 minus the penalties of the tokens in `history` [B, L] int64 (padded with V);
    presence, frequency [B] fp32; ids >= exempt_from are never penalized."""
    v = logits.shape[1]
    counts = per_token_sums(history, torch.ones_like(history, dtype=torch.float32), v)
    if exempt_from is not None and exempt_from < v:
        counts[:, exempt_from:] = 0
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  *, sort: bool = True, use_min_p: bool = True) -> torch.Tensor:
    """Tempered logits [B, V] with the tokens top-k / top-p / min-p drop set to -inf.

    top_k [B] int64 (0: off), top_p [B] float (1: off), min_p [B] float (0: off). `sort` and
    `use_min_p` are host-side facts from the request parameters (False: skip that pass), so the
    device never reports back to the host here."""
    if sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        keep = _keep_sorted(sorted_logits, top_k, top_p)
        drop = torch.empty_like(keep).scatter_(1, order, ~keep)
        logits = logits.masked_fill(drop, float("-inf"))
    return _apply_min_p(logits, min_p) if use_min_p else logits


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device. Flags are host-side facts."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seed_lo: torch.Tensor  # [B] int64, low / high 32 bits of the request seed
    seed_hi: torch.Tensor
    step: torch.Tensor  # [B] int64: tokens the request had generated before this one when the batch was built
    all_greedy: bool
    any_greedy: bool
    any_sort: bool  # some sampled row uses top-k or top-p
    any_min_p: bool
    top_k_cap: int | None  # max top_k when every sampled row sets one: sample among that many candidates
    num_logprobs: int | None  # the largest top-N asked for; None: nobody wants logprobs
    # Penalties (None: no row sets one): [B] fp32 each, and each row's generated ids [B, L] padded with V.
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    history: torch.Tensor | None = None
    # logit_bias (None: no row sets one): ids [B, L] int64 padded with V, and their biases [B, L] fp32.
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Token constraints (None: no row has one this step): [B, ceil(V / 32)] int32 packed allowed-id masks,
    # all ones in unconstrained rows.
    allowed: torch.Tensor | None = None
    steps_since_built: int = 0  # next_step calls since: what `current_step` adds to `step`

    @property
    def penalized(self) -> bool:
        return self.history is not None

    def current_step(self) -> torch.Tensor:
        """[B] int64: tokens each request has generated before the one sampled now (the noise's counter)."""
        return self.step + self.steps_since_built if self.steps_since_built else self.step

    def next_step(self) -> "SamplingBatch":
        """The same rows one token later (every row sampled once since). The step counters move on the host and
        are added on the device only where noise is drawn (`current_step`): an all-greedy batch launches
        nothing for them. Not for penalized or constrained batches: their history or masks follow the token just
        sampled."""
        if self.penalized or self.allowed is not None:
            raise ValueError("a penalized or constrained batch is rebuilt every step (from host state)")
        return dataclasses.replace(self, steps_since_built=self.steps_since_built + 1)

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], steps: list[int],
              device: torch.device | str, histories: list[list[int]] | None = None,
              vocab_size: int | None = None, masks: list[np.ndarray | None] | None = None) -> "SamplingBatch":
        """histories: each row's generated ids so far (needed when a row sets penalties), vocab_size pads them;
        masks: each row's packed allowed-id bitmask (TokenConstraint.allowed_tokens) or None."""
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        penalties = {}
        if any(p.has_penalties for p in params):
            if histories is None or vocab_size is None:
                raise ValueError("penalized rows need their generated ids (histories) and the vocabulary size")
            padded = padded_rows([h if p.has_penalties else [] for p, h in zip(params, histories)], vocab_size)
            penalties = dict(presence=t([p.presence_penalty for p in params], torch.float32),
                             frequency=t([p.frequency_penalty for p in params], torch.float32),
                             history=t(padded, torch.int64))
        if any(p.logit_bias for p in params):
            if vocab_size is None:
                raise ValueError("logit_bias rows need the vocabulary size")
            rows = padded_rows([p.logit_bias for p in params], (vocab_size, 0.0))
            penalties.update(bias_ids=t([[i for i, _ in r] for r in rows], torch.int64),
                             bias_values=t([[b for _, b in r] for r in rows], torch.float32))

        if masks is not None and any(m is not None for m in masks):
            if vocab_size is None:
                raise ValueError("constrained rows need the vocabulary size")
            width = bitmask_words(vocab_size)
            stacked = np.full((len(masks), width), -1, dtype=np.int32)  # unconstrained rows: every id
            for i, m in enumerate(masks):
                if m is not None:
                    m = np.asarray(m)
                    if m.shape != (width,) or m.dtype.itemsize != 4:
                        raise ValueError(f"row {i}'s token mask is {m.dtype} {m.shape}, expected ({width},) 32-bit words")
                    stacked[i] = m.view(np.int32)
            penalties["allowed"] = torch.from_numpy(stacked).to(device, non_blocking=True)

        seeds = [s % 2**64 for s in seeds]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        greedy = [p.temperature == 0 for p in params]
        sampled = [p for p in params if p.temperature > 0]
        return SamplingBatch(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seed_lo=t([s & _MASK32 for s in seeds], torch.int64),
            seed_hi=t([s >> 32 for s in seeds], torch.int64),
            step=t(steps, torch.int64),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_sort=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            any_min_p=any(p.min_p > 0 for p in sampled),
            top_k_cap=max(p.top_k for p in sampled) if sampled and all(p.top_k > 0 for p in sampled) else None,
            num_logprobs=max(wanted) if wanted else None,
            **penalties,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] fp32: log p(chosen token)
    top_ids: torch.Tensor | None = None  # [B, N] int64, best first
    top_logprobs: torch.Tensor | None = None  # [B, N] fp32


class HostTokens:
    """A SamplerOutput on its way to the host: on CUDA, copies into pinned buffers queued right behind
    the sampler and an event after them, so `wait` blocks for this step's sampler only, not for work
    queued later (the engine's next step may already be running)."""

    def __init__(self, out: SamplerOutput):
        tensors = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
        self.event = None
        if out.token_ids.is_cuda:
            self.host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def wait(self) -> tuple[list[int], list[float] | None, tuple[list, list] | None]:
        """(token ids, logprobs or None, (top ids, top logprobs) or None) as Python lists."""
        if self.event is not None:
            self.event.synchronize()
        ids, logprobs, top_ids, top_logprobs = self.host
        return (ids.tolist(), logprobs.tolist() if logprobs is not None else None,
                (top_ids.tolist(), top_logprobs.tolist()) if top_ids is not None else None)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, penalty_exempt_from: int | None = None):
        """penalty_exempt_from: the first special id (Harmony's control tokens), never penalized."""
        self.vocab_size = vocab_size
        self.penalty_exempt_from = penalty_exempt_from
        self.token_hash = hash32(torch.arange(vocab_size, dtype=torch.int64, device=device))
        self.row_argmax = None  # the greedy pick on CUDA: one Triton launch (kernels/sampling/argmax_triton.py)
        if torch.device(device).type == "cuda":
            from kernels.sampling.argmax_triton import RowArgmax

            self.row_argmax = RowArgmax(device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits.argmax(dim=-1), on CUDA by RowArgmax (the same indices)."""
        return self.row_argmax(logits) if self.row_argmax is not None and logits.is_cuda else logits.argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits = logits.float()  # [B, V]
        if batch.penalized:
            logits = apply_penalties(logits, batch.history, batch.presence, batch.frequency, self.penalty_exempt_from)
        if batch.bias_ids is not None:
            logits = logits + per_token_sums(batch.bias_ids, batch.bias_values, logits.shape[1])
        if batch.allowed is not None:
            logits = logits.masked_fill(~unpack_bitmask(batch.allowed, logits.shape[1]), float("-inf"))
        greedy_ids = self.argmax(logits) if batch.any_greedy else None
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
            tempered = logits / temperature[:, None]  # [B, V]
            if batch.top_k_cap is not None and batch.top_k_cap < self.vocab_size:
                cand, cand_ids = tempered.topk(batch.top_k_cap, dim=-1)  # [B, K], best first
                cand = cand.masked_fill(~_keep_sorted(cand, batch.top_k, batch.top_p), float("-inf"))
                if batch.any_min_p:
                    cand = _apply_min_p(cand, batch.min_p)
                u = uniform_noise(batch.seed_lo, batch.seed_hi, batch.current_step(), self.token_hash[cand_ids])
                pick = (cand - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)
                token_ids = cand_ids.gather(1, pick)[:, 0]
            else:
                if batch.any_sort or batch.any_min_p:
                    tempered = filter_logits(tempered, batch.top_k, batch.top_p, batch.min_p,
                                             sort=batch.any_sort, use_min_p=batch.any_min_p)
                u = uniform_noise(batch.seed_lo, batch.seed_hi, batch.current_step(), self.token_hash)
                token_ids = (tempered - torch.log(-torch.log(u))).argmax(dim=-1)
            if greedy_ids is not None:
                token_ids = torch.where(batch.temperature > 0, token_ids, greedy_ids)
        out = SamplerOutput(token_ids)
        if batch.num_logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)  # the model's own distribution (module docstring)
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            if batch.num_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(batch.num_logprobs, dim=-1)
        return out


def may_sample_ahead(seq: Sequence) -> bool:
    """Whether seq's next sample may be drawn before its token in flight is read (the engine's lookahead):
    never with penalties (their history needs it), with a constraint when it says that token cannot change
    the next mask."""
    return not seq.sampling.has_penalties and (seq.constraint is None or seq.constraint.can_look_ahead())


class BatchBuilder:
    """The SamplingBatch of each step, from the sequences that sample in it. When the same sequences sample
    again, each one token further (a decode step of an unchanged batch), and no row needs host state
    (penalties, a token mask), the last batch is reused with its step counters moved on the device: no
    rebuild, no host-to-device copies."""

    def __init__(self, device: torch.device | str, vocab_size: int):
        self.device, self.vocab_size = device, vocab_size
        self._last: tuple[list[Sequence], list[int], SamplingBatch] | None = None

    @staticmethod
    def steps_of(rows: list[Sequence]) -> list[int]:
        """The step (output index) each row samples, before the step's placeholders are appended."""
        steps, last, j = [], None, 0  # a draft's rows (one sequence, in a row) sample its next steps in turn
        for s in rows:
            j = j + 1 if s is last else 0
            steps.append(len(s.output_ids) + j)
            last = s
        return steps

    def __call__(self, rows: list[Sequence], steps: list[int] | None = None) -> SamplingBatch:
        """steps: from `steps_of` when the batch is built after the step was launched (deferred sampling:
        the rows' own placeholders are then in their outputs); finished rows then sample unmasked (their
        tokens are dropped)."""
        steps = self.steps_of(rows) if steps is None else steps
        last = self._last
        masks = [s.constraint.allowed_tokens() if s.constraint is not None and not s.is_finished else None
                 for s in rows]
        penalized = [s.sampling.has_penalties for s in rows]
        host_state = any(penalized) or any(m is not None for m in masks)
        if not host_state and last is not None and last[2].allowed is None and not last[2].penalized \
                and len(last[0]) == len(rows) and all(a is b for a, b in zip(last[0], rows)) \
                and all(n == m + 1 for n, m in zip(steps, last[1])):
            batch = last[2].next_step()
        else:
            histories = None
            if host_state:  # (a masked row may have a token in flight where its constraint allowed it)
                histories = [s.output_ids[:step] if p else [] for s, p, step in zip(rows, penalized, steps)]
                if any(PLACEHOLDER in h for h in histories):
                    raise RuntimeError("a penalized row has a token in flight: its history would miss it")
            batch = SamplingBatch.build([s.sampling for s in rows], [s.seed for s in rows], steps, self.device,
                                        histories, self.vocab_size, masks if host_state else None)
        self._last = (rows, steps, batch)
        return batch
