"""The `gptoss` command line, run as a subprocess: make-tiny is deterministic, generate batches prompts
from every source in input order and matches the model's from-scratch greedy decoding."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def gptoss(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    args = ["--vocab", "1000", "--layers", "3", "--experts", "3", "--sliding-window", "8", "--dtype", "float32"]
    for name, seed in (("a", "4"), ("b", "4"), ("c", "5")):
        done = gptoss("make-tiny", str(base / name), "--seed", seed, *args)
        assert done.returncode == 0, done.stderr
    assert "3 layers, 3 experts, vocab 1000" in done.stdout
    return base


def test_make_tiny_is_deterministic(tiny):
    assert _digest(tiny / "a") == _digest(tiny / "b")
    assert _digest(tiny / "a")["model.safetensors"] != _digest(tiny / "c")["model.safetensors"]
    config = json.loads((tiny / "a" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_local_experts"], config["vocab_size"]) == (3, 3, 1000)
    assert config["sliding_window"] == 8 and config["dtype"] == "float32"


def test_generate_json_in_input_order_matches_reference(tiny, tmp_path):
    from model.loader import load_model
    from serve_app.harmony.encoding import load_harmony_encoding

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("[7, 8, 9, 10, 11, 12, 13, 14, 15, 16]\n\n" + json.dumps({"prompt_ids": [3]}) + "\n")
    done = gptoss("generate", str(tiny / "a"), "--prompt-ids", "1,2,3", "--prompts-jsonl", str(jsonl),
                  "--prompt-ids", "400,401,402,403,404,405,406,407,408,409,410,411,412", "--max-tokens", "9",
                  "--json", "--block-size", "4", "--max-num-batched-tokens", "8", "--max-num-seqs", "4")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt_ids"] for line in lines] == [[1, 2, 3], list(range(7, 17)), [3], list(range(400, 413))]
    model = load_model(tiny / "a", dtype="float32", progress=False)
    encoding = load_harmony_encoding()
    for line in lines:
        ids = list(line["prompt_ids"])
        for _ in range(9):
            ids.append(int(model.full_logits(ids)[-1].argmax()))
        assert line["output_ids"] == ids[len(line["prompt_ids"]):]
        assert line["finish_reason"] == "length"
        assert line["text"] == encoding.decode(line["output_ids"])


def test_generate_seeded_sampling_is_per_request(tiny):
    done = gptoss("generate", str(tiny / "a"), "--prompt-ids", "5,6,7", "--prompt-ids", "9,9", "--prompt-ids", "5,6,7",
                  "--max-tokens", "12", "--temperature", "1.0", "--top-p", "0.95", "--seed", "11", "--json")
    assert done.returncode == 0, done.stderr
    first, other, again = (json.loads(line)["output_ids"] for line in done.stdout.splitlines())
    assert first == again and len(first) == 12  # same prompt and seed: same tokens, wherever in the batch


def test_generate_harmony_prompt_on_the_embedded_model(tmp_path):
    from engine.cli import render_user_prompt
    from serve_app.harmony.encoding import load_harmony_encoding

    env = {"GPTOSS_CACHE_DIR": str(tmp_path / "cache")}
    done = gptoss("generate", "--prompt", "Hello, who are you?", "--max-tokens", "6", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cache" / "tiny" / "config.json").exists() and "created the embedded tiny model" in done.stderr
    (line,) = [json.loads(text) for text in done.stdout.splitlines()]
    assert line["prompt_ids"] == render_user_prompt("Hello, who are you?")
    assert line["prompt_ids"][-2:] == [200006, 173781]  # <|start|>assistant: the model speaks next
    assert 1 <= len(line["output_ids"]) <= 6 and line["text"] == load_harmony_encoding().decode(line["output_ids"])
    assert line["finish_reason"] in ("stop", "length")


def test_cli_errors_are_messages_not_tracebacks(tiny, tmp_path, capsys):
    from engine.cli import main

    for args, message in [
        (("generate", str(tiny / "a"), "--prompt-ids", "1,x"), "expected comma-separated token ids"),
        (("generate", str(tiny / "a")), "no prompt"),
        (("generate", str(tmp_path / "missing"), "--prompt-ids", "1"), "config.json is missing"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1,5000"), "prompt_ids must be token ids in [0, 1000)"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--top-p", "0"), "top_p must be in (0, 1]"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--block-size", "0"), "block_size must be a positive"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--cuda-graphs", "on"), "cuda_graphs=True needs device"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--prediction-ids", "1,y"), "expected comma-separated"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--prediction", "a", "--prediction-ids", "1"), "not both"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--prediction-ids", "1,5000"), "prediction"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--speculative-tokens", "99"), "speculative_tokens"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--max-tokens", "-1"), "max_tokens must be a positive"),
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--device", "cudafoo"), "device must be 'cpu', 'cuda'"),
        # one past the visible GPUs (none on CPU hosts): a message, not a traceback from deep in the model build
        (("generate", str(tiny / "a"), "--prompt-ids", "1", "--device", f"cuda:{torch.cuda.device_count()}"),
         "CUDA device"),
    ]:
        assert main(list(args)) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.startswith("gptoss generate: error:"), err
    assert main(["convert", str(tiny / "a"), str(tiny / "a")]) == 2
    assert capsys.readouterr().err.startswith("gptoss convert: error: DST must differ from SRC")


def test_generate_on_a_transformers_written_checkpoint_gives_transformers_tokens(tmp_path):
    # The checkpoint is written by transformers' save_pretrained, not by our tool.
    import torch

    from tests.model.references import random_hf_model

    hf = random_hf_model(1, num_hidden_layers=3, num_local_experts=5, num_experts_per_tok=4, vocab_size=500,
                         hidden_size=48, intermediate_size=40, head_dim=8, num_attention_heads=6, num_key_value_heads=2,
                         sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    hf.save_pretrained(tmp_path)
    prompts = [[5, 17, 250, 3, 99, 42, 7, 8, 11, 12], [400]]
    done = gptoss("generate", str(tmp_path), *sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), []),
                  "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2
    for prompt, line in zip(prompts, lines):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0].tolist()
        assert line["prompt_ids"] == prompt
        assert prompt + line["output_ids"] == expected


def test_convert_writes_an_fp8_checkpoint(tiny, tmp_path):
    from safetensors import safe_open

    done = gptoss("convert", str(tiny / "a"), str(tmp_path / "fp8"), "--device", "cpu", "--quiet")
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    fp8 = [n for n in index["weight_map"] if "experts" in n]
    assert fp8, "no expert tensors written"
    dtypes = set()
    for name in fp8:
        with safe_open(tmp_path / "fp8" / index["weight_map"][name], "pt") as f:
            dtypes.add(str(f.get_tensor(name).dtype))
    assert "torch.float8_e4m3fn" in dtypes


def test_generate_with_an_fp8_unembedding_scores_with_that_model(tiny):
    """--lm-head-dtype fp8_e4m3 reaches the engine: the tokens and logprobs --json prints equal an in-process
    engine's with the FP8 unembedding, and the logprobs differ from the exact model's by its rounding."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import GenerateRequest, SamplingParams

    prompt, n = [11, 12, 13, 14], 6
    done = gptoss("generate", str(tiny / "a"), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n),
                  "--json", "--logprobs", "2", "--lm-head-dtype", "fp8_e4m3")
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.splitlines()[0])
    assert len(line["logprobs"]) == n and all(len(lp["top"]) == 2 for lp in line["logprobs"])

    def run(lm_head_dtype: str):
        engine = LLMEngine.from_checkpoint(tiny / "a", EngineConfig(max_model_len=64, lm_head_dtype=lm_head_dtype))
        (out,) = engine.generate([GenerateRequest("0", prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                logprobs=2))])
        return out.output_ids, [lp.logprob for lp in out.logprobs]

    ids, logprobs = run("fp8_e4m3")
    assert line["output_ids"] == ids
    assert [lp["logprob"] for lp in line["logprobs"]] == pytest.approx(logprobs, abs=1e-5)
    _, exact = run("auto")
    assert max(abs(a - b) for a, b in zip(logprobs, exact)) > 1e-4  # the FP8 unembedding is what ran


