"""Compile a replica's Triton kernels in parallel, while it loads its weights, before graph capture needs them.

A new engine's CUDA-graph capture and warm-up compile every Triton specialization they launch: for 20b at
the Serve defaults 108, most of a 54.6 s engine build on the H200 over an empty cache, one after another on one
core (bench/results/triton_precompile_probe_20b_h200.json; 11.9 s with them and their launchers precompiled on
16 cores, ..._shipped_launchers_h200.json). Nothing in a compile needs the GPU: Triton compiles for a
`GPUTarget` and keeps the result in its on-disk cache, keyed by the kernel's source, its specialization
(argument types, divisibility, constexprs), the compile options and the compiler itself.

- `record(specs)`: while it is active, every specialization this process compiles (or loads from the disk
  cache) is appended to `specs`, in Triton's own serialized form (bench/triton_precompile_probe.py records
  a manifest on the GPU: engine build and warm-up at the Serve defaults).
- A manifest (`engine/triton_manifests/*.json`) holds those specializations and the shapes they were recorded
  for: model dimensions, tp_size, ep_size, GPU arch.
- `start_for(model_config, engine_config, parallel)`: if a manifest matches, compile its specializations in a
  separate process (`python -m engine.triton_precompile`, a pool of forked workers, no CUDA context) into
  this process's Triton cache, while the caller loads weights; `wait_for(model)` before the first capture.
  The capture then loads each kernel from the disk cache instead of compiling it. A specialization the
  manifest lacks (another config, changed kernel arguments) is compiled at capture as before; one that no
  longer applies costs a worker a compile and nothing else: the manifest only warms a cache.

Where kernels change, the manifest's entries still compile their new source (the cache key hashes the source
at compile time); entries whose kernel lost or renamed arguments are skipped and counted as failed
(tests/engine/test_triton_precompile.py checks the shipped manifests against the kernels).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST_DIR = Path(__file__).parent / "triton_manifests"
# More folders to look in first (os.pathsep-separated): manifests recorded for other configs or GPUs.
MANIFEST_PATH_ENV = "GPTOSS_TRITON_MANIFESTS"
# The model dimensions a kernel's specializations depend on (grids, constexpr block counts, strides).
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok", "head_dim",
                "num_attention_heads", "num_key_value_heads", "sliding_window", "vocab_size")
WAIT_TIMEOUT_S = 180.0
_ATTR = "_triton_precompile"  # the handle rides on the model from its build to its first capture


def shapes_of(model_config) -> dict:
    return {name: getattr(model_config, name) for name in SHAPE_FIELDS}


@dataclass
class Manifest:
    shapes: dict
    tp_size: int
    ep_size: int
    arch: int  # compute capability, major * 10 + minor (H200: 90)
    specializations: list[dict]  # Triton's serialize_specialization_data, parsed
    recorded: dict  # where and how: date, triton version, engine configs (documentation)
    path: Path | None = None

    def matches(self, model_config, tp_size: int, ep_size: int, arch: int) -> bool:
        return (self.shapes == shapes_of(model_config) and (self.tp_size, self.ep_size) == (tp_size, ep_size)
                and self.arch == arch)

    def save(self, path: str | Path) -> None:
        """JSON with one specialization per line (reviewable diffs when a manifest is recorded again)."""
        head = {"shapes": self.shapes, "tp_size": self.tp_size, "ep_size": self.ep_size, "arch": self.arch,
                "recorded": self.recorded}
        lines = [json.dumps(head, sort_keys=True)[:-1] + ', "specializations": [']
        lines += [json.dumps(s, sort_keys=True) + ("," if i < len(self.specializations) - 1 else "")
                  for i, s in enumerate(self.specializations)]
        Path(path).write_text("\n".join(lines) + "\n]}\n")

    @staticmethod
    def load(path: str | Path) -> "Manifest":
        body = json.loads(Path(path).read_text())
        return Manifest(body["shapes"], body["tp_size"], body["ep_size"], body["arch"], body["specializations"],
                        body.get("recorded", {}), Path(path))


def unique(specs: list[str]) -> list[dict]:
    """Recorded specializations (JSON strings), parsed, duplicates dropped, in a stable order."""
    seen = {}
    for s in specs:
        spec = json.loads(s)
        spec.pop("key", None)  # the in-memory cache key: not needed to compile, and long
        spec.pop("target", None)  # newer Triton records it; the manifest's arch says it once
        # the recording machine's libdevice path: left out, the backend fills in the compiling machine's (the
        # cache key hashes the file's content, not its path)
        spec["options"].pop("extern_libs", None)
        seen.setdefault(json.dumps(spec, sort_keys=True), spec)
    return [seen[k] for k in sorted(seen)]


def manifest_dirs() -> list[Path]:
    extra = [Path(d) for d in os.environ.get(MANIFEST_PATH_ENV, "").split(os.pathsep) if d]
    return extra + [MANIFEST_DIR]


def find_manifest(model_config, tp_size: int, ep_size: int, arch: int,
                  folders: list[Path] | None = None) -> Manifest | None:
    """The first manifest recorded for these shapes, split and arch ($GPTOSS_TRITON_MANIFESTS first)."""
    for folder in folders if folders is not None else manifest_dirs():
        for path in sorted(Path(folder).glob("*.json")):
            try:
                manifest = Manifest.load(path)
            except (OSError, ValueError, KeyError, TypeError) as err:  # a broken file is skipped, not fatal
                log.warning("Triton manifest %s unreadable (%s: %s): skipped", path, type(err).__name__, err)
                continue
            if manifest.matches(model_config, tp_size, ep_size, arch):
                return manifest
    return None


# ---- recording ------------------------------------------------------------------------------------------------


class record:
    """`with record(specs):` appends each specialization this process compiles or loads from the disk cache
    (Triton's jit_post_compile_hook; one already in a kernel's in-memory cache does not come back)."""

    def __init__(self, specs: list[str]):
        self.specs = specs

    def __enter__(self):
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.specs.append(kwargs["compile"]["specialization_data"])
            return self._previous(*args, **kwargs) if self._previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        return self.specs

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._previous


# ---- compiling (in the worker processes) ----------------------------------------------------------------------


def resolve_kernel(name: str):
    """'package.module.kernel_name' -> the JITFunction (under any autotune / heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    module, _, attr = name.rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{name} is not a Triton kernel")
    return obj


def _constant(value):
    import triton.language as tl

    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(value["constexpr"])
    if isinstance(value, dict) and "jit_function" in value:
        module, _, qualname = value["jit_function"].partition(":")
        return resolve_kernel(f"{module}.{qualname}")
    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    return value


def source_and_options(spec: dict):
    """(ASTSource, options) of a manifest entry, built as Triton's JITFunction.preload builds them, so the
    compile's cache key is the one the kernel's launch computes."""
    from triton.compiler import ASTSource

    fn = resolve_kernel(spec["name"])
    missing = set(spec["signature"]) - set(fn.arg_names)
    if missing or len(spec["signature"]) != len(fn.arg_names):
        raise ValueError(f"{spec['name']}: the manifest's arguments {sorted(spec['signature'])} are not the kernel's "
                         f"{fn.arg_names}")
    constexprs = {tuple(k): _constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    # in the kernel's argument order, as a launch builds it (the file keeps keys sorted)
    signature = {k: tuple(v) if isinstance(v, list) else v
                 for k, v in sorted(spec["signature"].items(), key=lambda kv: fn.arg_names.index(kv[0]))}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    return ASTSource(fn, signature, constexprs, attrs), options


def constexpr_values(spec: dict) -> dict:
    """A manifest entry's constexprs by argument name, as the file stores them."""
    names = resolve_kernel(spec["name"]).arg_names
    return {names[k[0]]: v for k, v in zip(spec["constant_keys"], spec["constant_vals"])}


def compile_spec(spec: dict, arch: int):
    """Compile one entry for sm_<arch> (into Triton's cache; no GPU needed): (ASTSource, the compiled kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, options = source_and_options(spec)
    return src, triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_one(spec: dict, arch: int) -> tuple[str, float, str | None, str | None]:
    """Compile one entry into Triton's cache, and its launcher: (kernel name, seconds, error or None, the
    launcher's error or None)."""
    start = time.perf_counter()
    try:
        src, kernel = compile_spec(spec, arch)
    except Exception as err:  # noqa: BLE001 - a failed entry is reported, the others go on
        return spec["name"], time.perf_counter() - start, f"{type(err).__name__}: {err}"[:500], None
    return spec["name"], time.perf_counter() - start, None, build_launcher(src, kernel)


def build_launcher(src, kernel) -> str | None:
    """Build the kernel's host-side launcher into Triton's cache as its first launch would (a C extension per
    argument signature, compiled with the host's C compiler: ~0.3-1 s each, serially at capture otherwise).
    Needs the CUDA driver library (not a GPU); its error, or None."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(src, kernel.metadata)
        return None
    except Exception as err:  # noqa: BLE001 - a launcher left out is built at first launch, as without this
        return f"{type(err).__name__}: {err}"[:300]


def compile_all(specs: list[dict], arch: int, workers: int) -> dict:
    """Compile `specs` in `workers` forked processes; a report of what compiled and what failed."""
    import multiprocessing

    start = time.perf_counter()
    for name in sorted({s["name"].rpartition(".")[0] for s in specs}):  # import once, before forking
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the entry's own compile reports it
            pass
    if workers <= 1:
        results = [compile_one(s, arch) for s in specs]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(compile_one, specs, [arch] * len(specs)))
    failed = [{"kernel": n, "error": e} for n, _, e, _ in results if e is not None]
    no_launcher = [le for _, _, e, le in results if e is None and le is not None]
    return {"specializations": len(specs), "compiled": len(specs) - len(failed), "failed": failed,
            "launchers": len(specs) - len(failed) - len(no_launcher),
            "launcher_error": no_launcher[0] if no_launcher else None,
            "workers": workers, "seconds": time.perf_counter() - start,
            "compile_seconds_sum": sum(s for _, s, _, _ in results)}


def default_workers(count: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(count, cpus, 32))


# ---- the engine's side ----------------------------------------------------------------------------------------


class Precompile:
    """A running precompile process (`python -m engine.triton_precompile`) over one manifest."""

    def __init__(self, manifest: Manifest, arch: int, workers: int | None = None):
        self.manifest = manifest
        self.started = time.perf_counter()
        self._dir = tempfile.TemporaryDirectory(prefix="triton_precompile_")
        spec_path = manifest.path
        if spec_path is None:  # a manifest made in memory (tests): the process reads a file
            spec_path = Path(self._dir.name) / "manifest.json"
            manifest.save(spec_path)
        self._report_path = Path(self._dir.name) / "report.json"
        workers = workers or default_workers(len(manifest.specializations))
        # No GPU in the workers: compiling needs none, and a CUDA context per worker would cost GPU memory.
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, "-m", "engine.triton_precompile", str(spec_path), "--arch", str(arch),
               "--workers", str(workers), "--report", str(self._report_path)]
        self._log = open(Path(self._dir.name) / "log.txt", "w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True)

    def _stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait()

    def cancel(self) -> None:
        """Stop the compiles (the model they were for failed to build)."""
        self._stop()
        self._log.close()
        self._dir.cleanup()

    def wait(self, timeout: float = WAIT_TIMEOUT_S) -> dict:
        """Block until the compiles are done (at most `timeout` s: then stop them); the report."""
        try:
            rc = self.proc.wait(timeout=max(0.0, timeout - (time.perf_counter() - self.started)))
        except subprocess.TimeoutExpired:
            self._stop()
            rc = "timeout"
        report = json.loads(self._report_path.read_text()) if self._report_path.exists() else {}
        self._log.seek(0)
        tail = self._log.read()[-2000:]
        self._log.close()
        self._dir.cleanup()
        report.update(exit=rc, waited_s=time.perf_counter() - self.started,
                      manifest=self.manifest.path.name if self.manifest.path else None)
        if rc != 0:
            report["log_tail"] = tail
        return report


def start_for(model_config, engine_config, parallel=None) -> Precompile | None:
    """Start compiling the kernels a manifest lists for this model, split and GPU; None where none applies
    (CPU, triton_precompile off, no matching manifest) or where it could not start (logged: the capture then
    compiles, as without it)."""
    if not getattr(engine_config, "triton_precompile", False) or not str(engine_config.device).startswith("cuda"):
        return None
    try:
        return _start_for(model_config, engine_config, parallel)
    except Exception as err:  # noqa: BLE001 - a cache warmer must never stop a replica from starting
        log.warning("Triton precompile not started (%s: %s): kernels compile at capture", type(err).__name__, err)
        return None


def _start_for(model_config, engine_config, parallel) -> Precompile | None:
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(engine_config.device))
    tp = parallel.tp_size if parallel is not None else engine_config.tp_size
    ep = parallel.ep_size if parallel is not None else engine_config.ep_size
    manifest = find_manifest(model_config, tp, ep, 10 * major + minor)
    if manifest is None:
        log.info("no Triton manifest for these shapes (tp=%d, ep=%d, sm%d%d): kernels compile at capture", tp, ep,
                 major, minor)
        return None
    # The ranks of a split share the node's CPUs (and its cache: a kernel one rank compiled, the others load).
    world = getattr(parallel, "world_size", 1) if parallel is not None else 1
    workers = max(1, default_workers(len(manifest.specializations)) // max(1, world))
    return Precompile(manifest, 10 * major + minor, workers)


def attach(model, precompile: Precompile | None):
    if precompile is not None:
        setattr(model, _ATTR, precompile)
    return model


def wait_for(model) -> dict | None:
    """Wait for the precompile started with `model`'s build, if any; its report (logged)."""
    precompile = getattr(model, _ATTR, None)
    if precompile is None:
        return None
    delattr(model, _ATTR)
    report = precompile.wait()
    log.info("Triton precompile (%s): %d of %d specializations in %.1f s on %s workers%s", report.get("manifest"),
             report.get("compiled", 0), report.get("specializations", 0), report.get("seconds", float("nan")),
             report.get("workers"), f", exit {report['exit']}" if report["exit"] != 0 else "")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Compile a Triton manifest's kernels into the Triton cache "
                                            "(TRITON_CACHE_DIR); no GPU needed.")
    p.add_argument("manifest", help="a manifest file (engine/triton_manifests/*.json)")
    p.add_argument("--arch", type=int, help="compute capability x10 (default: the manifest's)")
    p.add_argument("--workers", type=int, help="processes (default: the CPUs this process may use, at most 32)")
    p.add_argument("--report", help="write the report here as JSON")
    args = p.parse_args(argv)
    manifest = Manifest.load(args.manifest)
    specs = manifest.specializations
    report = compile_all(specs, args.arch or manifest.arch, args.workers or default_workers(len(specs)))
    if args.report:
        Path(args.report).write_text(json.dumps(report))
    print(f"compiled {report['compiled']} of {report['specializations']} ({report['launchers']} with their launchers) "
          f"in {report['seconds']:.1f} s ({report['workers']} workers, {report['compile_seconds_sum']:.1f} s of compiling)")
    if report["launcher_error"]:
        print(f"launchers left to the first launch: {report['launcher_error']}")
    for f in report["failed"]:
        print(f"failed: {f['kernel']}: {f['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
