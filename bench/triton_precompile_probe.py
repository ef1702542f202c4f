"""A new node's first replica: engine build + warm-up over an empty Triton cache, with and without compiling the
kernels of a manifest in parallel first (engine/triton_precompile.py); records that manifest on the way.

Each phase runs in a fresh process over its own empty Triton cache (as a replica on a new node):
  record      the Serve app's default engine config for the model (random weights), built and warmed up while
              every Triton specialization is recorded -> --manifest-out (this is also the baseline: the hook
              only appends a string per compile);
  precompile  the same engine with triton_precompile on and that manifest: the build's time, the precompile's
              report, and how many kernels the engine process still compiled itself (Triton's compilation
              listener: cache misses), in the build and in the warm-up.
Both then decode one greedy prompt; the tokens must be the same (printed, and `same_tokens` in the JSON).
`--shipped`: the precompile phase alone, over the manifests in engine/triton_manifests (what a replica finds).

    python -m bench.triton_precompile_probe --model gpt-oss-20b --manifest-out engine/triton_manifests/gpt-oss-20b.json
    python -m bench.triton_precompile_probe --tiny --device cpu      (smoke run: CPU engines compile no Triton)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.child_run import run_child

PROMPT_TOKENS, OUTPUT_TOKENS = 200, 24


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class CompileCounter:
    """Triton's compilation listener: kernels compiled (cache misses) and loaded from the disk cache, by name."""

    def __init__(self):
        self.misses: list[str] = []
        self.hits = 0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            self.hits += 1
        else:
            self.misses.append(getattr(src, "name", "?"))

    def take(self) -> dict:
        out = {"compiled": len(self.misses), "from_cache": self.hits, "compiled_kernels": sorted(self.misses)}
        self.misses, self.hits = [], 0
        return out


def engine_config(device: str, kv_cache_gib: float, precompile: bool):
    """What `serve run serve_app:app model=random:<model> kv_cache_memory_gib=<kv_cache_gib>` gives a GPU decode
    replica (serve_app.config.ServeAppConfig.engine_config; the GPU host has no pydantic, so it is written out
    here, and tests/engine/test_triton_precompile.py checks the two agree)."""
    from engine.config import EngineConfig

    cuda = device.startswith("cuda")
    return EngineConfig(device=device, kv_cache_bytes=int(kv_cache_gib * 2**30), cuda_graphs=cuda,
                        async_decode=cuda, triton_precompile=precompile, priority_aging_s=30.0)


def child(args) -> None:
    from engine.llm_engine import LLMEngine
    from engine.request import GenerateRequest, SamplingParams
    from engine.warm_up import warm_up
    from model.config import GptOssConfig
    from model.tiny import tiny_config

    out = Path(args.child_out)
    record: dict = {"phase": args.phase}
    save = lambda: out.write_text(json.dumps(record))  # noqa: E731
    counter, specs = CompileCounter(), []
    cuda = args.device.startswith("cuda")
    if cuda:
        from triton import knobs

        knobs.compilation.listener = counter
    shapes = tiny_config() if args.model == "tiny" else GptOssConfig.preset(args.model)
    config = engine_config(args.device, args.kv_cache_gib, args.phase == "precompile")
    record["engine_config"] = {k: getattr(config, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                                "cuda_graphs", "prefill_graphs", "triton_precompile")}
    recording = contextlib.nullcontext()
    if args.phase == "record" and cuda:
        from engine.triton_precompile import record as record_specs

        recording = record_specs(specs)
    with recording:
        _say(f"{args.phase}: building the engine")
        t0 = time.perf_counter()
        engine = LLMEngine.with_random_weights(shapes, config, seed=config.seed)
        record.update(build_s=time.perf_counter() - t0, decode_capture_s=sum(engine.graph_capture_seconds.values()),
                      prefill_capture_s=sum(engine.prefill_graph_capture_seconds.values()),
                      precompile=engine.runner.triton_precompile_report, build_kernels=counter.take())
        save()
        _say(f"{args.phase}: built in {record['build_s']:.1f} s; compiled {record['build_kernels']['compiled']}, "
             f"from the cache {record['build_kernels']['from_cache']}; precompile {record['precompile']}")
        report = warm_up(engine)
        record.update(warm_up_s=report["seconds"], warm_up_kernels=counter.take())
        save()
        ids = [(7 * i + 3) % shapes.vocab_size for i in range(PROMPT_TOKENS)]
        done = engine.generate([GenerateRequest("probe", ids, SamplingParams(
            temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))])
        record["tokens"] = done[0].output_ids
    if specs:
        from engine.triton_precompile import Manifest, shapes_of, unique

        import torch
        import triton

        major, minor = torch.cuda.get_device_capability()
        manifest = Manifest(shapes_of(shapes), config.tp_size, config.ep_size, 10 * major + minor, unique(specs), {
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "triton": triton.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "by": "python -m bench.triton_precompile_probe",
            "engine_config": record["engine_config"], "covers": "engine build (decode + prefill graphs) and warm-up"})
        manifest.save(args.manifest_out)
        record["manifest"] = {"path": args.manifest_out, "specializations": len(manifest.specializations),
                              "recorded_compiles": len(specs)}
    save()
    _say(f"{args.phase}: warm-up {record['warm_up_s']:.2f} s, compiled {record['warm_up_kernels']['compiled']} more")
    engine.close()


