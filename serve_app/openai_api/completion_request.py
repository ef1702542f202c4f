"""The request body of POST /v1/completions (legacy, raw text; serve_app/openai_api/completions.py serves it)."""

from __future__ import annotations

from typing import Union

from pydantic import Field, ValidationInfo, field_validator

from serve_app.openai_api.protocol import SamplingBase, TextOutputFields, reject_unless

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each times n becomes an engine request)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint

Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingBase, TextOutputFields):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Prompt) -> Prompt:
        if isinstance(value, str):
            value = [value]
        if not value:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists; "
                             "got an empty list")
        if isinstance(value[0], int):
            value = [value]
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"takes up to {MAX_PROMPTS} prompts per request, got {len(value)}")
        if any(len(p) == 0 for p in value):
            raise ValueError("prompts must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        return reject_unless(value, (None, ""), "suffix (insertion) is not supported by gpt-oss; leave it out")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value not in (None, 1, info.data.get("n") or 1):
            raise ValueError("is only supported equal to n (the server returns every completion it runs)")
        return value
