"""The engine on the GPU kernels (FlashInfer sink prefill, Triton split-KV decode, FP8 Triton MoE, decode
CUDA graphs) against the pure-torch twin, and CUDA-graph decode against the same step run eagerly.
Skips without an NVIDIA GPU."""

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_factory import build_model, quantize_dense_fp8, quantize_lm_head_fp8  # noqa: E402
from engine.request import GenerateRequest, SamplingParams  # noqa: E402
from kernels.attention import AttentionBatch, KVGroupMeta, PagedKVCache  # noqa: E402
from kernels.moe.fp8_experts import Fp8Experts  # noqa: E402
from model.config import GptOssConfig  # noqa: E402
from model.gpt_oss import GptOssForCausalLM  # noqa: E402
from tests.engine.engine_testlib import run_to_end  # noqa: E402

pytestmark = pytest.mark.gpu
BS = 16


def small_config() -> GptOssConfig:
    # Real head layout (8 query heads per kv head, head_dim 64, window 128); small everything else.
    return GptOssConfig(num_hidden_layers=4, num_local_experts=8, vocab_size=2048, hidden_size=256,
                        intermediate_size=256, num_attention_heads=16, num_key_value_heads=2,
                        max_position_embeddings=4096)


@pytest.fixture(scope="module")
def gpu_model():
    model = build_model(small_config(), "cuda", torch.bfloat16, random_weights=True, seed=5, max_batch=16,
                        max_kv_len=4096, cuda_graph=True)
    with torch.no_grad():  # 16 dominant vocabulary rows: wide top-2 margins, so greedy picks are checkable
        model.lm_head.weight[:16] *= 8
    return model


def torch_twin(gpu: GptOssForCausalLM, dtype: torch.dtype) -> GptOssForCausalLM:
    """The pure-torch path on the same weights: dense layers and attention in `dtype`, and the FP8
    experts' torch twin (kernels/moe/fp8_reference.py: same FP8 weights, same activation rounding)."""
    def experts_factory(layers=iter(gpu.model.layers)):
        src = next(layers).mlp.experts
        twin = Fp8Experts(src.num_local, src.first_expert, src.hidden, src.intermediate, src.alpha, src.limit,
                          src.w13.device, backend="torch")
        twin.load_quantized(src.w13, src.s13, src.b13, src.w2, src.s2, src.b2)
        return twin

    ref = GptOssForCausalLM(gpu.config, dtype=dtype, device="cuda", experts_factory=experts_factory)
    dense = {k: v for k, v in gpu.state_dict().items() if ".experts." not in k}
    missing, _ = ref.load_state_dict(dense, strict=False)
    assert not [k for k in missing if ".experts." not in k], missing
    return ref


