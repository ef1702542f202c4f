"""`gptoss`: make a tiny checkpoint, or generate from a checkpoint with the engine (no Ray).

    gptoss make-tiny DIR [--vocab 1000 --layers 2 ...]
    gptoss generate [MODEL_DIR] --prompt-ids 1,2,3 --prompt-ids 4,5 --prompt "Hi" --json
    gptoss generate [MODEL_DIR] --tp 2 --ep 2 ...   (one process per rank: this one is rank 0)
    gptoss run-batch IN.jsonl OUT.jsonl [MODEL_DIR]  (an OpenAI Batch API file: serve_app/run_batch.py)

All prompts of one `generate` run as one continuous batch; output comes back in input order (the
order the --prompt-ids / --prompt / --prompts-jsonl flags appear, a JSONL file's lines in place).
Without MODEL_DIR the embedded tiny model is used, created on first use under
$GPTOSS_CACHE_DIR/tiny (default ~/.cache/gptoss/tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


class CliError(ValueError):
    """A command-line input the CLI cannot use; the message says which and why."""


# ---- prompts ----------------------------------------------------------------------------------------
class _Ordered(argparse.Action):
    """Collects --prompt-ids / --prompt / --prompts-jsonl into one list, keeping their order."""

    def __call__(self, parser, namespace, value, option_string=None):
        items = getattr(namespace, self.dest) or []
        items.append((option_string, value))
        setattr(namespace, self.dest, items)


def _parse_ids(text: str, where: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CliError(f"{where}: expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise CliError(f"{where}: no token ids")
    return ids


def render_user_prompt(text: str) -> list[int]:
    """A Harmony conversation (default system message + this user turn), ready for the assistant."""
    from openai_harmony import Conversation, Message, Role, SystemContent

    from serve_app.harmony.encoding import load_harmony_encoding

    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
        Message.from_role_and_content(Role.USER, text),
    ])
    return list(load_harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT))


def _jsonl_prompts(path: str) -> list[list[int]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise CliError(f"--prompts-jsonl {path}: {exc.strerror}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: not JSON ({exc.msg})") from None
        if isinstance(item, dict) and "prompt_ids" in item:
            item = item["prompt_ids"]
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(render_user_prompt(item["prompt"]))
            continue
        if not (isinstance(item, list) and item and all(isinstance(t, int) for t in item)):
            raise CliError(f'{where}: expected a list of token ids, {{"prompt_ids": [...]}} or {{"prompt": "text"}}')
        prompts.append(item)
    return prompts


def collect_prompts(items: list[tuple[str, str]]) -> list[list[int]]:
    prompts: list[list[int]] = []
    for flag, value in items:
        if flag == "--prompt-ids":
            prompts.append(_parse_ids(value, "--prompt-ids"))
        elif flag == "--prompt":
            prompts.append(render_user_prompt(value))
        else:
            prompts.extend(_jsonl_prompts(value))
    if not prompts:
        raise CliError("no prompt: give --prompt-ids, --prompt or --prompts-jsonl")
    return prompts


# ---- the embedded model -------------------------------------------------------------------------------
def default_model_dir() -> Path:
    base = os.environ.get("GPTOSS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gptoss")
    return Path(base) / "tiny"


def ensure_tiny_model(folder: Path) -> Path:
    """Create the default tiny checkpoint once; concurrent first uses each build one and keep the first."""
    if (folder / "config.json").exists():
        return folder
    from model.tiny import make_tiny

    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    make_tiny(tmp)
    try:
        tmp.rename(folder)  # atomic; fails if another process got there first
        print(f"created the embedded tiny model in {folder}", file=sys.stderr)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():  # not a lost race: a real failure
            raise
    return folder


# ---- commands -----------------------------------------------------------------------------------------
def cmd_make_tiny(args) -> int:
    from model.tiny import make_tiny

    overrides = {"num_hidden_layers": args.layers, "num_local_experts": args.experts, "vocab_size": args.vocab,
                 "sliding_window": args.sliding_window}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.experts is not None:
        overrides["num_experts_per_tok"] = min(2, args.experts)
    config = make_tiny(args.dir, mxfp4=args.mxfp4, seed=args.seed, dtype=args.dtype, **overrides)
    print(f"wrote {args.dir}: {config.num_hidden_layers} layers, {config.num_local_experts} experts, "
          f"vocab {config.vocab_size}, {config.num_params():,} parameters, {args.dtype}"
          + (", MXFP4 experts" if args.mxfp4 else ""))
    return 0


def cuda_graphs(args) -> bool:
    """--cuda-graphs auto: decode graphs on a CUDA device, on every rank (what the Serve replicas do)."""
    if args.cuda_graphs == "auto":
        return args.device.startswith("cuda")
    return args.cuda_graphs == "on"


def prediction_ids(args, encoding) -> tuple[int, ...]:
    """--prediction TEXT (Harmony special tokens allowed) or --prediction-ids: the output every prompt is
    expected to produce, as draft tokens for speculative decoding."""
    if args.prediction is not None and args.prediction_ids is not None:
        raise CliError("give --prediction or --prediction-ids, not both")
    if args.prediction_ids is not None:
        return tuple(_parse_ids(args.prediction_ids, "--prediction-ids"))
    return tuple(encoding.encode(args.prediction, allowed_special="all")) if args.prediction else ()


def engine_config_of(args, max_model_len: int | None, seed: int):
    """The EngineConfig of add_engine_arguments' options."""
    from engine.config import EngineConfig

    return EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                        kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None,
                        device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                        lm_head_dtype=args.lm_head_dtype, dense_dtype=args.dense_dtype, all_reduce=args.all_reduce,
                        mxfp4_decode_max_tokens=args.mxfp4_decode_max_tokens, decode_front=args.decode_front,
                        moe_segments_max_rows=args.moe_segments_max_rows,
                        enable_prefix_caching=args.prefix_caching,
                        host_kv_cache_bytes=args.host_kv_cache_mb * 2**20,
                        seed=seed, tp_size=args.tp,
                        ep_size=args.ep, dp_size=args.dp, cuda_graphs=cuda_graphs(args),
                        prefill_graphs={"auto": None, "on": True, "off": False}[args.prefill_graphs],
                        triton_precompile=args.triton_precompile == "on",
                        speculative_tokens=args.speculative_tokens, speculative_ngram=args.prompt_lookup)


