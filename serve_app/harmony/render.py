"""Conversations -> Harmony prompt token ids, rendered by openai-harmony's own renderer.

The OpenAI front ends (serve_app/openai_api/chat.py and responses.py) translate their requests into the
neutral `Prompt` below; this module turns it into Harmony messages and lets openai-harmony render them.
Keeping the two steps apart means both APIs share one Harmony mapping, and the golden tests can compare
our conversation with one built by hand through openai_harmony's Conversation/Message API.

Mapping decisions (Harmony cookbook, "OpenAI harmony response format"):
- The Harmony *system* message carries model identity, knowledge cutoff, current date and reasoning
  effort. OpenAI "system" and "developer" messages are the developer's instructions: they become the
  Harmony *developer* message (with the function tools), joined in order by blank lines.
- Assistant text is rendered on the `final` channel, except text that precedes a tool call of the same
  turn, which is a user-visible preamble on `commentary` (that is where the model writes preambles).
- Tool calls: `assistant to=functions.NAME<|channel|>commentary <|constrain|>json` ending in <|call|>.
  Tool results: author `functions.NAME`, recipient `assistant`, channel `commentary`.
- Reasoning (analysis) of a turn that ended in a final answer is dropped; reasoning of the turn in
  progress (tool calls after the last final answer) is kept, because the model calls tools from its
  chain of thought and needs it back (cookbook: "Handling reasoning output in subsequent sampling").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence, Union

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from engine.request import HARMONY_FIRST_SPECIAL_ID, MAX_CACHE_CUTS, InvalidRequestError
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.parse import START
from serve_app.harmony.text_limits import check_tokenizable

FUNCTIONS_NAMESPACE = "functions"
# What the model writes after a JSON tool call's channel; rendering history the same way keeps the
# prompt in the distribution the model was trained on.
TOOL_CALL_CONTENT_TYPE = "<|constrain|>json"
DEFAULT_KNOWLEDGE_CUTOFF = "2024-06"

_MESSAGE_TOKEN, _END_TOKEN = 200008, 200007  # <|message|>, <|end|>
_INSTRUCTION_ROLES = ("system", "developer")
_EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict | None = None  # JSON schema of the single argument object; None: no arguments


@dataclass(frozen=True)
class UserMessage:
    text: str


@dataclass(frozen=True)
class AssistantReasoning:
    text: str


@dataclass(frozen=True)
class AssistantText:
    text: str


@dataclass(frozen=True)
class AssistantToolCall:
    name: str  # without the "functions." prefix
    arguments: str  # the JSON text exactly as the model (or client) wrote it


@dataclass(frozen=True)
class ToolResult:
    name: str  # the function that produced it, matched from the call by the API layer
    output: str


HistoryItem = Union[UserMessage, AssistantReasoning, AssistantText, AssistantToolCall, ToolResult]


@dataclass
class Prompt:
    """Everything the model sees before `<|start|>assistant`."""

    history: list[HistoryItem]
    instructions: str | None = None
    tools: list[FunctionTool] = field(default_factory=list)
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    conversation_start_date: str | None = None  # "YYYY-MM-DD"; None: the line is left out
    knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF
    # Structured output: the "# Response Formats" section ending the developer message (constrain.py)
    response_format: str | None = None


def system_message(prompt: Prompt) -> Message:
    if prompt.reasoning_effort not in _EFFORTS:
        raise InvalidRequestError(
            f"reasoning effort must be one of {sorted(_EFFORTS)}, got {prompt.reasoning_effort!r}",
            "reasoning_effort",
        )
    content = (
        SystemContent.new()
        .with_reasoning_effort(_EFFORTS[prompt.reasoning_effort])
        .with_knowledge_cutoff(prompt.knowledge_cutoff)
    )
    if prompt.conversation_start_date:
        content = content.with_conversation_start_date(prompt.conversation_start_date)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(prompt: Prompt) -> Message | None:
    if not prompt.instructions and not prompt.tools:
        return None if prompt.response_format is None else \
            Message.from_role_and_content(Role.DEVELOPER, prompt.response_format)
    content = DeveloperContent.new()
    if prompt.instructions:
        content = content.with_instructions(prompt.instructions)
    if prompt.tools:
        content = content.with_function_tools(
            [ToolDescription.new(t.name, t.description, t.parameters) for t in prompt.tools]
        )
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _with_response_format(tokens: list[int], section: str) -> list[int]:
    """Rendered prompt tokens with `section` at the end of the developer message (the second message).
    The Harmony guide puts it there, after the tools, where openai-harmony's DeveloperContent has no field;
    adding it to the rendered text (rather than rendering the message as plain text) keeps what the renderer
    derives from the tools, such as the system message's line on the functions' channel."""
    encoding = load_harmony_encoding()
    body_start = tokens.index(_MESSAGE_TOKEN, tokens.index(_END_TOKEN)) + 1
    body_end = tokens.index(_END_TOKEN, body_start)
    body = encoding.decode_utf8(tokens[body_start:body_end])
    # as the renderer does with message text: a special token's spelling stays plain text
    new_body = encoding.encode(f"{body}\n\n{section}", allowed_special=set(), disallowed_special=())
    return tokens[:body_start] + new_body + tokens[body_end:]


def _kept_history(history: Sequence[HistoryItem]) -> list[HistoryItem]:
    """Drop reasoning that precedes a final answer; keep the reasoning of the turn still in progress."""
    last_final = max(
        (i for i, item in enumerate(history) if isinstance(item, AssistantText) and _is_final(history, i)),
        default=-1,
    )
    return [item for i, item in enumerate(history) if not (isinstance(item, AssistantReasoning) and i < last_final)]


def _is_final(history: Sequence[HistoryItem], index: int) -> bool:
    """Assistant text is a final answer unless a tool call follows it within the same assistant run."""
    for item in history[index + 1:]:
        if isinstance(item, AssistantToolCall):
            return False
        if isinstance(item, (UserMessage, ToolResult)):
            return True
    return True


def history_messages(history: Sequence[HistoryItem]) -> list[Message]:
    kept = _kept_history(history)
    messages = []
    for i, item in enumerate(kept):
        if isinstance(item, UserMessage):
            messages.append(Message.from_role_and_content(Role.USER, item.text))
        elif isinstance(item, AssistantReasoning):
            messages.append(Message.from_role_and_content(Role.ASSISTANT, item.text).with_channel("analysis"))
        elif isinstance(item, AssistantText):
            channel = "final" if _is_final(kept, i) else "commentary"
            messages.append(Message.from_role_and_content(Role.ASSISTANT, item.text).with_channel(channel))
        elif isinstance(item, AssistantToolCall):
            messages.append(
                Message.from_role_and_content(Role.ASSISTANT, item.arguments)
                .with_channel("commentary")
                .with_recipient(f"{FUNCTIONS_NAMESPACE}.{item.name}")
                .with_content_type(TOOL_CALL_CONTENT_TYPE)
            )
        elif isinstance(item, ToolResult):
            author = Author.new(Role.TOOL, f"{FUNCTIONS_NAMESPACE}.{item.name}")
            messages.append(
                Message.from_author_and_content(author, item.output).with_channel("commentary").with_recipient("assistant")
            )
        else:
            raise TypeError(f"not a history item: {item!r}")
    return messages


def to_conversation(prompt: Prompt) -> Conversation:
    developer = developer_message(prompt)
    head = [system_message(prompt)] + ([developer] if developer is not None else [])
    return Conversation.from_messages(head + history_messages(prompt.history))


def prompt_texts(prompt: Prompt, param: str) -> Iterator[tuple[str, str]]:
    """(API field, text) for every text of the prompt that the renderer tokenizes: the tools' under "tools", the
    rest (instructions, history, the response-format section) under `param`."""
    yield from ((param, prompt.instructions or ""), (param, prompt.response_format or ""))
    for tool in prompt.tools:
        for text in (tool.name, tool.description, json.dumps(tool.parameters) if tool.parameters else ""):
            yield "tools", text
    for item in prompt.history:
        for name in ("text", "name", "arguments", "output"):
            if hasattr(item, name):
                yield param, getattr(item, name)


def prompt_chars(prompt: Prompt) -> int:
    """Characters of text the renderer tokenizes: what a render costs (RenderWorkers' in-place limit)."""
    return sum(len(text) for _, text in prompt_texts(prompt, ""))


def render_prompt(prompt: Prompt, param: str = "messages") -> list[int]:
    """Token ids of the whole prompt, ending with `<|start|>assistant` so the model writes the header. Text the
    tokenizer would take too long on is a 400 naming `param` or "tools" (text_limits.check_tokenizable)."""
    check_tokenizable(prompt_texts(prompt, param))
    conversation = to_conversation(prompt)
    try:
        tokens = load_harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)
    except HarmonyError as err:  # e.g. text that contains a Harmony special token in a header field
        raise InvalidRequestError(f"the conversation cannot be rendered in Harmony: {err}", param) from err
    if prompt.response_format is not None and (prompt.instructions or prompt.tools):
        tokens = _with_response_format(tokens, prompt.response_format)
    return tokens


