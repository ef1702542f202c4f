"""Our model against transformers' GptOssForCausalLM (eager) and OpenAI's gpt_oss.torch reference."""

import pytest
import torch

from model.loader import load_model
from model.tiny import make_tiny
from tests.model.references import hf_reference, openai_reference

CONFIGS = {
    # odd expert count, GQA 3:1, MXFP4 experts, window 8
    "mxfp4-e5": dict(mxfp4=True, dtype="float32", num_hidden_layers=3, num_local_experts=5, num_experts_per_tok=4,
                     hidden_size=96, intermediate_size=64, head_dim=16, num_attention_heads=6,
                     num_key_value_heads=2, sliding_window=8, vocab_size=1000, seed=11),
    # dense bf16-stored experts, no GQA sharing, sharded checkpoint, window 4
    "dense-e3": dict(mxfp4=False, dtype="bfloat16", shards=2, num_hidden_layers=2, num_local_experts=3,
                     num_experts_per_tok=2, hidden_size=64, intermediate_size=96, head_dim=8,
                     num_attention_heads=4, num_key_value_heads=4, sliding_window=4, vocab_size=517, seed=5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory, gpt_oss_reference):
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny(folder, **CONFIGS[request.param])
    ours = load_model(folder, dtype="float32", progress=False)
    return ours, hf_reference(folder), openai_reference(ours, gpt_oss_reference)


@pytest.mark.parametrize("length", [1, 3, 23])  # T=1, shorter and longer than the window
def test_logits_match_both_references(models, length):
    ours, hf, oa = models
    ids = torch.randint(0, ours.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        logits = ours.full_logits(ids.tolist())
        hf_logits = hf(ids[None]).logits[0]
        oa_logits = oa(ids)
    assert (logits - hf_logits).abs().max().item() <= 1e-4
    assert (logits - oa_logits).abs().max().item() <= 1e-4
    assert logits.abs().max() > 0.1  # not a degenerate model


def test_greedy_continuations_match(models):
    ours, hf, oa = models
    prompt = torch.randint(0, ours.config.vocab_size, (6,), generator=torch.Generator().manual_seed(7)).tolist()
    steps = 32
    mine, theirs = list(prompt), list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            mine.append(int(ours.full_logits(mine)[-1].argmax()))
            theirs.append(int(oa(torch.tensor(theirs))[-1].argmax()))
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
    assert mine == theirs == hf_out
    assert len(set(mine[len(prompt):])) > 1  # the continuation is not one repeated token
