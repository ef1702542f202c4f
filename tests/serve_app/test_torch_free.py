"""The ingress must not import torch: it runs on CPU-only proxy nodes and starts fast."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "serve_app.harmony.encoding", "serve_app.harmony.render", "serve_app.harmony.parse", "serve_app.harmony.constrain",
    "serve_app.openai_api.protocol", "serve_app.openai_api.errors", "serve_app.openai_api.streaming",
    "serve_app.openai_api.generation", "serve_app.openai_api.chat", "serve_app.openai_api.responses",
    "serve_app.openai_api.responses_input", "serve_app.openai_api.background", "serve_app.openai_api.model_router",
    "serve_app.openai_api.app", "serve_app.prefix_router", "tests.serve_app.stub_backend",
]


def test_ingress_modules_do_not_import_torch():
    code = "\n".join([f"import {m}" for m in MODULES] + [
        "import sys",
        "from serve_app.openai_api.app import create_app",
        "from tests.serve_app.stub_backend import ScriptedBackend",
        "create_app(ScriptedBackend(), max_context=1024)",
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))",
        "assert not loaded, loaded",
        "print('ok')",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
