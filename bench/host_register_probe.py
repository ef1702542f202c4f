"""What a large host K/V tier costs at replica start, by how its memory is made: seconds to allocate, fault in
and register (cudaHostRegister, portable + mapped) a host buffer, for ways of getting the pages.

    python -m bench.host_register_probe --gib 8 --out bench/results/host_register_probe.json   (GPU host)

Variants: `empty` (torch.empty, then registration faults every 4 kB page in: what kv_cache.RegisteredHostBuffer
does), `zero` (torch.empty, then zero_() on torch's threads faults the pages in parallel before registering),
`hugepage` (an anonymous mmap advised MADV_HUGEPAGE, so the kernel backs it with 2 MB pages where transparent
huge pages allow, then zeroed on torch's threads and registered), `cuda_host_alloc` (torch's pinned allocator,
for reference: it may round up to a power of two). Every buffer is checked usable: a GPU copy into it and back.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from pathlib import Path

import torch


def _register(t: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 3))
    if error:
        raise RuntimeError(f"cudaHostRegister failed: cudaError {error}")


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _check(t: torch.Tensor) -> bool:
    n = min(t.numel(), 64 * 2**20)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    t[-n:].copy_(src, non_blocking=True)
    back = t[-n:].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return bool(torch.equal(src, back))


def variant(name: str, nbytes: int) -> dict:
    times, keep = {}, None
    t0 = time.perf_counter()
    if name == "cuda_host_alloc":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        times["allocate_s"] = time.perf_counter() - t0
        times["fault_s"] = times["register_s"] = 0.0
    else:
        if name == "hugepage":
            keep = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            keep.madvise(mmap.MADV_HUGEPAGE)
            t = torch.frombuffer(keep, dtype=torch.uint8)
        else:
            t = torch.empty(nbytes, dtype=torch.uint8)
        times["allocate_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if name in ("zero", "hugepage"):
            t.zero_()
        times["fault_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        _register(t)
        times["register_s"] = time.perf_counter() - t1
    total = time.perf_counter() - t0
    ok = _check(t)
    t1 = time.perf_counter()
    if name != "cuda_host_alloc":
        _unregister(t)
    del t
    if keep is not None:
        keep.close()
    release = time.perf_counter() - t1
    return {"variant": name, "gib": nbytes / 2**30, **times, "total_s": total, "GB_per_s": nbytes / total / 1e9,
            "release_s": release, "usable": ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", default="8", help="sizes, comma-separated")
    p.add_argument("--variants", default="empty,zero,hugepage,cuda_host_alloc")
    p.add_argument("--out", default="bench/results/host_register_probe.json")
    args = p.parse_args(argv)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch_threads": torch.get_num_threads(), "thp": thp.read_text().strip() if thp.exists() else None,
              "runs": []}
    print(f"torch threads {record['torch_threads']}, transparent huge pages: {record['thp']}")
    print(f"{'variant':>16s} {'GiB':>5s} {'alloc s':>8s} {'fault s':>8s} {'register s':>10s} {'total s':>8s} "
          f"{'GB/s':>6s} {'release s':>9s} usable")
    for gib in [float(x) for x in args.gib.split(",")]:
        for name in args.variants.split(","):
            r = variant(name, int(gib * 2**30))
            record["runs"].append(r)
            print(f"{name:>16s} {gib:5g} {r['allocate_s']:8.2f} {r['fault_s']:8.2f} {r['register_s']:10.2f} "
                  f"{r['total_s']:8.2f} {r['GB_per_s']:6.1f} {r['release_s']:9.2f} {r['usable']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0 if all(r["usable"] for r in record["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
