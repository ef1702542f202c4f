"""Continuous batching: which sequences run in the next forward, and with how many new tokens.

Policy (first come, first served within a priority; GenerateRequest.priority, lower first, orders both queues
by (priority, arrival), and "oldest" / "newest" below mean first / last in that order; with
`priority_aging_s` a priority step is worth that many seconds of waiting instead, so a request is never
passed by better-priority ones that arrive more than `priority_aging_s` x the difference after it):
- a waiting sequence of a better priority than the worst running one, finding no seat or no pages for its
  first chunk, preempts running sequences of worse priority (the worst first) until it fits;
- running sequences go first, oldest first: a decoding one takes 1 token of the step's budget
  (max_num_batched_tokens), a prefilling one a chunk of what is left (chunked prefill);
- then waiting sequences are admitted in arrival order while the budget, the seats (max_num_seqs)
  and the free pages allow; the first one that does not fit stops admission (no overtaking, so a
  long prompt is never starved by short ones); with prefix caching, a waiting sequence whose next
  prompt block is being computed in this very step by another sequence waits one step and then takes
  it from the cache (same prompts arriving together compute their shared prefix once; n > 1);
- when a running sequence needs a page and none is free, the newest running sequence is preempted
  by recompute (its pages are freed, it returns to the waiting queue in arrival order and later
  prefills prompt + output again). The oldest sequence therefore always progresses, and since the
  pools hold one max_model_len sequence (checked at engine start) nothing deadlocks.

The common step, every running sequence decoding one token with pages to spare, takes a shortcut
with the same outcome (one batched page check instead of the per-sequence loop); in the loop (a prompt
prefilling over several steps), each run of decoding sequences whose pages suffice is taken the same way.

Three step kinds share the policy: MIXED (decodes and prefill chunks in one forward, the default),
PREFILL (prefill chunks only: a prefill replica) and DECODE (decodes only, plus admission of
sequences whose K/V was imported from a prefill replica).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


class StepKind(enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (the sequence's num_computed when scheduled)
    num_tokens: int
    is_prefill: bool
    # Speculative decoding: draft tokens after the sequence's last one, verified as extra decode rows
    # (engine/speculative.py); num_tokens counts them. Only the first position is known to be right, unless
    # `forced`: a constraint's forced tokens (jump-forward), each row's mask allowing only its token.
    draft: tuple[int, ...] = ()
    forced: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the step samples the next one."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    kind: StepKind
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    restores: list[Sequence] = field(default_factory=list)  # imported K/V to write before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len or config.max_model_len  # drafts never run past it
        self.decode_runs = True  # _decode_run in the loop (the tests and bench/engine.py switch it off)
        self.waiting: list[Sequence] = []  # sorted by _rank
        self.running: list[Sequence] = []  # sorted by _rank; each holds pages
        aging = config.priority_aging_s
        # Queue order: priority (lower first), then arrival (FCFS). Aged: priority x aging_s + arrival time, a
        # key that does not change while a request waits (everyone's waiting time grows alike), so the queues
        # stay sorted without re-sorting, and an order once decided never flips back (no preemption ping-pong).
        self._rank = (lambda s: (s.priority, s.arrival)) if aging is None else \
            (lambda s: (s.priority * aging + s.arrival_time, s.arrival))

    # ---- queue changes ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._rank)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its pages (finish, abort, export)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def park(self, seq: Sequence) -> None:
        """A prefill-only sequence whose first token is sampled: off the schedule, pages kept for export."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed = 0
        seq.pending_kv = None  # imported K/V is gone with the pages: recompute prompt + output
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def has_work(self, kind: StepKind = StepKind.MIXED) -> bool:
        return any(self._wants(kind, s) for s in self.running) or any(
            self._admits(kind, s) for s in self.waiting)

    @staticmethod
    def _wants(kind: StepKind, seq: Sequence) -> bool:
        return kind is StepKind.MIXED or (kind is StepKind.PREFILL) == seq.is_prefill

    @staticmethod
    def _admits(kind: StepKind, seq: Sequence) -> bool:
        imported = seq.pending_kv is not None
        return kind is StepKind.MIXED or (kind is StepKind.DECODE) == imported

    # ---- the step -----------------------------------------------------------------------------------
    def schedule(self, kind: StepKind = StepKind.MIXED) -> SchedulerOutput:
        out = SchedulerOutput(kind)
        budget = self.config.max_num_batched_tokens
        if self.waiting and self.running and self._outranks(self.waiting[0], self.running[-1]):
            self._yield_to_priority(kind, out)
        drafts, forced, spare_rows = self._drafts(kind)
        all_decode = not drafts and self._all_decode(kind) and len(self.running) <= budget
        if all_decode and self.block_manager.allocate_next_tokens(self.running):
            # The common step: every running sequence decodes one token and the pages suffice, so the
            # per-sequence loop below would schedule exactly this, preempting nobody.
            out.scheduled = [ScheduledSeq(seq, seq.num_computed, 1, False) for seq in self.running]
            self._admit(kind, budget - len(self.running), out)
            return out
        # (after the common step found its pages short, a run would find the same: the loop preempts as it goes)
        i, runs = 0, not drafts and not all_decode and self.decode_runs and kind is not StepKind.PREFILL
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self._wants(kind, seq):
                i += 1
                continue
            if runs:
                taken = self._decode_run(i, budget, out)
                if taken > 0:
                    i += taken
                    budget -= taken
                    continue
                runs = taken == 0  # pages short: the loop preempts as it goes; no more runs this step
            n = self._make_room(seq, min(seq.num_remaining, budget), out)
            if n == 0:  # seq itself was preempted; it was the last running one
                break
            draft = drafts.get(id(seq), ())
            if draft:  # as many drafts as the budgets and the free pages allow, never preempting for them
                room = self.block_manager.max_new_tokens(seq, 1 + len(draft)) - 1
                draft = tuple(draft[: max(0, min(room, budget - n, spare_rows))])
                spare_rows -= len(draft)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n + len(draft), seq.is_prefill, draft,
                                              bool(draft) and id(seq) in forced))
            self.block_manager.allocate(seq, seq.num_computed + n + len(draft))
            budget -= n + len(draft)
            i += 1
        self._admit(kind, budget, out)
        return out

    def _drafts(self, kind: StepKind) -> tuple[dict[int, list[int]], set[int], int]:
        """Speculative decoding (engine/speculative.py): ({id(seq): draft tokens} for the decoding sequences
        whose drafter proposes some, the ids of those whose draft is a constraint's forced tokens, decode rows
        left for drafts within max_num_seqs, the largest decode graph). No drafter's drafts when more
        sequences run than speculative_max_seqs; jump-forward drafts (forced tokens) at any batch size."""
        config = self.config
        if kind is StepKind.PREFILL:
            return {}, set(), 0
        speculate = config.speculative_tokens and len(self.running) <= config.speculative_max_seqs
        drafts, forced_ids = {}, set()
        if not speculate and not config.jump_forward_tokens:
            return drafts, forced_ids, 0
        for seq in self.running:  # (the cheap tests first: this runs every step, at any batch size)
            if seq.constraint is None:  # (a constrained sequence has no drafter)
                if not speculate or seq.drafter is None or seq.is_prefill or seq.output_ids[-1] == PLACEHOLDER:
                    continue  # (a drafter needs the token in flight)
                forced = False
            else:  # a constraint knows a token in flight that it forced (penalties: the history would need drafts)
                forced = config.jump_forward_tokens and not seq.sampling.has_penalties \
                    and hasattr(seq.constraint, "forced_tokens")
                if not forced or seq.is_prefill:
                    continue
            limit = min(config.jump_forward_tokens if forced else config.speculative_tokens,
                        seq.sampling.max_tokens - len(seq.output_ids) - 1)
            if self.max_model_len is not None:
                limit = min(limit, self.max_model_len - seq.num_tokens - 1)
            draft = seq.constraint.forced_tokens(limit) if forced else seq.drafter.propose(limit)
            if draft:
                drafts[id(seq)] = draft
                if forced:
                    forced_ids.add(id(seq))
        return drafts, forced_ids, config.max_num_seqs - len(self.running)

    def retire(self, seq: Sequence) -> None:
        """Off the schedule with its pages freed, before its last token is read: a sequence whose step in
        flight gives it its last token (length limit). The engine finishes it once the token is read;
        GPU work on its pages stays in stream order, ahead of whatever gets them next."""
        self.running.remove(seq)
        self.block_manager.free(seq)

    def all_decoding(self) -> bool:
        """Every running sequence decodes one token next (the common step)."""
        return self._all_decode(StepKind.MIXED)

    def _decode_run(self, i: int, budget: int, out: SchedulerOutput) -> int:
        """Schedule running[i:j], the decoding sequences from i on (at most `budget`), when there are two or more
        and their pages suffice: what the loop would do one by one, preempting nobody (a prefill chunk among the
        running sequences sends every step through the loop). How many it took; 0: no run from i; -1: not pages
        enough for all of it (the loop goes on from i either way)."""
        running, j = self.running, i
        end = min(len(running), i + budget)
        while j < end:
            s = running[j]  # `not s.is_prefill and s.num_remaining == 1`, inlined as in _all_decode
            if not (s.output_ids and s.num_computed == len(s.prompt_ids) + len(s.output_ids) - 1):
                break
            j += 1
        if j - i < 2:
            return 0
        if not self.block_manager.allocate_next_tokens(running[i:j]):
            return -1
        out.scheduled.extend(ScheduledSeq(s, s.num_computed, 1, False) for s in running[i:j])
        return j - i

    def _all_decode(self, kind: StepKind) -> bool:
        # `not s.is_prefill and s.num_remaining == 1` for every running sequence, inlined (hot path: the
        # property calls cost ~40% of the shortcut's time at batch 64, bench/engine.py, 2026-11-30).
        return kind is not StepKind.PREFILL and bool(self.running) and all(
            s.output_ids and s.num_computed == len(s.prompt_ids) + len(s.output_ids) - 1 for s in self.running)

    def _yield_to_priority(self, kind: StepKind, out: SchedulerOutput) -> None:
        """Preempt running sequences of worse priority than the best waiting one (the worst and newest first)
        while it would find no batch slot, or no pages for its first chunk; they recompute later, as any
        preempted sequence does. Equal priorities never preempt each other here (FCFS)."""
        seq = self.waiting[0]
        if not self._admits(kind, seq):
            return
        while self.running and self._outranks(seq, self.running[-1]) and not self._room_for(seq):
            self._preempt(self.running[-1], out)

    def _outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """May `waiting` preempt `running`: a better priority, and (aged) ahead of it in the queue order."""
        return waiting.priority < running.priority and self._rank(waiting) < self._rank(running)

    def _room_for(self, seq: Sequence) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if seq.pending_kv is not None:
            return self.block_manager.can_hold(seq, seq.pending_kv.num_cached + 1)
        return self.block_manager.can_hold(seq, min(seq.num_remaining, self.config.max_num_batched_tokens))

    def _make_room(self, seq: Sequence, want: int, out: SchedulerOutput) -> int:
        """Tokens `seq` can compute this step, preempting the newest running sequences if needed."""
        while True:
            n = self.block_manager.max_new_tokens(seq, want)
            if n == want or (n > 0 and seq.is_prefill):  # a shorter prefill chunk is still progress
                return n
            victim = self.running[-1]  # never one already scheduled: those precede seq
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _admit(self, kind: StepKind, budget: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        claimed = set()  # prefix caching: prompt blocks this step computes
        if bm.prefix_caching:
            for s in out.scheduled:
                if s.is_prefill:
                    claimed |= bm.blocks_computed(s.seq, s.start, s.end)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if not self._admits(kind, seq):
                continue
            if seq.pending_kv is not None:
                total = seq.pending_kv.num_cached + 1  # the imported K/V plus this step's token
                if not bm.can_hold(seq, total):
                    return
                bm.allocate(seq, total)
                seq.num_computed = seq.pending_kv.num_cached
                out.restores.append(seq)
                n = 1
            else:
                hit = bm.take_cached_prefix(seq)  # prefix caching: skip the cached part of the prompt
                if claimed and bm.next_block(seq) in claimed:  # computed this step: take it from the cache next
                    if hit:
                        bm.free(seq)
                        seq.num_computed = 0
                    continue
                hit += bm.extend_from_host(seq, budget)  # the host tier: blocks copied back, room for a chunk left
                want = min(seq.num_remaining, budget)
                n = bm.max_new_tokens(seq, want)
                # Wait for a whole chunk while others hold pages (they free them as they finish);
                # alone, take what fits so a tiny pool still makes progress.
                if n == 0 or (n < want and self.running):
                    if hit:  # give the prefix back; it is looked up again next time
                        bm.free(seq)
                        seq.num_computed = 0
                    return
                bm.allocate(seq, seq.num_computed + n)
                bm.note_admitted(seq, hit)
                claimed |= bm.blocks_computed(seq, seq.num_computed, seq.num_computed + n)
                if not seq.num_preemptions:  # what the client's usage reports: the first admission's
                    seq.num_cached_prefix = hit
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._rank)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n, seq.is_prefill))
            budget -= n
