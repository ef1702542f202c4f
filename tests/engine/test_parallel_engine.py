"""The engine over several processes (gloo on CPU, a tiny fp32 model): every TP/EP split generates exactly
what one process generates, K/V hands off between engines of different TP sizes, a failing or killed
worker surfaces on rank 0 as WorkerFailedError, and nothing is left running afterwards.

The worker processes are spawned once per world size; each split loads into them in turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, EngineConfigError
from engine.distributed import Executor, ExecutorStateError, WorkerFailedError, check_parallel
from engine.distributed.executor import check_devices
from engine.distributed.wire import Op
from engine.llm_engine import LLMEngine, StepFailedError
from engine.request import GenerateRequest, SamplingParams
from model.loader import load_model, read_config
from model.tiny import make_tiny
from tests.engine.engine_testlib import assert_pool_full, run_to_end

ROOT = Path(__file__).resolve().parents[2]
# 8 query / 4 K/V heads and 8 experts: TP and EP up to 4. 4 layers: sliding, full, sliding, full.
TINY = dict(vocab_size=1000, sliding_window=8, dtype="float32", hidden_size=32, head_dim=8, intermediate_size=32,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, seed=11)
SPLITS = {2: [(2, 1), (1, 2), (2, 2)], 4: [(4, 1), (1, 4), (4, 4)]}  # (tp, ep) per world size
SPECS = [(1, 9), (5, 7), (9, 8), (17, 6), (30, 5)]  # (prompt length, max tokens): around window 8, pages of 4


def config(**overrides) -> EngineConfig:
    # 16 tokens a step: the 17- and 30-token prompts prefill in chunks, next to other sequences' decodes.
    settings = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64, num_full_pages=128,
                    num_sliding_pages=128)
    return EngineConfig(**{**settings, **overrides})


def requests() -> list[GenerateRequest]:
    out = []
    for i, (n, m) in enumerate(SPECS):
        prompt = torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(i)).tolist()
        out.append(GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=m, logprobs=2)))
    return out


def prefill_and_export(engine: LLMEngine, dest_device: str = "cpu") -> dict:
    for r in requests():
        engine.add_request(r, prefill_only=True)
    run_to_end(engine, engine.step_prefill)
    # every other request exports into caller-supplied tensors (a transport's slot: KVDestination), on
    # dest_device (host tensors from a GPU engine: gathered on the GPU, then copied)
    supplied = lambda shapes, dtype: [torch.full(s, float("nan"), dtype=dtype, device=dest_device)  # noqa: E731
                                      for s in shapes]
    payloads = {r.request_id: engine.export_kv(r.request_id, supplied if i % 2 else None)
                for i, r in enumerate(requests())}
    assert_pool_full(engine)
    return payloads


def import_and_decode(engine: LLMEngine, payloads: dict) -> dict[str, list[int]]:
    out = {}
    for r in requests():
        (delta,) = engine.import_prefilled(r, payloads[r.request_id])
        out[r.request_id] = list(delta.token_ids)
    for rid, r in run_to_end(engine).items():
        out[rid] += r["ids"]
    assert_pool_full(engine)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp-engine")
    make_tiny(folder, **TINY)
    return folder


@pytest.fixture(scope="module")
def single(checkpoint):
    """World size 1 in this process: generations (ids + logprobs) and the K/V a prefill exports."""
    engine = LLMEngine(load_model(checkpoint, dtype="float32", progress=False), config())
    reqs = requests()
    for r in reqs:
        engine.add_request(r)
    out = run_to_end(engine)
    return {"ids": {rid: r["ids"] for rid, r in out.items()},
            "logprobs": {rid: r["logprobs"] for rid, r in out.items()},
            "payloads": prefill_and_export(engine), "engine": engine}


@pytest.mark.parametrize("world", [2, 4])
def test_every_split_generates_what_one_process_does(world, checkpoint, single):
    """Per split: concurrent greedy generation (chunked prefill + decodes in one batch); decoding K/V that
    an engine of another TP size prefilled; prefilling K/V for the next. The chain of hand-offs is
    world 1 -> each split in turn -> world 1, so gather (export) and scatter (import) meet every TP size."""
    executor = Executor.spawn(world)
    try:
        _run_every_split(executor, checkpoint, single)
    finally:
        executor.shutdown()
    for rank, p in executor.workers.processes.items():
        assert not p.is_alive() and p.exitcode == 0, (rank, p.exitcode)  # left on SHUTDOWN, not killed


def _run_every_split(executor, checkpoint, single):
    world = executor.spec.world_size
    payloads = single["payloads"]
    for tp, ep in SPLITS[world]:
        split = f"tp{tp} ep{ep}"
        engine = executor.start_engine(checkpoint, config(tp_size=tp, ep_size=ep))
        try:
            assert engine.runner.kv_heads == TINY["num_key_value_heads"] // tp  # rank 0's cache: its heads only
            for r in requests():
                engine.add_request(r)
            out = run_to_end(engine)
            assert {rid: r["ids"] for rid, r in out.items()} == single["ids"], split
            for rid, r in out.items():  # logits within fp32 noise of world 1: logprobs agree closely
                for got, want in zip(r["logprobs"], single["logprobs"][rid]):
                    assert abs(got.logprob - want.logprob) < 1e-4, split
                    assert [t for t, _ in got.top] == [t for t, _ in want.top], split
            assert import_and_decode(engine, payloads) == single["ids"], split
            payloads = prefill_and_export(engine)
            for rid, p in payloads.items():  # all heads, gathered from every rank, equal world 1's K/V
                want = single["payloads"][rid]
                assert p.num_cached == want.num_cached and p.sliding_start == want.sliding_start
                for got_k, want_k, got_v, want_v in zip(p.k, want.k, p.v, want.v):
                    assert got_k.shape == want_k.shape and got_k.shape[1] == TINY["num_key_value_heads"]
                    assert (got_k - want_k).abs().max().item() < 1e-5 and (got_v - want_v).abs().max().item() < 1e-5
        finally:
            engine.close()
    engine.add_request(requests()[0])  # a closed engine's model is gone from the workers: refused, not run
    with pytest.raises(StepFailedError) as closed:
        engine.step()
    assert isinstance(closed.value.__cause__, ExecutorStateError)
    single_engine = single["engine"]
    assert import_and_decode(single_engine, payloads) == single["ids"]


def test_lookahead_over_two_ranks_generates_what_one_process_does(checkpoint, single):
    """The lookahead with tp2 ep2: steps launched before their predecessor's tokens are read hold
    placeholders in the host ids every rank receives; rank 0 broadcasts its device ids, and the
    generations (and the decode side of a hand-off) equal one process's. Then speculative decoding,
    penalized rows (deferred sampling) and forced tokens (jump-forward)."""
    executor = Executor.spawn(2)
    try:
        engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, async_decode=True))
        try:
            for r in requests():
                engine.add_request(r)
            out = run_to_end(engine)
            assert {rid: r["ids"] for rid, r in out.items()} == single["ids"]
            for rid, r in out.items():
                for got, want in zip(r["logprobs"], single["logprobs"][rid]):
                    assert abs(got.logprob - want.logprob) < 1e-4
            assert engine.lookahead_steps > 0
            assert import_and_decode(engine, single["payloads"]) == single["ids"]
        finally:
            engine.close()
        # Speculative decoding (engine/speculative.py) over the same ranks: a draft's decode rows travel in
        # the step arrays every rank receives; the predictions are world 1's outputs, so drafts are accepted.
        engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, speculative_ngram=True))
        try:
            for r in requests():
                r.sampling.prediction = tuple(single["ids"][r.request_id][:5]) + (1, 2, 3)
                engine.add_request(r)
            out = run_to_end(engine)
            assert {rid: r["ids"] for rid, r in out.items()} == single["ids"]
            assert engine.metrics.snapshot()["draft_accepted_total"] > 0
        finally:
            engine.close()
        # Deferred sampling over the same ranks: penalized rows let the step after theirs launch ahead and
        # sample once their token in flight is read; the tokens equal one process's.
        penalized = requests()
        for r in penalized:
            r.sampling.presence_penalty, r.sampling.frequency_penalty = 0.7, 0.4
        one = LLMEngine(load_model(checkpoint, dtype="float32", progress=False), config())
        for r in penalized:
            one.add_request(r)
        want = {rid: r["ids"] for rid, r in run_to_end(one).items()}
        assert want != single["ids"]  # the penalties bite
        engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, async_decode=True))
        try:
            for r in penalized:
                engine.add_request(r)
            assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == want
            assert engine.lookahead_steps > 0
        finally:
            engine.close()
        # Jump-forward: a constraint's forced tokens run as rows of one step over the same ranks.
        from tests.engine.test_jump_forward import ForcingSpec
        constrained = requests()
        for i, r in enumerate(constrained):
            r.sampling.constraint, r.sampling.logprobs = ForcingSpec(period=3 + i % 2, offset=i), None
        one = LLMEngine(load_model(checkpoint, dtype="float32", progress=False), config(jump_forward_tokens=0))
        for r in constrained:
            one.add_request(r)
        want = {rid: r["ids"] for rid, r in run_to_end(one).items()}
        engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, async_decode=True))
        try:
            for r in constrained:
                engine.add_request(r)
            assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == want
            assert engine.metrics.snapshot()["jump_forward_tokens_total"] > 0 and engine.lookahead_steps > 0
        finally:
            engine.close()
    finally:
        executor.shutdown()


def _wait_dead(pid: int, timeout_s: float = 30.0) -> bool:
    """The process is gone or a zombie (a container's PID 1 may never reap an orphan)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _step_until_failure(engine: LLMEngine) -> StepFailedError:
    for _ in range(50):
        try:
            engine.step()
        except StepFailedError as exc:
            return exc
    raise AssertionError("the engine kept stepping after its worker failed")


def test_worker_errors_surface_on_rank_0_and_stop_the_group(checkpoint):
    # 1) A worker raises: a malformed step message (an int64 array too short to hold a step) fails to
    #    decode on rank 1; its traceback reaches rank 0 inside WorkerFailedError.
    ex = Executor.spawn(2)
    try:
        engine = ex.start_engine(checkpoint, config(tp_size=2))
        for r in requests():
            engine.add_request(r)
        engine.step()
        ex.channel.send(Op.STEP, np.arange(3, dtype=np.int64))
        err = _step_until_failure(engine).__cause__
        assert isinstance(err, WorkerFailedError) and err.rank == 1
        assert "ValueError" in err.detail and "unpack_step" in err.detail
        with pytest.raises(StepFailedError) as again:  # broken for good, at once, no hang
            engine.step()
        assert isinstance(again.value.__cause__, WorkerFailedError)
        engine.close()
    finally:
        ex.shutdown()
    assert not ex.workers.processes[1].is_alive()

    # 2) A worker is killed (a crash without a report): rank 0 says which rank and how it died.
    ex = Executor.spawn(2)
    try:
        engine = ex.start_engine(checkpoint, config(ep_size=2))
        for r in requests():
            engine.add_request(r)
        engine.step()
        os.kill(ex.workers.pids[1], signal.SIGKILL)
        err = _step_until_failure(engine).__cause__
        assert isinstance(err, WorkerFailedError) and err.rank == 1
        assert f"worker process {ex.workers.pids[1]} killed by signal 9" in str(err)
        engine.close()
    finally:
        ex.shutdown()


def test_a_killed_rank_makes_the_async_engine_unhealthy(checkpoint):
    """A real dead rank (SIGKILL, no report) under the serving loop: the request in flight fails, check_health
    reports the WorkerFailedError (a Serve replica is then replaced), and later requests are refused at once."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.request import EngineUnhealthyError

    ex = Executor.spawn(2)
    engine = AsyncEngine(ex.start_engine(checkpoint, config(tp_size=2)))
    first, second = requests()[:2]

    async def main():
        assert [t async for d in engine.generate(first) for t in d.token_ids]  # the group works
        engine.check_health()
        os.kill(ex.workers.pids[1], signal.SIGKILL)
        with pytest.raises(StepFailedError) as failed:
            [t async for d in engine.generate(second) for t in d.token_ids]
        assert isinstance(failed.value.__cause__, WorkerFailedError)
        with pytest.raises(EngineUnhealthyError, match="WorkerFailedError: rank 1 of the model group failed"):
            engine.check_health()
        t0 = time.monotonic()
        with pytest.raises(EngineUnhealthyError):
            await engine.generate(GenerateRequest("late", second.prompt_ids, second.sampling)).__anext__()
        assert time.monotonic() - t0 < 1

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        engine.engine.close()
        ex.shutdown()


def test_workers_exit_when_rank_0_dies_without_shutdown(tmp_path):
    """Rank 0 vanishes (os._exit: no shutdown, no atexit): its workers notice and exit, no orphans."""
    script = tmp_path / "rank0.py"
    script.write_text(
        "import os\nfrom engine.distributed import Executor\n"
        "if __name__ == '__main__':\n"
        "    ex = Executor.spawn(2)\n"
        "    print(ex.workers.pids[1], flush=True)\n"
        "    os._exit(0)\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert _wait_dead(int(done.stdout.split()[0]))


def test_cli_generate_tp2_matches_one_process(checkpoint, single):
    reqs = requests()[:3]
    flags = [arg for r in reqs for arg in ("--prompt-ids", ",".join(map(str, r.prompt_ids)))]
    done = subprocess.run([sys.executable, "-m", "engine.cli", "generate", str(checkpoint), *flags, "--tp", "2",
                           "--max-tokens", "6", "--json", "--block-size", "4", "--max-num-batched-tokens", "16",
                           "--max-num-seqs", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt_ids"] for line in lines] == [r.prompt_ids for r in reqs]
    for line, r in zip(lines, reqs):
        assert line["output_ids"] == single["ids"][r.request_id][:6]


def tp2_cli_and_one_process(folder: Path, prompt: list[int], n: int, max_model_len: int, **config):
    """`gptoss generate --tp 2` with the EngineConfig fields in `config` as flags, and the same greedy request (n
    tokens, logprobs) in one process: (the CLI's JSON line, the one-process engine, its output)."""
    flags = [arg for key, value in config.items() for arg in ("--" + key.replace("_", "-"), value)]
    done = subprocess.run([sys.executable, "-m", "engine.cli", "generate", str(folder), "--prompt-ids",
                           ",".join(map(str, prompt)), "--tp", "2", "--max-tokens", str(n), "--json", "--logprobs", "1",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(max_model_len=max_model_len, **config))
    (out,) = engine.generate([GenerateRequest("0", prompt, SamplingParams(temperature=0.0, max_tokens=n, logprobs=1))])
    return json.loads(done.stdout.splitlines()[0]), engine, out


def test_cli_generate_tp2_with_an_fp8_unembedding_matches_one_process(tmp_path):
    """lm_head_dtype="fp8_e4m3" over TP2: each rank rounds its vocabulary rows to FP8. With shards of whole
    128-row blocks (vocab 1024 here) the blocks, so the rounding, are world 1's: same tokens and logprobs.
    (gpt-oss's 201088 rows split into 100544 or 50272, not multiples of 128: there the blocks and the
    FP8 rounding, not the model, differ slightly between TP sizes.)"""
    make_tiny(tmp_path, **dict(TINY, vocab_size=1024))
    line, engine, out = tp2_cli_and_one_process(tmp_path, [5, 6, 7, 8, 9], 6, 64, lm_head_dtype="fp8_e4m3")
    assert type(engine.model.lm_head).__name__ == "Fp8Linear"
    assert line["output_ids"] == out.output_ids
    for got, want in zip(line["logprobs"], out.logprobs):
        assert abs(got["logprob"] - want.logprob) < 1e-4


def test_cli_generate_tp2_with_fp8_dense_layers_matches_one_process(tmp_path):
    """dense_dtype="fp8_e4m3" over TP2: each rank rounds its QKV rows and O columns to FP8; with head shards of
    whole 128-row / 128-column blocks (4 query and 2 KV heads of 64 per rank) the blocks, so the rounding, are
    world 1's. An 80-token prompt runs the FP8-activation path (O's bias added once, after the ranks' sum, by the
    norm), the decode steps the weight-only GEMV's twin (the bias on rank 0): same tokens and logprobs."""
    make_tiny(tmp_path, **dict(TINY, head_dim=64, hidden_size=128, num_attention_heads=8, num_key_value_heads=4))
    prompt = [int(i) for i in torch.randint(1, 1000, (80,), generator=torch.Generator().manual_seed(4))]
    line, engine, out = tp2_cli_and_one_process(tmp_path, prompt, 5, 128, dense_dtype="fp8_e4m3")
    assert type(engine.model.model.layers[0].self_attn.o_proj).__name__ == "Fp8Linear"
    assert line["output_ids"] == out.output_ids
    # The ranks' fp32 partial sums differ from one GEMM's in the last bits, and an activation that close to an
    # e4m3 rounding boundary lands on the other code: ~1e-3 here. O's bias added twice (or not at all) moves these
    # logprobs by 0.1-1.2, FP8 against bf16 QKV / O by up to ~1.5 (this tiny random model is that sensitive).
    for got, want in zip(line["logprobs"], out.logprobs):
        assert abs(got["logprob"] - want.logprob) < 1e-2
    plain = LLMEngine.from_checkpoint(tmp_path, EngineConfig(max_model_len=128))
    (exact,) = plain.generate([GenerateRequest("1", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))])
    assert abs(exact.logprobs[0].logprob - out.logprobs[0].logprob) > 0.1  # the prompt ran the FP8 path


@pytest.mark.parametrize("flags,message", [
    (["--tp", "8"], "num_key_value_heads=4 is not divisible by tp=8"),
    (["--ep", "3"], "num_local_experts=8 is not divisible by ep=3"),
    (["--tp", "2", "--ep", "4"], "tp_size=2 and ep_size=4 must each be 1 or the number of ranks 4"),
    (["--dp", "2"], "dp_size=2: data-parallel attention is not implemented"),
])
def test_cli_rejects_splits_that_do_not_fit(checkpoint, capsys, flags, message):
    from engine.cli import main

    assert main(["generate", str(checkpoint), "--prompt-ids", "1,2", *flags]) == 2
    assert message in capsys.readouterr().err


def test_config_errors_name_the_numbers(checkpoint):
    mc = read_config(checkpoint)
    with pytest.raises(EngineConfigError, match=r"tp_size=3, ep_size=1 do not fit the model: num_key_value_heads=4"):
        check_parallel(config(tp_size=3), mc)
    n = torch.cuda.device_count()
    with pytest.raises(EngineConfigError, match=rf"{n + 1} ranks from cuda need cuda:0..cuda:{n}, one GPU per rank, "
                                                rf"but {n} CUDA device\(s\) are visible" if n else
                       "device 'cuda': no CUDA device is visible to this torch"):
        check_devices(n + 1, "cuda")
    model = load_model(checkpoint, dtype="float32", progress=False)
    with pytest.raises(EngineConfigError, match="the model is split tp=1, ep=1 but the config asks tp_size=2"):
        LLMEngine(model, config(tp_size=2))


def test_decode_steps_travel_as_deltas(checkpoint):
    """With rank 0's step-metadata fast path on (its batch threshold lowered for 6 sequences), decode
    steps go to the other ranks as deltas and generations still equal world 1's; with the lookahead on
    too, the deltas carry the placeholders rank 0's broadcast ids replace."""
    def long_requests():
        g = torch.Generator().manual_seed(11)
        return [GenerateRequest(f"d{i}", torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist(),
                                SamplingParams(temperature=0.0, max_tokens=24)) for i, n in enumerate([2, 6, 9, 13, 3, 7])]

    one = LLMEngine(load_model(checkpoint, dtype="float32", progress=False), config(max_num_batched_tokens=64))
    for r in long_requests():
        one.add_request(r)
    want = {rid: r["ids"] for rid, r in run_to_end(one).items()}
    executor = Executor.spawn(2)
    try:
        for ahead in (False, True):
            engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, max_num_batched_tokens=64,
                                                              async_decode=ahead))
            try:
                engine.runner.step_arrays.MIN_BATCH = 3
                for r in long_requests():
                    engine.add_request(r)
                assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == want, f"lookahead {ahead}"
                assert engine.runner.delta_steps > 10
                assert (engine.lookahead_steps > 10) == ahead
            finally:
                engine.close()
    finally:
        executor.shutdown()


