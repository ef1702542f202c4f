"""The synchronous engine core: requests in, token deltas out, one `step` at a time.

    engine = LLMEngine.from_checkpoint(folder, EngineConfig(...))
    engine.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for delta in engine.step(): ...

Lookahead (`EngineConfig.async_decode`, on by default on CUDA devices): once a step is launched,
the engine schedules and launches the next one before it reads this step's tokens. Lengths are known
(each sampling sequence holds a placeholder output until the read) and token values are not needed on
the host: wherever the next step's inputs hold a placeholder, the sampled id is copied in on the
device. The host's scheduling, metadata and bookkeeping then overlap the GPU's previous step. Sequences
that step finishes by length are retired before scheduling; one that stops on a sampled stop token
had a row of the next step computed for nothing (dropped; its pages are freed after, and GPU work on
them stays in stream order). Not after a step with prefill-only sequences (they are parked when read),
not for PREFILL steps, and after a step that samples a prompt's first token only when the next step is
likely a quick graph replay (TTFT). Not after a step that verifies drafts, nor while a sequence may draft next
(engine/speculative.py: the draft needs the tokens). Rows whose sampling needs the token in flight (a penalty's
history; a constraint's mask that the token could change) defer the sampling, not the step: its forward is
launched ahead and its sampler once that token is read (`_sample_pending`), while the forward runs. Tokens are
the same as without (tests/engine/test_lookahead.py).

Disaggregated serving uses the same object on both sides: a prefill replica adds requests with
`prefill_only=True`, runs `step_prefill()` and hands `export_kv(id)` to the decode replica, which
calls `import_prefilled(request, payload)` and keeps stepping. Single-threaded: AsyncEngine owns it
from one thread.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

from engine.block_manager import BlockManager
from engine.config import EngineConfig, EngineConfigError
from engine.host_kv_tier import host_slots_for
from engine.kv_payload import KVDestination, KVPayloadError, PrefilledKV
from engine.metrics import EngineMetrics, StepTimes
from engine.request import (FINISH_ABORT, HARMONY_FIRST_SPECIAL_ID, Completion, GenerateRequest, InvalidRequestError,
                            RequestStateError, TokenDelta, UnknownRequestError)
from engine.runner import ModelRunner, device_current, on_runner_device, plan_pool_sizes
from engine.sampler import BatchBuilder, HostTokens, Sampler, may_sample_ahead
from engine.scheduler import Scheduler, SchedulerOutput, StepKind
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from engine.speculative import Drafter
from engine.step_flight import LaunchedStep, StepFailedError, feed_inputs, take_row_tokens
from model.gpt_oss import GptOssForCausalLM


class LLMEngine:
    # `_resolve`'s shortcut for the common row (one token, no logprobs, constraint or drafter); False runs every
    # row through the general body (bench/engine.py and tests/engine compare the two)
    fast_rows = True

    def __init__(self, model: GptOssForCausalLM, config: EngineConfig, runner: ModelRunner | None = None):
        """`runner`: engine/distributed's rank-0 runner when the model spans several ranks (built by
        `from_checkpoint`); None runs the model in this process."""
        self.config = config
        self.model = model
        mc = model.config
        split = (model.parallel.tp_size, model.parallel.ep_size)
        if split != (config.tp_size, config.ep_size):
            raise EngineConfigError(f"the model is split tp={split[0]}, ep={split[1]} but the config asks "
                                    f"tp_size={config.tp_size}, ep_size={config.ep_size}: build multi-rank "
                                    "engines with LLMEngine.from_checkpoint")
        self.vocab_size = mc.vocab_size
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise EngineConfigError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                                    f"max_position_embeddings ({mc.max_position_embeddings})")
        self.runner = runner or ModelRunner(model, config.block_size, config.kv_cache_dtype)
        if config.num_full_pages is not None:
            num_full, num_sliding = config.num_full_pages, config.num_sliding_pages
        else:
            num_full, num_sliding = plan_pool_sizes(config, self.runner.kv_budget_bytes(config),
                                                    *self.runner.page_bytes(), mc.sliding_window)
        host_slots = host_slots_for(config.host_kv_cache_bytes, self.runner.page_bytes())  # the host tier
        self.block_manager = BlockManager(config.block_size, mc.sliding_window, num_full, num_sliding,
                                          self.runner.has_full, self.runner.has_sliding, config.enable_prefix_caching,
                                          host_slots)
        too_small = self.block_manager.too_small_for(self.max_model_len)
        if too_small:
            raise EngineConfigError(too_small)
        with device_current(self.runner.device):  # seconds per bucket: decode graphs by batch, prefill ones by tokens
            self.runner.allocate_kv_cache(num_full, num_sliding)
            if any(host_slots):
                self.runner.allocate_host_kv(*host_slots)
            self.graph_capture_seconds, self.prefill_graph_capture_seconds = self.runner.capture_graphs(config)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.sampler = Sampler(mc.vocab_size, model.device, penalty_exempt_from=HARMONY_FIRST_SPECIAL_ID
                               if mc.vocab_size > HARMONY_FIRST_SPECIAL_ID else None)
        self.metrics = EngineMetrics()
        self.batches = BatchBuilder(self.runner.device, self.vocab_size)  # each step's SamplingBatch
        # Lookahead (module docstring): on by default on CUDA, one rank or several (rank 0 broadcasts the ids
        # it feeds on the device, engine/distributed/runner.py; tested over gloo and, with decode graphs, on
        # 2 GPUs). 120b TP2/EP2 on 2x H200: batch-1 decode 196 -> 328 tok/s, 1k/256 x 256 requests 4,548
        # -> 6,629 tok/s, the same tokens (bench/results/parallel_h200x2_120b_lookahead_{off,on}.json).
        self.async_decode = config.async_decode if config.async_decode is not None else model.device.type == "cuda"
        self._inflight: LaunchedStep | None = None
        self.seqs: dict[str, Sequence] = {}  # every unfinished request: waiting, running or prefilled
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._update_state_metrics()

    @classmethod
    def from_checkpoint(cls, folder: str | Path, config: EngineConfig, progress: bool = False) -> "LLMEngine":
        """Load and start an engine. With tp_size or ep_size > 1 this process becomes rank 0 and starts
        one worker process per other rank (engine/distributed); `close()` stops them."""
        if config.world_size > 1:
            from engine.distributed import launch_engine

            return launch_engine(folder, config, progress=progress)
        from engine.model_factory import load_for_engine

        return cls(load_for_engine(folder, config, progress=progress), config)

    @classmethod
    def with_random_weights(cls, model_config, config: EngineConfig, seed: int = 0) -> "LLMEngine":
        """An engine over random weights of `model_config`'s shapes (GptOssConfig; benchmarks of the
        full-size models where no checkpoint is at hand), on config.world_size ranks like from_checkpoint."""
        if config.world_size > 1:
            from engine.distributed import launch_engine

            return launch_engine(None, config, model=model_config, seed=seed)
        from engine.model_factory import random_for_engine

        return cls(random_for_engine(model_config, config, seed=seed), config)

    def close(self) -> None:
        """Release the K/V cache and stop the other ranks' workers, if any. The engine is unusable after."""
        self.runner.close()

    # ---- requests ---------------------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError for a request this engine can never run. Reads no mutable state."""
        if not isinstance(request, GenerateRequest):
            raise InvalidRequestError(f"expected a GenerateRequest, got {type(request).__name__}")
        request.validate(self.vocab_size, self.max_model_len)

    def _new_sequence(self, request: GenerateRequest, seed: int | None, prefill_only: bool) -> Sequence:
        self.validate(request)
        if request.request_id in self.seqs:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already running; use a new id",
                                      "request_id")
        if seed is None:
            seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(64)
        seq = Sequence(request.request_id, list(request.prompt_ids), request.sampling, seed,
                       next(self._arrivals), prefill_only, priority=request.priority, cache_salt=request.cache_salt,
                       cache_cuts=tuple(request.cache_cuts))
        sampling = request.sampling
        if sampling.constraint is not None:
            seq.constraint = sampling.constraint.start(self.vocab_size)
        elif self.config.speculative_tokens and not sampling.has_penalties and not prefill_only \
                and (sampling.prediction or self.config.speculative_ngram):  # (engine/speculative.py says why)
            seq.drafter = Drafter(seq.prompt_ids, sampling.prediction, self.config.speculative_ngram,
                                  self.config.speculative_tokens)
        return seq

    def add_request(self, request: GenerateRequest, prefill_only: bool = False) -> None:
        """Queue a request. prefill_only: stop after the first token and keep the K/V for export_kv."""
        seq = self._new_sequence(request, None, prefill_only)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.metrics.record_added()
        self._update_state_metrics()

    def import_prefilled(self, request: GenerateRequest, payload: PrefilledKV) -> list[TokenDelta]:
        """Continue a request prefilled elsewhere. Returns the delta with the tokens the prefill sampled
        (the request may already be finished by them); later tokens come from `step`."""
        if payload.request_id != request.request_id or payload.prompt_ids != list(request.prompt_ids):
            raise KVPayloadError(f"payload for {payload.request_id!r} does not match request "
                                 f"{request.request_id!r} (ids or prompt differ)")
        payload.check_compatible(self.runner.layer_is_sliding, self.runner.payload_kv_heads,
                                 self.runner.head_dim)
        seq = self._new_sequence(request, payload.seed, prefill_only=False)
        seq.num_cached_prefix, now = payload.num_cached_tokens, time.monotonic()
        for i, token in enumerate(payload.output_ids):
            seq.append_token(token, payload.output_logprobs[i] if payload.output_logprobs else None, now)
            if seq.constraint is not None:
                seq.constraint.accept(token)
        if seq.drafter is not None:
            seq.drafter.observe(list(payload.output_ids))
        self.metrics.record_added()
        self.metrics.record_transfer(exported=False)
        reason = seq.check_finished(self.max_model_len)
        if reason is not None:
            self._finish(seq, reason, now)
            return [self._delta(seq)]
        seq.pending_kv = payload
        self.block_manager.start_sliding_at(seq, payload.sliding_start)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self._update_state_metrics()
        return [self._delta(seq)]

    def abort(self, request_id: str) -> TokenDelta | None:
        """Stop a request wherever it is and free its pages; returns its final delta (None: unknown id)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FINISH_ABORT, time.monotonic())
        self._update_state_metrics()
        return self._delta(seq)

    @on_runner_device
    def export_kv(self, request_id: str, into: KVDestination | None = None) -> PrefilledKV:
        """K/V + sampling state of a request whose prefill is done; the request leaves this engine. `into`
        may place the K/V (a transport's slot: engine/kv_payload.py); it has landed there on return."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(request_id)
        ready = seq.status is SequenceStatus.PREFILLED or (
            seq.status is SequenceStatus.RUNNING and not seq.is_prefill and seq.pending_kv is None)
        if not ready:
            raise RequestStateError(f"request {request_id!r} is {seq.status.value} with {seq.num_remaining} "
                                    f"uncached tokens: export after its prefill has sampled a token")
        sliding_start = self.block_manager.first_visible_position(seq.num_computed) if self.runner.has_sliding else 0
        k, v = self.runner.read_kv(seq, sliding_start, into)
        payload = PrefilledKV(seq.request_id, list(seq.prompt_ids), list(seq.output_ids), list(seq.output_logprobs),
                              seq.seed, seq.num_computed, sliding_start, list(self.runner.layer_is_sliding), k, v,
                              num_cached_tokens=seq.num_cached_prefix)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        del self.seqs[request_id]
        self.metrics.record_transfer(exported=True)
        self._update_state_metrics()
        return payload

    @property
    def lookahead_steps(self) -> int:
        """Steps launched before their predecessor's tokens were read (the metrics' counter)."""
        return self.metrics.lookahead_steps_total

    def has_unfinished(self) -> bool:
        """Whether a step would do work (prefilled requests waiting for export do not count)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- steps ------------------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Decodes and prefill chunks in one forward."""
        return self._step(StepKind.MIXED)

    def step_prefill(self) -> list[TokenDelta]:
        return self._step(StepKind.PREFILL)

    def step_decode(self) -> list[TokenDelta]:
        return self._step(StepKind.DECODE)

    @on_runner_device
    def _step(self, kind: StepKind) -> list[TokenDelta]:
        if self._inflight is not None:  # launched by the previous call (lookahead)
            cur, self._inflight = self._inflight, None
        else:
            times = StepTimes()
            t0 = time.perf_counter()
            out = self.scheduler.schedule(kind)
            times.schedule = time.perf_counter() - t0
            if out.is_empty:
                self.metrics.record_step(0, 0, len(out.preempted), times)
                self._update_state_metrics()
                return []
            cur = self._launch(out, times, None)
        nxt = None
        try:
            if self.async_decode:
                nxt = self._launch_next(cur, kind)
        except StepFailedError as exc:  # both steps' requests fail: the caller aborts them
            raise StepFailedError(str(exc), [s.seq.request_id for s in cur.out.scheduled] + exc.request_ids) from exc
        try:
            deltas = self._resolve(cur)
        except StepFailedError as exc:
            extra = [s.seq.request_id for s in nxt.out.scheduled] if nxt is not None else []
            raise StepFailedError(str(exc), exc.request_ids + extra) from exc
        if nxt is not None and nxt.pending is not None:
            self._sample_pending(nxt)
        self._inflight = nxt
        return deltas

    def _launch(self, out: SchedulerOutput, times: StepTimes, feed: LaunchedStep | None,
                defer_sampling: bool = False) -> LaunchedStep:
        """Queue the step's forward and sampler (feed: the step still in flight before it, whose sampled
        ids replace the placeholders among this step's inputs, on the device), then advance its
        sequences: cached lengths, out-of-window pages, one placeholder output per sampling row.
        defer_sampling: queue the forward only; `_sample_pending` queues the sampler once `feed` is read."""
        t1 = time.perf_counter()
        try:
            moves = self.block_manager.take_moves()  # the host tier's page copies, ahead of the forward
            if moves:
                self.runner.apply_kv_moves(moves)
            inputs = self.runner.prepare(out.scheduled)
            if feed is not None and feed.sampled is not None:
                inputs = self._feed(inputs, out, feed)
            for seq in out.restores:
                self.runner.write_kv(seq, seq.pending_kv)
                seq.pending_kv = None
            t2 = time.perf_counter()
            rows = [out.scheduled[b].seq for b in inputs.sample_rows]
            logits = self.runner.execute(inputs)
            self.metrics.record_path(self.runner.last_path)
            pending = sampled = host = None
            if defer_sampling and rows:
                pending = (logits, self.batches.steps_of(rows))
            elif rows:  # (a step of partial prefill chunks samples nothing)
                batch = self.batches(rows)  # (after the launch: token masks are built while the GPU runs)
                sampled = self.sampler(logits, batch)
                host = HostTokens(sampled)
        except Exception as exc:  # any failure of the model or sampler: the caller aborts these requests
            raise StepFailedError(f"{out.kind.value} step failed: {exc!r}",
                                  [s.seq.request_id for s in out.scheduled]) from exc
        t3 = time.perf_counter()
        times.prepare, times.forward = t2 - t1, t3 - t2
        drafts, forced = {}, {}
        for s in out.scheduled:
            # a draft's K/V counts once accepted; forced tokens are accepted
            s.seq.num_computed = s.start + 1 if s.draft and not s.forced else s.end
            if s.draft:
                (forced if s.forced else drafts)[id(s.seq)] = s.draft
        # prefix caching (each sequence's blocks named before its sliding pages leave), then the window's pages
        self.block_manager.after_forward([s.seq for s in out.scheduled])
        slots, last = [], None
        for seq in rows:
            if seq is not last or id(seq) in forced:
                seq.output_ids.append(PLACEHOLDER)
            slots.append(len(seq.output_ids) - 1)
            last = seq
        times.update = time.perf_counter() - t3
        return LaunchedStep(out, rows, slots, drafts, forced, sampled, host, times, pending)

    def _sample_pending(self, step: LaunchedStep) -> None:
        """Queue a lookahead step's deferred sampler, now that the step before it was read: penalties see
        that step's tokens and constraints give the masks after them. A failure is kept for `_resolve`
        (the step before has its deltas already)."""
        logits, steps = step.pending
        step.pending = None
        t0 = time.perf_counter()
        try:
            step.sampled = self.sampler(logits, self.batches(step.rows, steps))
            step.host = HostTokens(step.sampled)
        except Exception as exc:
            step.failure = StepFailedError(f"{step.out.kind.value} step failed: {exc!r}",
                                           [s.seq.request_id for s in step.out.scheduled])
        step.times.forward += time.perf_counter() - t0

    _feed = staticmethod(feed_inputs)  # (engine/step_flight.py; an attribute, so tests can watch it)

    def _launch_next(self, cur: LaunchedStep, kind: StepKind) -> LaunchedStep | None:
        """The lookahead: schedule and launch the step after `cur` now (module docstring); None (nothing
        changed) when it must wait for `cur`'s tokens."""
        if kind is StepKind.PREFILL or cur.drafts or cur.failure is not None or any(
                seq.prefill_only or (seq.drafter is not None and seq.drafter.may_propose()) for seq in cur.rows):
            return None  # (drafts: the next step's draft and positions need its tokens; a step verifying drafts
            # does not know how many it will accept)
        # Penalties and constraints need its tokens to sample, not to run the forward: that step's sampler
        # waits until they are read (deferred sampling).
        defer = any(not may_sample_ahead(seq) for seq in cur.rows)
        if any(len(seq.output_ids) == 1 for seq in cur.rows) and not self._next_step_replays():
            return None  # a prompt's first token: deliver it before host-launching a whole eager step (TTFT)
        t0 = time.perf_counter()
        for seq in dict.fromkeys(cur.rows):  # (a sequence's forced rows: once)
            if not seq.is_finished and seq.finishes_by_length(self.max_model_len):
                self.scheduler.retire(seq)  # finished (and its delta sent) when `cur` is read
        out = self.scheduler.schedule(kind)
        if out.is_empty:
            return None
        times = StepTimes(schedule=time.perf_counter() - t0)
        self.metrics.record_lookahead()
        return self._launch(out, times, cur, defer)

    def _next_step_replays(self) -> bool:
        """Whether the next step will likely be a captured decode graph (quick to launch): everybody
        running decodes, nobody waits, and a graph bucket holds them. A guess, only used to decide
        when looking ahead could delay a first token."""
        graphs = self.runner.decode_graphs
        return graphs is not None and not self.scheduler.waiting and self.scheduler.all_decoding() \
            and graphs.bucket_for(len(self.scheduler.running)) is not None

    def _resolve(self, step: LaunchedStep) -> list[TokenDelta]:
        """Read the step's tokens (waits for its sampler), fill its placeholders, finish sequences, deltas."""
        t3 = time.perf_counter()
        if step.failure is not None:
            raise step.failure
        token_ids, logprobs, top = [], None, None
        if step.host is not None:
            try:
                token_ids, logprobs, top = step.host.wait()  # the step's one device-to-host read
            except Exception as exc:
                raise StepFailedError(f"{step.out.kind.value} step failed: {exc!r}",
                                      [s.seq.request_id for s in step.out.scheduled]) from exc
        t4 = time.perf_counter()
        now = time.monotonic()
        deltas = []
        out = step.out
        all_decode = not any(s.is_prefill for s in out.scheduled)
        decoding = None if all_decode else {id(s.seq) for s in out.scheduled if not s.is_prefill}
        decoded = 0  # decode tokens delivered: rows dropped below were computed but generate nothing
        one_row_each = self.fast_rows and not step.drafts and not step.forced
        max_model_len, slots, record_first_token = self.max_model_len, step.slots, self.metrics.record_first_token
        i = 0
        while i < len(step.rows):
            seq, first = step.rows[i], i
            if one_row_each and seq.sampling.logprobs is None and seq.constraint is None and seq.drafter is None \
                    and not seq.prefill_only:
                # The common row (bench/engine.py's host work per step): one token, nothing to verify, log or
                # constrain. The general body below, for one row, with the calls that do nothing left out.
                i += 1
                if seq.status is SequenceStatus.FINISHED:
                    continue
                if seq.first_token_time is None:
                    record_first_token(now - seq.arrival_time)
                    seq.first_token_time = now
                upto = slots[first] + 1
                seq.output_ids[upto - 1] = token_ids[first]
                seq.last_token_time = now
                if all_decode or id(seq) in decoding:
                    decoded += 1
                if (reason := seq.check_finished(max_model_len, upto)) is not None:
                    self._finish(seq, reason, now)
                deltas.append(self._delta(seq, upto))
                continue
            forced = step.forced.get(id(seq), ())
            draft = forced or step.drafts.get(id(seq), ())
            i += 1 + len(draft)
            if seq.is_finished:  # aborted, or stopped by the step before (this one ran ahead for nothing)
                continue
            if seq.first_token_time is None:
                self.metrics.record_first_token(now - seq.arrival_time)
            new, reason, accepted, upto = take_row_tokens(seq, first, draft, bool(forced), step.slots, token_ids,
                                                          logprobs, top, now, self.max_model_len)
            decoded += len(new) if all_decode or id(seq) in decoding else 0
            if not forced:
                seq.num_computed += len(new) - 1  # the accepted drafts' K/V
            if seq.drafter is not None:
                seq.drafter.observe(new, len(draft), accepted)
                self.metrics.record_drafts(len(draft), accepted)
            elif forced:  # a constraint's forced tokens (jump-forward): each row's mask allowed only its token
                self.metrics.record_jump_forward(len(new) - 1)
            if seq.prefill_only:
                self.scheduler.park(seq)  # stop conditions are the decode side's business
            elif reason is not None:
                self._finish(seq, reason, now)
            deltas.append(self._delta(seq, upto))
        times = step.times  # forward: queueing it + waiting for its tokens; update: both bookkeeping halves
        times.forward += t4 - t3
        times.update += time.perf_counter() - t4
        self.metrics.record_step(out.num_prefill_tokens, decoded, len(out.preempted), times)
        self._update_state_metrics()
        return deltas

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.drop_placeholders()  # outputs of a step still in flight that this sequence no longer takes
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.request_id, None)
        self.metrics.record_finished(reason, len(seq.output_ids), seq.first_token_time, seq.last_token_time)

    @staticmethod
    def _delta(seq: Sequence, upto: int | None = None) -> TokenDelta:
        """Outputs [num_emitted, upto) (default: all; a lookahead step's placeholder may follow them)."""
        upto = len(seq.output_ids) if upto is None else upto
        new = seq.output_ids[seq.num_emitted: upto]
        logprobs = seq.output_logprobs[seq.num_emitted: upto] if seq.sampling.logprobs is not None else None
        seq.num_emitted = upto
        drafter = seq.drafter
        return TokenDelta(seq.request_id, new, logprobs, seq.finish_reason, len(seq.prompt_ids), upto,
                          seq.num_cached_prefix, drafter.num_drafted if drafter else 0,
                          drafter.num_accepted if drafter else 0)

    def reset_metrics(self) -> None:
        """Counters back to zero, the state gauges re-read (engine/warm_up.py: its requests are not traffic)."""
        self.metrics.reset()
        self.block_manager.reset_counters()
        self._update_state_metrics()

    def _update_state_metrics(self) -> None:
        sched = self.scheduler
        # (a parked prefill is in neither queue: with every known sequence in one, none is; skips a pass over all)
        prefilled = 0 if len(self.seqs) == len(sched.waiting) + len(sched.running) else \
            sum(1 for s in self.seqs.values() if s.status is SequenceStatus.PREFILLED)
        self.metrics.set_state(len(sched.waiting), len(sched.running), prefilled,
                               self.block_manager.usage())

    # ---- offline use --------------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        """Run requests to completion as one continuous batch; results in input order."""
        results = {r.request_id: Completion(r.request_id, list(r.prompt_ids)) for r in requests}
        if len(results) != len(requests):
            raise InvalidRequestError("request ids must be unique within one generate call", "request_id")
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            for d in self.step():
                c = results[d.request_id]
                c.output_ids += d.token_ids
                c.logprobs += d.logprobs or []
                c.finish_reason = d.finish_reason
                c.num_draft_tokens, c.num_accepted_draft_tokens = d.num_draft_tokens, d.num_accepted_draft_tokens
        return [results[r.request_id] for r in requests]
