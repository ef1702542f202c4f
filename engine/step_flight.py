"""A step in flight: what `LLMEngine._launch` queued (forward, sampler, the rows' output slots, the drafts it
verifies), how the ids it samples reach the next step's inputs on the device (the lookahead), and how many of a
draft's tokens it accepted once read."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.metrics import StepTimes
from engine.request import TokenLogprob
from engine.sampler import HostTokens, SamplerOutput
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """The forward or the sampler raised; `request_ids` were in that step (the caller aborts them)."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class LaunchedStep:
    """A step whose forward and sampler are queued and whose sequences are advanced, tokens not read."""

    out: SchedulerOutput
    rows: list[Sequence]  # the sequences that sample, in logits order (k + 1 rows in a row for a k-token draft)
    slots: list[int]  # where each row's token goes in its output_ids (a placeholder until read; a draft's
    # rows share their sequence's one placeholder: its first token goes there, accepted ones after it; forced
    # rows have one each)
    drafts: dict[int, tuple[int, ...]]  # id(seq) -> the draft verified this step (engine/speculative.py)
    forced: dict[int, tuple[int, ...]]  # id(seq) -> forced tokens run this step (jump-forward): certain, so each
    # row has its own placeholder and the step after may be launched ahead
    sampled: SamplerOutput | None  # on the device (None: nothing sampled, or not yet: `pending`)
    host: HostTokens | None
    times: StepTimes
    # Deferred sampling (a lookahead step whose rows need the tokens in flight to sample: a penalty's history,
    # a constraint's mask): the logits and the rows' steps until the step before is read
    # (`LLMEngine._sample_pending`).
    pending: tuple[torch.Tensor, list[int]] | None = None
    failure: StepFailedError | None = None  # its deferred sampler failed: raised when the step is read


def feed_inputs(inputs, out: SchedulerOutput, feed: LaunchedStep):
    """Inputs with `feed`'s sampled ids (device) where the host arrays hold its placeholders."""
    ids = feed.sampled.token_ids
    if len(out.scheduled) == len(feed.rows) and all(
            s.seq is seq and s.num_tokens == 1 and s.start == len(seq.prompt_ids) + slot
            for s, seq, slot in zip(out.scheduled, feed.rows, feed.slots)):
        return dataclasses.replace(inputs, input_ids=ids)  # the same decode batch, one token further
    rows_of: dict[int, dict[int, int]] = {}  # id(seq) -> {slot: the row whose sample fills it}
    for i, (seq, slot) in enumerate(zip(feed.rows, feed.slots)):
        rows_of.setdefault(id(seq), {}).setdefault(slot, i)  # (forced rows: a slot each)
    flat, src, offset = [], [], 0
    for s in out.scheduled:
        for slot, i in rows_of.get(id(s.seq), {}).items():
            position = len(s.seq.prompt_ids) + slot  # of a token not read yet
            if s.start <= position < s.end:
                flat.append(offset + position - s.start)
                src.append(i)
        offset += s.num_tokens
    if not flat:
        return inputs
    device = inputs.input_ids.device
    patched = inputs.input_ids.clone()
    patched[torch.tensor(flat).to(device, non_blocking=True)] = ids[torch.tensor(src).to(device, non_blocking=True)]
    return dataclasses.replace(inputs, input_ids=patched)


def accepted_drafts(seq: Sequence, first: int, draft: tuple[int, ...], forced: bool, token_ids: list[int]) -> int:
    """How many of the draft verified in rows first.. were accepted: row j's token is valid while every draft
    token before it equalled its row's sample. Forced tokens (jump-forward) are accepted whole; a row that
    sampled outside its one-id mask (only non-finite logits do that) is overwritten with the forced token,
    which the rows after it read."""
    accepted = 0
    while accepted < len(draft) and token_ids[first + accepted] == draft[accepted]:
        accepted += 1
    if forced and accepted < len(draft):
        log.warning("jump-forward: %s sampled %d where only %d was allowed; keeping the forced tokens (the rows "
                    "after them read those)", seq.request_id, token_ids[first + accepted], draft[accepted])
        token_ids[first: first + len(draft)] = draft
        accepted = len(draft)
    return accepted


def take_row_tokens(seq: Sequence, first: int, draft: tuple[int, ...], forced: bool, slots: list[int],
                    token_ids: list[int], logprobs, top, now: float, max_model_len: int
                    ) -> tuple[list[int], str | None, int, int]:
    """A read step's tokens for `seq`, whose rows start at `first` (its draft's rows after it): the accepted ones
    into its outputs (the first, or each forced one, into its placeholder slot), with their logprobs when it asks
    for them, through its constraint, until a stop. (its new tokens, the finish reason they imply or None, how many
    drafts were accepted, the outputs the delta reaches)."""
    accepted = accepted_drafts(seq, first, draft, forced, token_ids)
    new, reason = [], None
    for row in range(first, first + accepted + 1):
        lp = None
        if seq.sampling.logprobs is not None:
            n = seq.sampling.logprobs
            lp = TokenLogprob(token_ids[row], logprobs[row], list(zip(top[0][row][:n], top[1][row][:n])) if n else [])
        if row == first or forced:
            seq.resolve_token(slots[row], token_ids[row], lp, now)
        else:
            seq.append_token(token_ids[row], lp, now)
        new.append(token_ids[row])
        if seq.constraint is not None:
            seq.constraint.accept(token_ids[row])
        upto = slots[first] + len(new)
        if not seq.prefill_only and (reason := seq.check_finished(max_model_len, upto)) is not None:
            break  # (a stop token among the accepted drafts ends the sequence there)
    return new, reason, accepted, upto
