"""What a request asks of its output, turned into engine terms: a forced tool call (`tool_choice`) and
structured output (`response_format`, `text.format`, strict tools) as the constraint its engine requests carry,
a `prediction` as draft tokens."""

from __future__ import annotations

import functools
from typing import Any

import anyio
from openai_harmony import HarmonyEncoding

from serve_app.harmony.constrain import (FORCED_CALL, HarmonySchemaSpec, check_json_schema, forced_call_grammar,
                                         is_plain_text, response_format_grammar, response_format_text)
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.text_limits import check_tokenizable
from engine.request import TokenLogprob
from serve_app.openai_api.errors import BadRequest
from serve_app.openai_api.protocol import allowed_tools, forced_name


def forced_tools(tool_choice: Any, tool_names: list[str]) -> tuple[str, ...]:
    """The functions one of which the output must call: the one tool_choice names, every tool for 'required', the
    allowed ones for allowed_tools in mode 'required'; () when nothing is forced. 400s for choices that name a
    function that is not among the tools."""
    name, allowed = forced_name(tool_choice), allowed_tools(tool_choice)
    names = (name,) if name else allowed[1] if allowed else ()
    for name in names:
        if name not in tool_names:
            raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    if tool_choice == "required":
        if not tool_names:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        return tuple(tool_names)
    return tuple(dict.fromkeys(names)) if allowed is None or allowed[0] == "required" else ()


def offers(tool_choice: Any, name: str) -> bool:
    """Whether the prompt offers function `name` under this tool_choice: not under 'none'; under allowed_tools in
    mode 'auto' only the allowed ones (the model sees no other, so it calls no other); otherwise every tool (a
    forced choice among some of them is held by the forced-call grammar, and the prompt stays the one without
    it, prefix cache and all)."""
    allowed = allowed_tools(tool_choice)
    return tool_choice != "none" and (allowed is None or allowed[0] == "required" or name in allowed[1])


def prediction_ids(content: str | None) -> tuple[int, ...]:
    """A chat request's `prediction` as engine draft tokens: the final answer's header, its text and
    `<|return|>`, so drafts start where the model opens its answer (after any reasoning: the engine re-aligns
    on the header) and carry on through the end of the answer. () without a prediction."""
    if not content:
        return ()
    check_tokenizable([("prediction", content)])
    text = f"<|channel|>final<|message|>{content}<|return|>"
    return tuple(load_harmony_encoding().encode(text, allowed_special="all"))


def output_constraint(fmt: dict | None, fmt_param: str, strict_tools: list[tuple[str, dict | None, str]],
                      forced: tuple[str, ...] = (), reasoning_tokens: int = 0,
                      ) -> tuple[HarmonySchemaSpec | None, str | None]:
    """Structured output of one request: (the constraint its engine requests carry, the developer message's
    response-format section), both None for plain text without strict tools or a forced call. strict_tools:
    (name, parameters, param path) of the strict tools the prompt offers; `forced`: the tools one of which the
    output must call (forced_tools), after at most `reasoning_tokens` of reasoning (forced_call_grammar: a strict
    tool's arguments held to its schema, others' to a JSON object)."""
    final, section = response_format_grammar(fmt, fmt_param)
    schemas = {name: params or {"type": "object", "properties": {}} for name, params, _ in strict_tools}
    tools = tuple((name, check_json_schema(schemas[name], param)) for name, _, param in strict_tools)
    call = forced_call_grammar([(name, schemas.get(name)) for name in forced], reasoning_tokens) if forced else None
    if call is not None:
        try:
            import llguidance
        except ImportError as err:  # a dependency of the project; a hand-made environment may lack it
            raise BadRequest("a forced tool_choice needs structured output, which this server lacks (the "
                             "llguidance package is not installed)", param="tool_choice") from err
        error = llguidance.LLMatcher.validate_grammar(call)
        if error and not error.startswith("WARNING"):
            raise BadRequest(f"tool_choice: the tools' schemas do not make one grammar ({error})",
                             param="tool_choice")
    if final is None and not tools and call is None:
        return None, None
    return (HarmonySchemaSpec(final, tools, FORCED_CALL if call is not None else None, call),
            response_format_text(section) if section is not None else None)


async def output_constraint_off_loop(fmt: dict | None, fmt_param: str,
                                     strict_tools: list[tuple[str, dict | None, str]], forced: tuple[str, ...] = (),
                                     reasoning_tokens: int = 0) -> tuple[HarmonySchemaSpec | None, str | None]:
    """output_constraint, on a worker thread when there is a schema to check: a large one compiles in
    10-200 ms, which on the event loop would stall every other request of this ingress."""
    if is_plain_text(fmt) and not strict_tools and not forced:
        return None, None
    return await anyio.to_thread.run_sync(functools.partial(output_constraint, fmt, fmt_param, strict_tools, forced,
                                                            reasoning_tokens))


def logprobs_json(entries: list[TokenLogprob], top: int, encoding: HarmonyEncoding) -> list[dict[str, Any]]:
    """Content tokens' logprobs in OpenAI's shape (Chat's `logprobs.content`, Responses' output_text `logprobs`)."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw = encoding.decode([token_id], errors="surrogateescape").encode("utf-8", "surrogateescape")
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top[:top]]}
            for e in entries]