def _child_run(phase: str, args, timeout: float, env_extra: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        out = f"{cache}.{phase}.json"
        env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", DG_JIT_CACHE_DIR=f"{cache}/deep_gemm", **env_extra)
        cmd = [sys.executable, "-m", "bench.triton_precompile_probe", "--phase", phase, "--child-out", out,
               "--model", args.model, "--device", args.device, "--kv-cache-gib", str(args.kv_cache_gib),
               "--manifest-out", args.manifest_out]
        record = run_child(cmd, env, out, timeout, {"phase": phase})
        Path(out).unlink(missing_ok=True)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--tiny", action="store_true", help="the tiny shapes (CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--manifest-out", help="where the recorded manifest goes (default: beside --out)")
    p.add_argument("--timeout-s", type=float, default=240, help="per phase")
    p.add_argument("--shipped", action="store_true",
                   help="no recording: only the precompile phase, over the shipped manifests")
    p.add_argument("--out", default="bench/results/triton_precompile_probe.json")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # set in the child processes
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.kv_cache_gib = "tiny", min(args.kv_cache_gib, 0.0625)
    args.manifest_out = args.manifest_out or str(Path(args.out).with_suffix(".manifest.json"))
    if args.phase:
        child(args)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": args.model, "device": args.device,
              "phases": []}
    env = {}
    if args.shipped:  # the manifests in engine/triton_manifests, as a replica finds them
        result["manifests"] = "shipped"
    else:
        result["phases"].append(_child_run("record", args, args.timeout_s, {}))
        out.write_text(json.dumps(result, indent=1))
        manifest_dir = tempfile.mkdtemp()  # only the new manifest, ahead of the shipped ones
        if Path(args.manifest_out).exists():
            Path(manifest_dir, "probe.json").write_text(Path(args.manifest_out).read_text())
        env = {"GPTOSS_TRITON_MANIFESTS": manifest_dir}
    result["phases"].append(_child_run("precompile", args, args.timeout_s, env))
    tokens = [r.get("tokens") for r in result["phases"]]
    result["same_tokens"] = len(tokens) == 2 and None not in tokens and tokens[0] == tokens[1]
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {out} and {args.manifest_out}")
    return 0 if all(r["exit"] == 0 for r in result["phases"]) else 1


def print_table(result: dict) -> None:
    print(f"{'phase':>10s} {'exit':>7s} {'build s':>8s} {'compiled':>9s} {'cached':>7s} {'precompile s':>12s} "
          f"{'specs':>6s} {'failed':>6s} {'warm-up s':>9s} {'+compiled':>9s}")
    for r in result["phases"]:
        pre = r.get("precompile") or {}
        bk, wk = r.get("build_kernels", {}), r.get("warm_up_kernels", {})
        print(f"{r['phase']:>10s} {str(r['exit']):>7s} {r.get('build_s', float('nan')):8.1f} "
              f"{bk.get('compiled', '-'):>9} {bk.get('from_cache', '-'):>7} {pre.get('seconds', float('nan')):12.1f} "
              f"{pre.get('specializations', '-'):>6} {len(pre.get('failed', [])) if pre else '-':>6} "
              f"{r.get('warm_up_s', float('nan')):9.2f} {wk.get('compiled', '-'):>9}")
    if len(result["phases"]) == 2:
        print(f"same greedy tokens: {result['same_tokens']}")
    for r in result["phases"]:
        for f in (r.get("precompile") or {}).get("failed", [])[:5]:
            print(f"{r['phase']}: precompile failed {f['kernel']}: {f['error'][:200]}")
        left = r.get("build_kernels", {}).get("compiled_kernels", [])
        if r["phase"] == "precompile" and left:
            print(f"precompile: the build still compiled {len(left)}: {', '.join(left)}")


if __name__ == "__main__":
    raise SystemExit(main())
