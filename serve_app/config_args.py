"""`serve run` arguments (`key=value` strings, dotted keys for nested settings) -> the nested mapping that
serve_app/config.py's pydantic model validates."""

from __future__ import annotations

import json
from typing import Any


class ServeConfigError(ValueError):
    """Application arguments that cannot be parsed or do not fit together; the message names the key."""


def nest_args(args: dict[str, Any]) -> dict[str, Any]:
    """`{"decode.autoscaling.max_replicas": "4", "tp_size": "2"}` -> `{"decode": {"autoscaling":
    {"max_replicas": 4}}, "tp_size": 2}`. String values that parse as JSON become that JSON value,
    except where the target is a plain string (model paths, names) and would not round-trip."""
    out: dict[str, Any] = {}
    # Whole sub-models first, so a dotted key can override one field of a JSON object.
    for key in sorted(args, key=lambda k: k.count(".")):
        parts = key.split(".")
        value = args[key] if parts[-1] in _STRING_FIELDS and isinstance(args[key], str) else _coerce(args[key])
        if not all(parts):
            raise ServeConfigError(f"argument {key!r}: empty part in a dotted key")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ServeConfigError(f"argument {key!r}: {'.'.join(parts[:depth + 1])} is not a nested "
                                       "setting, so it cannot take a dotted sub-key")
            node = child
        last = parts[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = deep_merge(node[last], value)
        else:
            node[last] = value
    return out


# Free-form strings: `served_model_name=123` stays "123", a path stays a path.
_STRING_FIELDS = {"model", "served_model_name"}


def _coerce(value: Any) -> Any:
    if isinstance(value, dict):
        return nest_args(value)  # YAML mappings may themselves use dotted keys
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text in ("None", "null", "none"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return value  # a plain string: a path, a name, `cuda`


def deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