def cmd_generate(args) -> int:
    from engine.llm_engine import LLMEngine
    from engine.request import GenerateRequest, SamplingParams
    from model.loader import read_config
    from serve_app.harmony.encoding import load_harmony_encoding

    prompts = collect_prompts(args.prompts or [])
    folder = Path(args.model_dir) if args.model_dir else ensure_tiny_model(default_model_dir())
    model_config = read_config(folder)
    encoding = load_harmony_encoding()
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                              logprobs=args.logprobs, prediction=prediction_ids(args, encoding))
    sampling.validate()  # before --max-tokens sizes the context below
    max_model_len = args.max_model_len or min(model_config.max_position_embeddings,
                                              max(map(len, prompts)) + args.max_tokens)
    config = engine_config_of(args, max_model_len, seed=args.seed or 0)
    engine = LLMEngine.from_checkpoint(folder, config)  # with --tp/--ep > 1: spawns ranks 1..N-1
    requests = [GenerateRequest(str(i), ids, sampling) for i, ids in enumerate(prompts)]
    try:
        completions = engine.generate(requests)
    finally:
        engine.close()
    for completion in completions:
        text = encoding.decode(completion.output_ids)
        if args.json:
            line = {"prompt_ids": completion.prompt_ids, "output_ids": completion.output_ids, "text": text,
                    "finish_reason": completion.finish_reason}
            if args.logprobs is not None:  # per output token: its logprob and the top N (id, logprob)
                line["logprobs"] = [{"logprob": lp.logprob, "top": lp.top} for lp in completion.logprobs]
            if completion.num_draft_tokens:
                line["draft_tokens"] = completion.num_draft_tokens
                line["accepted_draft_tokens"] = completion.num_accepted_draft_tokens
            print(json.dumps(line), flush=True)
        else:
            print(f"[{completion.request_id}] ({completion.finish_reason}, {len(completion.output_ids)} tokens) "
                  f"{text}", flush=True)
    return 0


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's options (engine_config_of reads them), shared by `generate` and `run-batch`."""
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, help="KV cache budget (default 256 MiB on CPU)")
    p.add_argument("--host-kv-cache-mb", type=int, default=0,
                   help="the prefix cache's host tier per rank: evicted cached blocks kept in host memory (0: off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3"),
                   help="K/V storage; fp8_e4m3 halves KV memory")
    p.add_argument("--lm-head-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="unembedding weights; fp8_e4m3 rounds them to FP8 at load (faster decode at small batches)")
    p.add_argument("--dense-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="QKV / O weights; fp8_e4m3 rounds them to FP8 at load and runs prompts' projections as FP8 "
                        "GEMMs (faster prefill; numerics then depend on a step's size)")
    p.add_argument("--mxfp4-decode-max-tokens", type=int, default=0, metavar="T",
                   help="decode steps of <= T tokens read the checkpoint's MXFP4 experts (CUDA kernel; keeps both "
                        "copies); 0: off")
    p.add_argument("--decode-front", default="auto", choices=("auto", "triton", "cuda"),
                   help="MoE front of single-token decode steps: cuda (one cluster kernel, built with nvcc), triton; "
                        "auto: cuda for routers of >= 128 experts on SM90+")
    p.add_argument("--moe-segments-max-rows", type=int, default=None, metavar="R",
                   help="steps of > 64 tokens whose experts average <= R rows on the segments GEMM (default: the "
                        "kernel's, 16; 0: DeepGEMM's grouped GEMM)")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"),
                   help="replay decode steps as CUDA graphs (auto: on a CUDA device, every rank)")
    p.add_argument("--prefill-graphs", default="auto", choices=("auto", "on", "off"),
                   help="prefill / mixed steps as piecewise CUDA graphs at token buckets, attention eager "
                        "(auto: with --cuda-graphs, every rank)")
    p.add_argument("--triton-precompile", default="on", choices=("on", "off"),
                   help="compile the Triton kernels of a shipped manifest for this model in worker processes while "
                        "the weights load (engine/triton_precompile.py; CUDA only)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: heads and vocabulary split")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (over the same ranks as --tp: each is 1 or the rank count)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel attention; only 1 is supported")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V of cached prompt prefixes (prompts sharing whole pages); on by default")
    p.add_argument("--speculative-tokens", type=int, default=4, help="draft tokens verified per step (0: off)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="also draft from the prompt and output (n-gram lookup), without a prediction")
    p.add_argument("--all-reduce", default="auto", choices=("auto", "nccl", "symm_mem"),
                   help="the ranks' sums; symm_mem: one-shot over symmetric memory for decode-sized tensors (CUDA); "
                        "auto: symm_mem where each rank sees every GPU of the group with peer access, else nccl")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptoss", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a deterministic random GPT-OSS checkpoint (HF layout)")
    tiny.add_argument("dir")
    tiny.add_argument("--mxfp4", action="store_true", help="store experts as MXFP4 blocks/scales")
    tiny.add_argument("--layers", type=int, help="hidden layers (default 4)")
    tiny.add_argument("--experts", type=int, help="experts per layer (default 4)")
    tiny.add_argument("--vocab", type=int, help="vocabulary size (default 201088, Harmony's)")
    tiny.add_argument("--sliding-window", type=int, help="window of the sliding layers (default 128)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    tiny.set_defaults(func=cmd_make_tiny)

    gen = sub.add_parser("generate", help="generate for one or more prompts as one continuous batch")
    gen.add_argument("model_dir", nargs="?", help="HF-layout checkpoint folder (default: the embedded tiny model)")
    gen.add_argument("--prompt-ids", dest="prompts", action=_Ordered, help="comma-separated token ids (repeatable)")
    gen.add_argument("--prompt", dest="prompts", action=_Ordered,
                     help="text, rendered as a Harmony user turn for the assistant (repeatable)")
    gen.add_argument("--prompts-jsonl", dest="prompts", action=_Ordered,
                     help='file of lines: [ids...], {"prompt_ids": [...]} or {"prompt": "text"}')
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, help="per-request sampling seed (every prompt uses it)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at Harmony's <|return|> / <|call|>")
    gen.add_argument("--logprobs", type=int, help="with --json: each output token's logprob and the top N (0-20)")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt, in input order")
    gen.add_argument("--max-model-len", type=int, help="default: longest prompt + max tokens")
    gen.add_argument("--prediction", help="expected output text (speculative decoding drafts; every prompt)")
    gen.add_argument("--prediction-ids", help="expected output as comma-separated token ids")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    from model.convert import add_convert_parser

    add_convert_parser(sub)  # gptoss convert SRC DST: pre-converted FP8 experts
    from serve_app.run_batch import add_run_batch_parser

    add_run_batch_parser(sub)  # gptoss run-batch IN OUT: an OpenAI Batch API file through the app, no Ray
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.config import EngineConfigError
    from engine.distributed.handles import WorkerFailedError
    from engine.llm_engine import StepFailedError
    from engine.request import InvalidRequestError
    from model.config import ConfigError
    from model.loader import CheckpointError

    try:
        return args.func(args)
    except (CliError, InvalidRequestError, EngineConfigError, ConfigError, CheckpointError) as exc:
        print(f"gptoss {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (WorkerFailedError, StepFailedError) as exc:  # a rank of a --tp/--ep run failed, or the model
        print(f"gptoss {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
