"""Benchmarks of issue 10 (several GPUs) run here on CPU ranks over gloo: random-weight engines over
ranks (LLMEngine.with_random_weights), bench/parallel.py (TP/EP splits) and bench/disaggregated.py
(prefill engine -> K/V hand-off -> decode engine). On a multi-GPU host: bench/parallel_device_run.sh."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig, EngineConfigError
from engine.distributed import Executor
from engine.llm_engine import LLMEngine
from engine.request import GenerateRequest, SamplingParams


def test_random_weight_engines_over_ranks_for_benchmarks():
    """LLMEngine.with_random_weights: full-size shapes need no checkpoint (bench/parallel.py); one rank and
    two (gloo) both build and generate; the same seed gives the same one-rank model; one weight source only."""
    from model.config import GptOssConfig

    shapes = GptOssConfig(num_hidden_layers=2, num_local_experts=4, vocab_size=512, hidden_size=64, intermediate_size=96,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    settings = dict(dtype="float32", max_num_seqs=4, max_model_len=64, num_full_pages=64, num_sliding_pages=64)
    req = GenerateRequest("r", [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    outs = []
    for _ in range(2):
        one = LLMEngine.with_random_weights(shapes, EngineConfig(**settings), seed=5)
        outs.append(one.generate([req])[0].output_ids)
        one.close()
    assert outs[0] == outs[1] and len(outs[0]) == 5
    two = LLMEngine.with_random_weights(shapes, EngineConfig(tp_size=2, ep_size=2, **settings), seed=5)
    try:
        (done,) = two.generate([req])
        assert len(done.output_ids) == 5 and all(0 <= t < 512 for t in done.output_ids)
        assert two.runner.kv_heads == 1  # rank 0 holds its half of the K/V heads
    finally:
        two.close()
    executor = Executor.spawn(1)
    try:
        with pytest.raises(EngineConfigError, match="exactly one weight source"):
            executor.start_engine(None, EngineConfig(**settings))
    finally:
        executor.shutdown()


def test_parallel_benchmark_smoke_run(tmp_path):
    """bench/parallel.py (issue 10's measurements on a multi-GPU host) runs end to end on CPU ranks: a
    record per split with every measurement, tokens counted as generated."""
    from bench import parallel

    out = tmp_path / "parallel.json"
    assert parallel.main(["--tiny", "--device", "cpu", "--splits", "1x1,2x2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tp"], r["ep"], r["gpus"]) for r in runs] == [(1, 1, 1), (2, 2, 2)]
    for r in runs:
        assert r["b1"]["out_len"] == 8 and r["b1"]["tok_s_user"] > 0 and r["prefill"]["out_len"] == 1
        t = r["throughput"]
        assert t["requests"] == 4 and t["output_tok_s"] == pytest.approx(4 * 8 / t["wall_s"])
    with pytest.raises(SystemExit):
        parallel.main(["--tiny", "--device", "cpu", "--splits", "2by2"])


def test_disaggregated_benchmark_smoke_run(tmp_path):
    """bench/disaggregated.py: a prefill engine in a spawned process (TP2/EP2 over its own gloo ranks) hands
    K/V to this process's decode engine (TP2/EP2); both sides hold the same random model, so the split
    run generates what the decode engine generates alone."""
    from bench import disaggregated

    out = tmp_path / "dis.json"
    assert disaggregated.main(["--tiny", "--device", "cpu", "--tp", "2", "--ep", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["disaggregated"]["in_len"] for r in rows] == [24, 40]
    for r in rows:
        d, o = r["disaggregated"], r["one_engine"]
        assert d["out_len"] == o["out_len"] == 6 and d["kv_bytes"] > 0 and d["ttft_ms"] > 0
        assert r["same_tokens"] and d["output_ids"] == o["output_ids"]


def test_allreduce_benchmark_smoke_run(tmp_path):
    """bench/allreduce.py over 2 gloo ranks: every sum checked against the fp32 reference (awkward row
    counts), a time per call; the symmetric-memory method is CUDA-only and absent here."""
    from bench import allreduce

    out = tmp_path / "ar.json"
    assert allreduce.main(["--world", "2", "--device", "cpu", "--tokens", "1,3,67", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [r["tokens"] for r in rec["rows"]] == [1, 3, 67]
    for r in rec["rows"]:
        assert r["nccl_ok"] and r["nccl_max_err"] < 0.05 and r["nccl_eager_us"] > 0 and "symm_mem_ok" not in r


def test_all_reduce_setting_is_checked():
    with pytest.raises(EngineConfigError, match="all_reduce must be one of"):
        EngineConfig(all_reduce="mpi")
    with pytest.raises(EngineConfigError, match="needs CUDA devices"):
        EngineConfig(all_reduce="symm_mem", device="cpu", tp_size=2)
    assert EngineConfig().all_reduce == "auto"


def test_auto_all_reduce_picks_nccl_where_symm_mem_cannot_run():
    import torch

    from engine.distributed.worker import wants_symm_mem

    cpu = torch.device("cpu")
    assert not wants_symm_mem("auto", 2, cpu) and not wants_symm_mem("nccl", 2, torch.device("cuda:0"))
    assert not wants_symm_mem("symm_mem", 1, torch.device("cuda:0"))  # one rank: nothing to sum
    assert wants_symm_mem("symm_mem", 2, torch.device("cuda:0"))  # asked for: set up (or fail) on every rank
    if not torch.cuda.is_available():  # this process sees no GPU: auto cannot map the others' memory
        assert not wants_symm_mem("auto", 2, torch.device("cuda:0"))



def test_disaggregated_load_benchmark_smoke_run(tmp_path):
    """bench/disaggregated_load.py: a burst of requests through a prefill process and this process's decode
    engine, then half of them through one engine doing both; every request gets all its tokens, and the
    same prompts give the same greedy tokens both ways (fp32 on CPU)."""
    from bench import disaggregated_load

    out = tmp_path / "load.json"
    assert disaggregated_load.main(["--tiny", "--device", "cpu", "--requests", "4", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["tokens_per_request"] == [6] and rec["same_tokens"] == 2
    for key in ("split", "both"):
        r = rec[key]
        assert r["requests"] == (4 if key == "split" else 2) and r["output_tok_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_max"] and 0 < r["itl_ms_p50"] <= r["itl_ms_max"]