def test_engine_on_gpu_kernels_matches_the_torch_twin(gpu_model):
    ref = torch_twin(gpu_model, torch.float32)
    ref_bf16 = torch_twin(gpu_model, torch.bfloat16)
    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 140, 300)]
    # Logits of whole prompts (prefill path: FlashInfer + FP8 kernels) against the fp32 twin, judged by
    # what bf16 itself costs: the pure-torch path in bf16 on the same weights. This random 4-layer model
    # is sensitive (top-4 of 8 experts flips easily): on the H200 (2026-11-29, call 2) the kernels were
    # at relative error 0.066 / 0.134 for 5 / 140 tokens, and the bf16 torch path on CPU at 0.079 / 0.122.
    errors = []
    for p in prompts:
        want = ref.full_logits(p).float()
        got, bf16 = gpu_model.full_logits(p).float(), ref_bf16.full_logits(p).float()
        rel, rel_bf16 = ((got - want).norm() / want.norm()).item(), ((bf16 - want).norm() / want.norm()).item()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).mean().item()
        cos_bf16 = torch.nn.functional.cosine_similarity(bf16, want, dim=-1).mean().item()
        errors.append((got - want).abs().flatten())
        print(f"prompt {len(p)}: GPU kernels rel err {rel:.4f} cosine {cos:.5f}; "
              f"bf16 torch path rel err {rel_bf16:.4f} cosine {cos_bf16:.5f}")
        assert rel <= 1.5 * rel_bf16 + 0.01 and cos >= cos_bf16 - 0.005, (
            f"prompt {len(p)}: the GPU kernels (rel err {rel:.4f}, cosine {cos:.5f}) are less accurate than the "
            f"bf16 pure-torch path (rel err {rel_bf16:.4f}, cosine {cos_bf16:.5f})")
    typical_err = torch.quantile(torch.cat(errors)[:2**24], 0.999).item()
    # Greedy generation through the engine (chunked prefill, decode in CUDA graphs) vs the fp32 twin's
    # argmax over the generated text, where the twin's top-2 margin exceeds 3x the 99.9th-percentile
    # logit error. FP8 activation codes flip under bf16 rounding, so the error tail is heavy: on CPU the
    # bf16 torch path itself agreed with fp32 on 14 of 15 such positions (two seeds); hence >= 80%.
    config = EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                          num_full_pages=128, num_sliding_pages=96, cuda_graphs=True)
    engine = LLMEngine(gpu_model, config)
    assert sorted(engine.graph_capture_seconds) == [1, 2, 4, 8]
    outs = engine.generate([GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0))
                            for i, p in enumerate(prompts)])
    checked = agree = 0
    for p, out in zip(prompts, outs):
        tokens = out.output_ids
        assert len(tokens) == 12
        logits = ref.full_logits(p + tokens[:-1]).float()[len(p) - 1:]  # [12, V]: predicts each output token
        top2 = logits.topk(2, dim=-1)
        for j, tok in enumerate(tokens):
            if top2.values[j, 0] - top2.values[j, 1] > 3 * typical_err + 0.01:
                checked += 1
                agree += int(top2.indices[j, 0].item() == tok)
        # The decode path (graphs, Triton split-KV, masked MoE) against the same kernels' prefill path:
        # the engine's logprob of each chosen token vs a full recompute on the GPU.
        recompute = gpu_model.full_logits(p + tokens[:-1]).float()[len(p) - 1:].log_softmax(-1)
        diffs = [abs(lp.logprob - recompute[j, t].item()) for j, (lp, t) in enumerate(zip(out.logprobs, tokens))]
        print(f"prompt {len(p)}: decode vs recompute logprob diff median {sorted(diffs)[6]:.4f} max {max(diffs):.4f}")
        # bf16 torch path on CPU (paged decode vs recompute, same model): median 0.16, max 0.52; a decode
        # path reading wrong pages or positions is off by nats.
        assert sorted(diffs)[6] < 0.5, f"prompt {len(p)}: decode logprobs drift from the prefill path: {diffs}"
    print(f"greedy tokens: {agree} of {checked} stable positions agree with the fp32 twin")
    assert checked >= 5, f"only {checked} of 36 positions have a stable argmax (99.9% logit error {typical_err:.4f})"
    assert agree >= 0.8 * checked, f"{checked - agree} of {checked} stable positions disagree with the twin"