def prompt_cache_cuts(ids: list[int], encoding) -> tuple[int, ...]:
    """Where later prompts are likely to leave this Harmony prompt (GenerateRequest.cache_cuts): the end of each
    leading system / developer message (other conversations of the same application share them; another
    application may share only the system message) and the start of the last user message (edited or asked
    again). Positions of `<|start|>` tokens, so a prompt that leaves there shares at least the tokens before:
    the prefix cache then keeps the sliding layers' windows before them from the first prompt on. () for a
    prompt without Harmony messages. Linear in the prompt, by list.index (C): a 100k-token prompt ~1 ms."""
    starts, i = [], -1
    while True:
        try:
            i = ids.index(START, i + 1)
        except ValueError:
            break
        starts.append(i)

    def role(k: int) -> str:
        header = []
        for t in ids[starts[k] + 1: starts[k] + 9]:
            if t >= HARMONY_FIRST_SPECIAL_ID:
                break
            header.append(t)
        text = encoding.decode(header) if header else ""  # (decode: a broken UTF-8 sequence is no error)
        return text.split(" ", 1)[0].strip()

    cuts, k = [], 0
    while k + 1 < len(starts) and len(cuts) < MAX_CACHE_CUTS - 1 and role(k) in _INSTRUCTION_ROLES:
        cuts.append(starts[k + 1])
        k += 1
    last_user = next((j for j in range(len(starts) - 1, k - 1, -1) if role(j) == "user"), None)
    if last_user is not None and starts[last_user] not in cuts:
        cuts.append(starts[last_user])
    return tuple(c for c in cuts if c > 0)