def test_steps_whose_batch_changes_travel_as_carried_rows(checkpoint):
    """Requests of different lengths, more of them than seats: sequences finish at different steps and others join
    as seats free, prefilling in chunks beside the decodes. With rank 0's carry path on (its batch threshold lowered),
    such steps go to the other rank as the rows they carry from the step before (STEP_CARRY), and generations still
    equal world 1's, with and without the lookahead."""
    def churning_requests():
        g = torch.Generator().manual_seed(12)
        lens = [2, 14, 5, 9, 21, 3, 7, 12, 4, 17, 6, 10]
        outs = [9, 3, 20, 6, 12, 17, 4, 24, 8, 5, 15, 11]
        return [GenerateRequest(f"c{i}", torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist(),
                                SamplingParams(temperature=0.0, max_tokens=m)) for i, (n, m) in enumerate(zip(lens, outs))]

    settings = dict(max_num_seqs=6, max_num_batched_tokens=16)
    one = LLMEngine(load_model(checkpoint, dtype="float32", progress=False), config(**settings))
    for r in churning_requests():
        one.add_request(r)
    want = {rid: r["ids"] for rid, r in run_to_end(one).items()}
    executor = Executor.spawn(2)
    try:
        for ahead in (False, True):
            engine = executor.start_engine(checkpoint, config(tp_size=2, ep_size=2, async_decode=ahead, **settings))
            try:
                engine.runner.step_arrays.MIN_BATCH = 3
                for r in churning_requests():
                    engine.add_request(r)
                assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == want, f"lookahead {ahead}"
                assert engine.runner.carry_steps > 5, engine.runner.carry_steps
            finally:
                engine.close()
    finally:
        executor.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_1_matches_the_single_process_engine(checkpoint):
    """On one GPU the multi-rank path runs whole over NCCL: step broadcast, pool-size MIN, and the K/V
    scatter and gather over a group of one. Pure-torch kernels on both sides, so tokens must match. The GPU
    engine exports half its requests into host tensors (prefill_and_export), the NCCL one into GPU tensors."""
    import torch.distributed as dist

    cfg = config(device="cuda", attention_backend="torch", moe_backend="torch")
    plain = LLMEngine(load_model(checkpoint, dtype="float32", device="cuda", progress=False), cfg)
    for r in requests():
        plain.add_request(r)
    expected = {rid: r["ids"] for rid, r in run_to_end(plain).items()}
    plain_payloads = prefill_and_export(plain)
    ex = Executor.spawn(1, "cuda")
    try:
        assert dist.get_backend() == "nccl"
        engine = ex.start_engine(checkpoint, cfg)
        for r in requests():
            engine.add_request(r)
        assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == expected
        assert import_and_decode(engine, plain_payloads) == expected  # scatter over NCCL
        payloads = prefill_and_export(engine, dest_device="cuda")  # gather over NCCL
        for rid, p in payloads.items():
            for got, want in zip([*p.k, *p.v], [*plain_payloads[rid].k, *plain_payloads[rid].v]):
                assert got.device.type == "cuda" and (got - want.to(got.device)).abs().max().item() < 1e-6
        engine.close()
    finally:
        ex.shutdown()
    assert import_and_decode(plain, payloads) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_splits_over_several_gpus_match_the_single_process_engine(checkpoint, world):
    """TP/EP over `world` GPUs with NCCL (one rank per GPU): the same tokens and K/V hand-offs as one
    process on one GPU. Pure-torch kernels in fp32 on both sides."""
    import torch.distributed as dist

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, {torch.cuda.device_count()} visible")
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, value)  # never NVLink multicast on shared hosts
    cfg = config(device="cuda", attention_backend="torch", moe_backend="torch")
    plain = LLMEngine(load_model(checkpoint, dtype="float32", device="cuda", progress=False), cfg)
    for r in requests():
        plain.add_request(r)
    expected = {rid: r["ids"] for rid, r in run_to_end(plain).items()}
    plain_payloads = prefill_and_export(plain)
    ex = Executor.spawn(world, "cuda")
    try:
        assert dist.get_backend() == "nccl"
        for tp, ep in SPLITS[world]:
            engine = ex.start_engine(checkpoint, config(device="cuda", attention_backend="torch",
                                                        moe_backend="torch", tp_size=tp, ep_size=ep))
            for r in requests():
                engine.add_request(r)
            assert {rid: r["ids"] for rid, r in run_to_end(engine).items()} == expected, (tp, ep)
            assert import_and_decode(engine, plain_payloads) == expected, (tp, ep)
            engine.close()
    finally:
        ex.shutdown()