def random_decode_batch(lens: list[int], window: int, device="cuda") -> AttentionBatch:
    """Sequences with `lens` cached tokens each (own pages), decoding position len."""
    b = len(lens)
    width = max(math.ceil((n + 1) / BS) for n in lens)
    full = torch.zeros(b, width, dtype=torch.int32)
    sliding = torch.zeros(b, window // BS + 2, dtype=torch.int32)
    slots, sslots, slens, nxt = [], [], [], 0
    for i, n in enumerate(lens):
        pages = math.ceil((n + 1) / BS)
        full[i, :pages] = torch.arange(nxt, nxt + pages)
        nxt += pages
        first = max(0, n - (window - 1)) // BS
        live = n // BS - first + 1
        sliding[i, :live] = torch.arange(live) + i * (window // BS + 2)
        slots.append(int(full[i, n // BS]) * BS + n % BS)
        sslots.append(int(sliding[i, live - 1]) * BS + n % BS)
        slens.append(n + 1 - first * BS)
    lens1 = [n + 1 for n in lens]

    def t(x, dt):
        return torch.tensor(x, dtype=dt, device=device)

    return AttentionBatch(torch.arange(b + 1, dtype=torch.int32, device=device), [1] * b,
                          KVGroupMeta(full.to(device), t(lens1, torch.int32), t(slots, torch.int64), lens1),
                          KVGroupMeta(sliding.to(device), t(slens, torch.int32), t(sslots, torch.int64), slens),
                          is_decode=True)


@pytest.mark.parametrize("kv_dtype,cuda_front", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                                  (torch.bfloat16, True)])
def test_cuda_graph_decode_equals_eager_decode(gpu_model, kv_dtype, cuda_front, monkeypatch):
    # cuda_front: single-sequence steps route through kernels/moe/decode_front_cuda.py, in the graphs and eagerly
    for m in gpu_model.modules():
        if isinstance(m, Fp8Experts):
            monkeypatch.setattr(m, "cuda_front", cuda_front)
    cfg = gpu_model.config
    sliding = [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)]
    kv = PagedKVCache.allocate(sliding, 1024, 128, BS, 2, 64, kv_dtype, "cuda")
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, device="cuda"))
    gpu_model.backend.bind_cache(kv)
    graphs = DecodeGraphs(gpu_model, [1, 2, 4, 8])
    seconds = graphs.capture()
    assert sorted(seconds) == [1, 2, 4, 8] and all(s > 0 for s in seconds.values())
    gen = torch.Generator().manual_seed(11)
    for lens in ([700], [3, 129, 1000], [17, 250, 31, 600, 88, 999, 128, 5]):
        batch = random_decode_batch(lens, cfg.sliding_window)
        ids = torch.randint(0, cfg.vocab_size, (len(lens),), generator=gen).cuda()
        pos = torch.tensor(lens, device="cuda")
        graphed = graphs.run(ids, pos, batch).clone()
        eager = graphs.run_eager(ids, pos, batch)
        assert torch.isfinite(graphed).all()
        assert torch.equal(graphed, eager), f"lens {lens}: max diff {(graphed - eager).abs().max().item()}"
    # The decode loop makes no host sync: staging, plan and replay only enqueue work.
    batch = random_decode_batch([40, 400, 4000 - 1], cfg.sliding_window)
    ids = torch.zeros(3, dtype=torch.long, device="cuda")
    pos = torch.tensor([40, 400, 3999], device="cuda")
    graphs.run(ids, pos, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ids = graphs.run(ids, pos, batch).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kv_cache_dtype,fp8,mxfp4,front", [
    ("auto", "", 0, "auto"), ("fp8_e4m3", "", 0, "auto"), ("auto", "lm_head", 0, "auto"), ("auto", "dense", 0, "auto"),
    ("auto", "", 4, "auto"), ("auto", "dense", 0, "cuda"), ("auto", "segments", 0, "auto")])
