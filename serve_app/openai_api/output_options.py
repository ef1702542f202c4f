"""What a request asks of its output, turned into engine terms: a forced tool call (`tool_choice`) as prompt
tokens, a `prediction` as draft tokens, structured output (`response_format`, `text.format`, strict tools) as
the constraint its engine requests carry."""

from __future__ import annotations

import functools
from typing import Any

import anyio
from openai_harmony import HarmonyEncoding

from serve_app.harmony.constrain import (CHOICE, HarmonySchemaSpec, call_choice_grammar, check_json_schema,
                                         is_plain_text, response_format_grammar, response_format_text)
from engine.request import TokenLogprob
from serve_app.openai_api.errors import BadRequest
from serve_app.openai_api.protocol import forced_name


# What tool_choice forces: one function by name, a choice among several (tool_choice 'required'), or nothing.
Forced = str | tuple[str, ...] | None


def forced_tool(tool_choice: Any, tool_names: list[str]) -> Forced:
    """The function tool_choice forces (named, or 'required' with one tool), the functions one of which it forces
    ('required' with several: a tuple), else None; 400s for choices that name no tool."""
    name = forced_name(tool_choice)
    if tool_choice == "required":
        if not tool_names:
            raise BadRequest("tool_choice 'required' needs tools", param="tool_choice")
        if len(tool_names) > 1:
            return tuple(tool_names)
        name = tool_names[0]
    if name is not None and name not in tool_names:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return name


def forced_call_ids(forced: Forced, encoding: HarmonyEncoding) -> list[int]:
    """Prompt tokens that make the model call a tool (forced_tool's answer): the header of a commentary message
    to that function, ending in `<|message|>`, so the model writes its JSON arguments (held to the tool's schema
    when the tool is strict: output_constraint); for a choice, the header up to `to=functions`, the rest (which
    function, and its arguments) held by the call-choice grammar. [] when nothing is forced."""
    if forced is None:
        return []
    if isinstance(forced, tuple):
        return encoding.encode("<|channel|>commentary to=functions", allowed_special="all")
    return encoding.encode(f"<|channel|>commentary to=functions.{forced} <|constrain|>json<|message|>",
                           allowed_special="all")


def prediction_ids(content: str | None, encoding: HarmonyEncoding) -> tuple[int, ...]:
    """A chat request's `prediction` as engine draft tokens: the final answer's header, its text and
    `<|return|>`, so drafts start where the model opens its answer (after any reasoning: the engine re-aligns
    on the header) and carry on through the end of the answer. () without a prediction."""
    if not content:
        return ()
    return tuple(encoding.encode(f"<|channel|>final<|message|>{content}<|return|>", allowed_special="all"))


def output_constraint(fmt: dict | None, fmt_param: str, strict_tools: list[tuple[str, dict | None, str]],
                      forced: Forced) -> tuple[HarmonySchemaSpec | None, str | None]:
    """Structured output of one request: (the constraint its engine requests carry, the developer message's
    response-format section), both None for plain text without strict tools or a choice of tools. strict_tools:
    (name, parameters, param path) of the strict tools the prompt offers; `forced`: the tool whose call the prompt
    ends in (forced_tool), which starts inside its grammar when it is strict, or the tools among which the output
    starts by choosing (call_choice_grammar: a strict one's arguments held to its schema, others' to a JSON
    object)."""
    final, section = response_format_grammar(fmt, fmt_param)
    schemas = {name: params or {"type": "object", "properties": {}} for name, params, _ in strict_tools}
    tools = tuple((name, check_json_schema(schemas[name], param)) for name, _, param in strict_tools)
    choice = call_choice_grammar([(name, schemas.get(name)) for name in forced]) if isinstance(forced, tuple) \
        else None
    if choice is not None:
        try:
            import llguidance
        except ImportError as err:  # a dependency of the project; a hand-made environment may lack it
            raise BadRequest("tool_choice 'required' among several tools needs structured output, which this server "
                             "lacks (the llguidance package is not installed); name the function", param="tool_choice"
                             ) from err
        error = llguidance.LLMatcher.validate_grammar(choice)
        if error and not error.startswith("WARNING"):
            raise BadRequest(f"tool_choice 'required': the tools' schemas do not make one grammar ({error})",
                             param="tool_choice")
    if final is None and not tools and choice is None:
        return None, None
    start_in = CHOICE if choice is not None else forced if forced in dict(tools) else None
    return (HarmonySchemaSpec(final, tools, start_in, choice),
            response_format_text(section) if section is not None else None)


async def output_constraint_off_loop(fmt: dict | None, fmt_param: str,
                                     strict_tools: list[tuple[str, dict | None, str]],
                                     forced: Forced) -> tuple[HarmonySchemaSpec | None, str | None]:
    """output_constraint, on a worker thread when there is a schema to check: a large one compiles in
    10-200 ms, which on the event loop would stall every other request of this ingress."""
    if is_plain_text(fmt) and not strict_tools and not isinstance(forced, tuple):
        return None, None
    return await anyio.to_thread.run_sync(functools.partial(output_constraint, fmt, fmt_param, strict_tools, forced))


def logprobs_json(entries: list[TokenLogprob], top: int, encoding: HarmonyEncoding) -> list[dict[str, Any]]:
    """Content tokens' logprobs in OpenAI's shape (Chat's `logprobs.content`, Responses' output_text `logprobs`)."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw = encoding.decode([token_id], errors="surrogateescape").encode("utf-8", "surrogateescape")
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top[:top]]}
            for e in entries]