def test_generate_with_prefix_caching_prints_the_same_tokens(tiny):
    """Prefix caching (on by default; --no-prefix-caching turns it off) changes no token (prompts sharing
    2 pages of 16)."""
    shared = ",".join(str(t) for t in range(40, 72))
    args = ("generate", str(tiny / "a"), "--prompt-ids", f"{shared},5,6", "--prompt-ids", f"{shared},7",
            "--max-tokens", "4", "--json", "--max-num-batched-tokens", "40", "--max-num-seqs", "2")
    plain, cached = gptoss(*args, "--no-prefix-caching"), gptoss(*args)
    assert plain.returncode == 0 and cached.returncode == 0, cached.stderr
    ids = [[json.loads(line)["output_ids"] for line in done.stdout.splitlines()] for done in (plain, cached)]
    assert ids[0] == ids[1] and len(ids[0]) == 2


def test_generate_with_a_prediction_prints_the_same_tokens_and_counts_the_drafts(tiny):
    """--prediction-ids: the greedy output fed back as the prediction is verified as drafts (accepted, so
    fewer steps), the tokens unchanged; --prompt-lookup drafts from the prompt with the same result."""
    args = ("generate", str(tiny / "a"), "--prompt-ids", "5,6,7,8,5,6,7,8,5,6", "--max-tokens", "24", "--json")
    plain = gptoss(*args)
    assert plain.returncode == 0, plain.stderr
    expected = json.loads(plain.stdout)
    assert "draft_tokens" not in expected
    ids = ",".join(map(str, expected["output_ids"]))
    for extra in (("--prediction-ids", ids), ("--prediction-ids", ids, "--speculative-tokens", "7")):
        done = gptoss(*args, *extra)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got["output_ids"] == expected["output_ids"], extra
        assert got["accepted_draft_tokens"] >= 12 and got["draft_tokens"] >= got["accepted_draft_tokens"], got
    lookup = gptoss(*args, "--prompt-lookup")
    assert lookup.returncode == 0, lookup.stderr
    assert json.loads(lookup.stdout)["output_ids"] == expected["output_ids"]