def test_engine_with_cuda_graphs_generates_what_it_does_eagerly(kv_cache_dtype, fp8, mxfp4, front, monkeypatch):
    # The engine's own graph paths (ModelRunner.execute -> DecodeGraphs, and PrefillGraphs for the prompts)
    # against the same engine without graphs, same random weights: identical greedy tokens for a mixed
    # batch. Both backends are built for graphs (split counts fixed by batch size): a backend planned per
    # step picks other split counts, which changes the summation order and, on this tiny model, flipped a
    # near-tie on the H200. mxfp4: experts drawn as MXFP4, decode steps of <= 4 tokens on the CUDA MXFP4 GEMM.
    # fp8 "dense": QKV / O in FP8 (dense_dtype), the 130- and 700-token prompts on FP8 activations. front "cuda":
    # decode_front='cuda', single-sequence steps' MoE front as one CUDA cluster (auto leaves 8 experts on Triton).
    # fp8 "segments": moe_segments_max_rows=128, so the 130-token prompt's chunk (65 rows per expert of 8) and the
    # mixed steps above 64 tokens run the segments GEMM (at 16, the default, 8 experts never would).
    from kernels.moe import decode_front_cuda, mxfp4_decode_layer, triton_grouped_gemm

    mxfp4_calls, front_calls, segments_calls = [], [], []
    run_mxfp4, run_front = mxfp4_decode_layer.decode_experts, decode_front_cuda.decode_front
    run_segments = triton_grouped_gemm.grouped_gemm_segments
    monkeypatch.setattr(mxfp4_decode_layer, "decode_experts", lambda *a: mxfp4_calls.append(a[0].shape[0]) or run_mxfp4(*a))
    monkeypatch.setattr(decode_front_cuda, "decode_front", lambda *a: front_calls.append(a[0].shape[0]) or run_front(*a))
    monkeypatch.setattr(triton_grouped_gemm, "grouped_gemm_segments",
                        lambda *a, **k: segments_calls.append(a[3].shape[0]) or run_segments(*a, **k))

    def engine(graphs: bool, prefill_graphs: bool) -> LLMEngine:
        model = build_model(small_config(), "cuda", torch.bfloat16, random_weights=True, seed=7, max_batch=8,
                            max_kv_len=2048, cuda_graph=True, mxfp4_decode_max_tokens=mxfp4, decode_front=front,
                            moe_segments_max_rows=128 if fp8 == "segments" else None)
        assert all(m.cuda_front == (front == "cuda") for m in model.modules() if isinstance(m, Fp8Experts))
        with torch.no_grad():
            model.lm_head.weight[:16] *= 8
        if fp8 == "lm_head":  # lm_head_dtype="fp8_e4m3": the FP8 GEMV in the graphs and for the prompts' last tokens
            quantize_lm_head_fp8(model)
        if fp8 == "dense":
            quantize_dense_fp8(model)
        return LLMEngine(model, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=2048,
                                             num_full_pages=512, num_sliding_pages=256, cuda_graphs=graphs,
                                             prefill_graphs=prefill_graphs, kv_cache_dtype=kv_cache_dtype,
                                             mxfp4_decode_max_tokens=mxfp4))

    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 130, 700)]
    outputs = []
    for graphs, prefill_graphs in ((False, False), (True, False), (True, True)):
        llm = engine(graphs, prefill_graphs)
        if graphs:
            assert llm.graph_capture_seconds, "no decode graph was captured"
        assert bool(llm.prefill_graph_capture_seconds) == prefill_graphs
        # the first request runs on alone for its last 16 tokens: steps of one sequence (bucket 1; FP8 QKV then
        # the slab GEMV with the rotary in its tail)
        reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40 if i == 0 else 24,
                                                           ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs.append([c.output_ids for c in llm.generate(reqs)])
        paths = llm.metrics.snapshot()["steps_by_path_total"]
        if prefill_graphs:
            assert llm.runner.prefill_graphs.replays > 0 and paths.get("prefill_graph", 0) > 0
        if graphs:
            assert paths.get("decode_graph", 0) > 0, paths
        if graphs and prefill_graphs:
            assert "eager" not in paths, paths  # every step replayed one kind of graph
    # eager decode steps of 3 sequences (and the graphs' capture at buckets 1-4) went through the MXFP4 layer
    assert (3 in mxfp4_calls and max(mxfp4_calls) <= 4) if mxfp4 else not mxfp4_calls, mxfp4_calls
    # the first request's single-sequence steps (eager, and the bucket-1 graph's capture) took the CUDA front
    assert (front_calls and set(front_calls) == {1}) if front == "cuda" else not front_calls, front_calls
    assert bool(segments_calls) == (fp8 == "segments"), segments_calls
    assert outputs[0] == outputs[1], "decode graphs changed the greedy tokens"
    assert outputs[1] == outputs[2], "prefill graphs changed the greedy tokens"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_speculative_decoding_computes_what_a_recompute_does(gpu_model, kv_cache_dtype):
    # Drafts (engine/speculative.py) verified as decode rows through the captured graphs. Token equality with
    # one-row decoding holds in exact arithmetic (the CPU tests check it) but not in bf16: a verify step runs
    # its rows in another batch shape (GEMM tiles, split-K, attention splits), and this sensitive random model
    # flips greedy near-ties under that rounding (H200, 2026-12-01: the fp8 K/V case diverged at token 3). So,
    # as for plain decoding above: every output token's logprob against a full recompute of the same text on
    # the same kernels (a verify row reading wrong pages or positions is off by nats), the same bound for the
    # plain and the speculative run, and most drafts accepted.
    config = EngineConfig(device="cuda", max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                          num_full_pages=128, num_sliding_pages=96, cuda_graphs=True, kv_cache_dtype=kv_cache_dtype,
                          speculative_max_seqs=4)
    llm = LLMEngine(gpu_model, config)
    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 130, 300)]

    def params(prediction=()):
        return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prediction=tuple(prediction))

    def graph_steps() -> int:
        return llm.metrics.snapshot()["steps_by_path_total"].get("decode_graph", 0)

    steps = graph_steps()
    plain = llm.generate([GenerateRequest(f"p{i}", p, params()) for i, p in enumerate(prompts)])
    steps, plain_steps = graph_steps(), graph_steps() - steps
    spec = llm.generate([GenerateRequest(f"s{i}", p, params(c.output_ids)) for i, (p, c) in enumerate(zip(prompts, plain))])
    snap = llm.metrics.snapshot()
    assert snap["draft_accepted_total"] >= 20, snap
    assert sum(c.num_accepted_draft_tokens for c in spec) == snap["draft_accepted_total"]
    # Several tokens per step: the request with the most accepted drafts took 24 - accepted steps. (The batch's
    # step count need not drop: a request whose output leaves its prediction early decodes one token per step,
    # H200 2026-12-01: 23 graph steps with and without speculation in the fp8 K/V case.)
    assert max(c.num_accepted_draft_tokens for c in spec) >= 10, [c.num_accepted_draft_tokens for c in spec]
    assert graph_steps() - steps <= plain_steps, (graph_steps() - steps, plain_steps)
    for run in (plain, spec):
        for p, out in zip(prompts, run):
            tokens = out.output_ids
            recompute = gpu_model.full_logits(p + tokens[:-1]).float()[len(p) - 1:].log_softmax(-1)
            diffs = sorted(abs(lp.logprob - recompute[j, t].item()) for j, (lp, t) in enumerate(zip(out.logprobs, tokens)))
            assert diffs[len(diffs) // 2] < 0.5, (out.request_id, diffs)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefix_cache_hits_export_the_kv_an_uncached_engine_computes(gpu_model, kv_cache_dtype):
    """Prefix caching on the GPU kernels: a prefill-only engine serves the second prompt's shared 192
    tokens (12 pages of 16: every full page, the sliding window before the cut) from the first's pages;
    its exported K/V matches an uncached engine's within bf16 noise (a wrong page would be off by O(1))."""
    shared = torch.randint(0, 2048, (192,), generator=torch.Generator().manual_seed(77)).tolist()
    prompts = [shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]]

    def exports(cache: bool) -> tuple[dict, int]:
        config = EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                              num_full_pages=128, num_sliding_pages=96, kv_cache_dtype=kv_cache_dtype,
                              enable_prefix_caching=cache)
        engine = LLMEngine(gpu_model, config)
        out = {}
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(f"x{i}", p, SamplingParams(temperature=0.0, max_tokens=2)),
                               prefill_only=True)
            run_to_end(engine, engine.step_prefill)  # one after another: the second finds the first's pages
            out[f"x{i}"] = engine.export_kv(f"x{i}")
        return out, engine.block_manager.usage().get("prefix_hit_tokens", 0)

    (cached, hits), (plain, _) = exports(True), exports(False)
    assert hits == 192
    # The rows of the shared positions come from the first prompt's pages: bf16 noise at most (a wrong page would
    # be off by O(1); measured 0). The second prompt's own rows (positions >= 192) attend to the stored prefix in
    # the cached engine and to the step's own rows in the uncached one (other kernels; with fp8 pages rounded vs
    # unrounded K/V), so they differ from layer 1 on; layer 0's are attention-free. H200, 2026-12-04, by layer 0-3:
    # bf16 pages 0 / 0 / 0.012 / 0.022, fp8 pages 0 / 0.16 / 0.29 / 0.26 (fp8's rounding of the prefix flips
    # near-tie top-4 routings of this random 8-expert model, which moves a token's hidden state by O(1) there).
    deep_limit = 0.05 if kv_cache_dtype == "auto" else 0.5
    n = gpu_model.config.num_hidden_layers
    tails = []
    for rid in plain:
        first = [plain[rid].sliding_start if s else 0 for s in plain[rid].layer_is_sliding] * 2
        for i, (a, b, start) in enumerate(zip([*cached[rid].k, *cached[rid].v], [*plain[rid].k, *plain[rid].v], first)):
            a, b = a.float(), b.float()
            assert a.shape == b.shape
            cut = max(0, 192 - start)  # rows before it hold shared positions
            shared = ((a[:cut] - b[:cut]).norm() / b[:cut].norm()).item()
            assert shared <= 0.02, (rid, "shared rows", i % n, shared)
            tails.append((rid, "kv"[i // n], i % n, round(((a[cut:] - b[cut:]).norm() / b[cut:].norm()).item(), 4)))
    print(f"prefix cache, {kv_cache_dtype} pages: relative difference of the prompts' own rows by (request, k/v, "
          f"layer): {tails}")
    assert all(rel <= (0.02 if layer == 0 else deep_limit) for *_, layer, rel in tails), tails
    assert all(rel == 0 for rid, *_, rel in tails if rid == "x0"), tails  # no hit: the same computation


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_host_tier_returns_evicted_blocks_byte_for_byte(gpu_model, kv_cache_dtype):
    """The prefix cache's host tier on the GPU (pinned host memory, the page-copy kernel both ways): a prompt's
    12 cached blocks, evicted by three others through a 20-page pool, come back from the host when it is sent
    again; its exported K/V at those positions is the first run's, byte for byte."""
    gen = torch.Generator().manual_seed(78)
    first, *others = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (195, 200, 201, 202)]
    config = EngineConfig(device="cuda", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                          num_full_pages=20, num_sliding_pages=20, kv_cache_dtype=kv_cache_dtype,
                          enable_prefix_caching=True, host_kv_cache_bytes=64 << 20)
    engine = LLMEngine(gpu_model, config)
    out = {}
    try:
        for i, p in enumerate([first, *others, first]):
            engine.add_request(GenerateRequest(f"h{i}", p, SamplingParams(temperature=0.0, max_tokens=2)),
                               prefill_only=True)
            run_to_end(engine, engine.step_prefill)
            out[i] = engine.export_kv(f"h{i}")
        usage = engine.block_manager.usage()
    finally:
        engine.close()
    assert usage["host_hit_tokens"] == 192 and usage["host_pages_loaded"] >= 12, usage
    a, b = out[0], out[4]
    assert a.sliding_start == b.sliding_start and a.num_cached == b.num_cached
    for x, y, sliding in zip([*a.k, *a.v], [*b.k, *b.v], a.layer_is_sliding * 2):
        cut = 192 - (a.sliding_start if sliding else 0)  # rows of positions < 192
        assert torch.equal(x[:cut].view(torch.uint8), y[:cut].view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefill_graphs_replay_what_their_pieces_do_eagerly(gpu_model, kv_cache_dtype):
    """Piecewise prefill graphs (engine/prefill_graphs.py) on prompt chunks and a mixed step: the replay
    equals the same padded pieces launched eagerly, bit for bit (hidden states and the K/V written), and
    stays within bf16 noise of the unpadded forward."""
    from engine.block_manager import BlockManager
    from engine.prefill_graphs import PrefillGraphs
    from engine.runner import ModelRunner
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    cfg = gpu_model.config
    runner = ModelRunner(gpu_model, BS, kv_cache_dtype)
    runner.allocate_kv_cache(256, 128)
    bm = BlockManager(BS, cfg.sliding_window, 256, 128)
    pieces = PrefillGraphs(gpu_model, [16, 64, 256, 512])
    seconds = pieces.capture()
    assert sorted(seconds) == [16, 64, 256, 512] and all(s > 0 for s in seconds.values())
    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (200, 420, 9)]
    seqs = [Sequence(f"s{i}", p, SamplingParams(), 0, i) for i, p in enumerate(prompts)]
    for step in ([(0, 200)], [(1, 300), (0, 1)], [(1, 120), (2, 9), (0, 1)], [(0, 1), (1, 1), (2, 1)]):
        scheduled = []
        for i, n in step:
            seqs[i].output_ids += [] if seqs[i].num_computed + n <= seqs[i].num_tokens else [3]
            bm.allocate(seqs[i], seqs[i].num_computed + n)
            scheduled.append(ScheduledSeq(seqs[i], seqs[i].num_computed, n, is_prefill=n > 1))
        inputs = runner.prepare(scheduled)
        gpu_model.backend.bind_cache(runner.kv_cache)
        plain = gpu_model(inputs.input_ids, inputs.positions, inputs.attention).float()
        graphed = pieces.run(inputs.input_ids, inputs.positions, inputs.attention).clone()
        cache = [t.clone() for t in (*runner.kv_cache.k, *runner.kv_cache.v)]
        eager = pieces.run_eager(inputs.input_ids, inputs.positions, inputs.attention)
        t = inputs.input_ids.numel()
        assert torch.isfinite(graphed).all()
        assert torch.equal(graphed, eager), f"{t} tokens: max diff {(graphed - eager).abs().max().item()}"
        assert all(torch.equal(a, b) for a, b in zip(cache, (*runner.kv_cache.k, *runner.kv_cache.v)))
        rel = ((graphed.float() - plain).norm() / plain.norm()).item()
        print(f"{t} tokens in bucket {pieces.bucket_for(t)}: padded graphs vs the plain forward rel diff {rel:.2e}")
        assert rel < 0.05, f"{t} tokens: the padded graphs drift from the plain forward (rel {rel:.3f})"
        for s in scheduled:
            s.seq.num_computed = s.end
            bm.release_out_of_window(s.seq)
    assert pieces.replays == 4
    runner.close()


def test_jump_forward_rows_compute_what_a_recompute_does(gpu_model):
    # Jump-forward (a constraint's forced tokens as rows of one decode step) through the captured graphs: every
    # forced position holds its forced id, and every output token's logprob agrees with a full recompute of the
    # same text on the same kernels as plain one-token steps do (a forced row reading wrong pages or positions
    # would be off by nats); the forced tokens did run as drafts, in fewer steps.
    from tests.engine.test_jump_forward import ForcingSpec

    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 140)]
    runs, steps = {}, {}
    for jump in (0, 8):
        llm = LLMEngine(gpu_model, EngineConfig(device="cuda", max_num_seqs=16, max_num_batched_tokens=256,
                                                max_model_len=1024, num_full_pages=128, num_sliding_pages=96,
                                                cuda_graphs=True, jump_forward_tokens=jump))
        reqs = [GenerateRequest(f"j{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0,
                                                           constraint=ForcingSpec(period=5, offset=i)))
                for i, p in enumerate(prompts)]
        runs[jump] = llm.generate(reqs)
        snap = llm.metrics.snapshot()
        steps[jump] = snap["steps_by_path_total"].get("decode_graph", 0)
        if jump:
            assert snap["jump_forward_tokens_total"] >= 20, snap
    assert steps[8] < steps[0], steps
    for i, (p, out) in enumerate(zip(prompts, runs[8])):
        forcing = ForcingSpec(period=5, offset=i).start(2048)
        tokens = out.output_ids
        assert all(t == forcing.forced_id(k) for k, t in enumerate(tokens) if forcing.forced_id(k) is not None)
        recompute = gpu_model.full_logits(p + tokens[:-1]).float()[len(p) - 1:].log_softmax(-1)
        diffs = sorted(abs(lp.logprob - recompute[j, t].item()) for j, (lp, t) in enumerate(zip(out.logprobs, tokens)))
        assert diffs[len(diffs) // 2] < 0.5, (out.request_id, diffs)
