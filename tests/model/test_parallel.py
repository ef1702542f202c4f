"""Tensor and expert parallelism on CPU with gloo: the logits of every split equal world size 1."""

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.loader import Checkpoint, load_model, load_weights, read_config
from model.gpt_oss import GptOssForCausalLM
from model.parallel import Parallel, ParallelConfigError
from model.tiny import make_tiny

TINY = dict(dtype="float32", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=3, hidden_size=64,
            intermediate_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=4, sliding_window=4,
            vocab_size=1000, seed=21)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [271]]
SPLITS = {2: [(2, 1), (1, 2), (2, 2)], 4: [(4, 1), (1, 4), (4, 4)]}  # (tp, ep) per world size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for tp, ep in SPLITS[world]:
        parallel = Parallel(tp_size=tp, ep_size=ep, rank=rank)
        config = read_config(folder)
        model = GptOssForCausalLM(config, parallel, torch.float32)
        read = load_weights(model, folder, progress=False)
        expected = sum(p.numel() * 4 for p in model.parameters())  # fp32 checkpoint: 4 bytes an element
        logits = [model.full_logits(p).tolist() for p in PROMPTS]
        results[f"{tp},{ep}"] = {"read": read, "expected": expected, "logits": logits}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    make_tiny(folder, **TINY)
    return folder


@pytest.mark.parametrize("world", [2, 4])
def test_tp_ep_logits_match_single_rank(checkpoint, tmp_path, world):
    single = load_model(checkpoint, progress=False)
    reference = [single.full_logits(p) for p in PROMPTS]
    total = Checkpoint(checkpoint)
    total_bytes = sum(i.nbytes for i in total.info.values())
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(world, _free_port(), str(checkpoint), out), nprocs=world, join=True)
    for rank in range(world):
        results = json.loads(open(f"{out}.{rank}").read())
        for split, r in results.items():
            for got, want in zip(r["logits"], reference):
                assert (torch.tensor(got) - want).abs().max().item() <= 1e-5, (split, rank)
            # each rank read exactly its own shards (plus the replicated tensors), nothing more
            assert r["read"] == r["expected"], (split, rank)
            assert r["read"] < total_bytes


def test_bad_splits_name_the_numbers():
    config = read_config_for(TINY)
    with pytest.raises(ParallelConfigError, match=r"num_key_value_heads=4 is not divisible by tp=8"):
        GptOssForCausalLM(config, Parallel(tp_size=8, ep_size=1))
    with pytest.raises(ParallelConfigError, match=r"num_local_experts=8 is not divisible by ep=3"):
        GptOssForCausalLM(config, Parallel(tp_size=1, ep_size=3))
    with pytest.raises(ParallelConfigError, match=r"tp=2 and ep=4"):
        GptOssForCausalLM(config, Parallel(tp_size=2, ep_size=4))


def read_config_for(kwargs):
    from model.tiny import tiny_config

    return tiny_config(**{k: v for k, v in kwargs.items() if k not in ("dtype", "seed")})
