"""serve_app/engine_host.start_engine: a replica's engine is warmed up before it takes traffic (warm_up=true, the
default) and starts with zeroed counters either way."""

from __future__ import annotations

import pytest

from serve_app.config import ServeAppConfig
from serve_app.engine_host import start_engine


@pytest.mark.parametrize("warm", [True, False])
def test_replica_engines_warm_up_unless_told_not_to(warm):
    config = ServeAppConfig.from_args({"model": "random:tiny", "max_context": "256", "kv_cache_memory_gib": "0.0625",
                                       "max_num_seqs": "4", "warm_up": "true" if warm else "false"})
    hosted = start_engine(config, config.decode, "cpu")
    try:
        engine = hosted.engine
        snap = engine.metrics.snapshot()
        assert snap["requests_added_total"] == snap["steps_total"] == 0  # the warm-up is not traffic
        usage = engine.block_manager.usage()
        assert usage["full_pages_used"] == 0
        # its prompts' pages stay cached (evictable) where it ran; a cold engine has none
        assert (usage["full_pages_cached"] > 0) == warm, usage
    finally:
        hosted.shutdown()
        hosted.engine.close()
