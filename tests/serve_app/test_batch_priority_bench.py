"""bench.batch_priority runs end to end on the CPU at a small size: four settings alternated, every batch completed,
every probe timed, its JSON and PNG written."""

from __future__ import annotations

import json
import sys

from bench import batch_priority


def test_the_bench_runs_small(tmp_path, monkeypatch):
    out = tmp_path / "batch_priority.json"
    monkeypatch.setattr(sys, "argv", ["batch_priority", "--lines", "6", "--batch-tokens", "8", "--batch-concurrency",
                                      "4", "--probes", "2", "--max-num-seqs", "2", "--warm-s", "0.2", "--out", str(out)])
    batch_priority.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_priority"] for r in rows] == [0, 1, 0, 1]
    for r in rows:
        assert r["batch_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert len(r["probe_ms"]) == len(r["probe_during_batch"]) == 2 and r["idle_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
