"""Pydantic models of the OpenAI requests we accept and the objects we return.

Requests reject unknown top-level fields (OpenAI answers "Unrecognized request argument"), while
nested objects ignore extra keys: clients echo earlier responses back (`refusal`, `annotations`,
`status`, ...) and those must not fail. Parameters the server cannot honour are rejected with a
message that says what to send instead; nothing is silently ignored that would change the output. The app
validates bodies strictly (`app.parse_request`): JSON types are never converted (`"5"` or `true` for an integer
is a 400), only a whole number where a float goes passes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator,
                      model_validator)

Effort = Literal["low", "medium", "high"]
Verbosity = Literal["low", "medium", "high"]
TEXT_PART_TYPES = ("text", "input_text", "output_text")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOP_SEQUENCES = 4
MAX_N = 16  # chat completions per request (serve_app/openai_api/chat.py)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(Lenient):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type not in TEXT_PART_TYPES:
            raise ValueError(f"content part type {self.type!r} is not supported; gpt-oss reads text only "
                             f"(use one of {', '.join(TEXT_PART_TYPES)})")
        if self.text is None:
            raise ValueError(f"a {self.type!r} content part needs a 'text' field")
        return self


Content = Union[str, list[ContentPart]]


def text_of(content: Content | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def check_tool_schema(parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    """The checks a JSON schema for function arguments must pass before we render it for the model."""
    if parameters is None:
        return None
    if parameters.get("type", "object") != "object":
        raise ValueError(f"function parameters must be a JSON schema of type 'object', got type "
                         f"{parameters.get('type')!r}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, (dict, bool)) for v in properties.values()):
        raise ValueError("function parameters 'properties' must map each argument name to a JSON schema object")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("function parameters 'required' must be a list of argument names")
    return parameters


def check_response_format(value: dict[str, Any] | None, nested: bool) -> dict[str, Any] | None:
    """The shape of a structured-output format: Chat's `response_format` (`json_schema` nested) or Responses'
    `text.format` (its fields beside `type`). The schema itself is compiled later (harmony/constrain.py)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    if kind == "json_schema":
        spec = value.get("json_schema") if nested else value
        where = "json_schema." if nested else ""
        if not isinstance(spec, dict):
            raise ValueError("json_schema must be an object with 'name' and 'schema'")
        if not isinstance(spec.get("name"), str) or not TOOL_NAME.match(spec["name"]):
            raise ValueError(f"{where}name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
        if not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError(f"{where}schema must be a JSON schema object")
        if not isinstance(spec.get("description") or "", str):
            raise ValueError(f"{where}description must be a string")
    return value


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata limits


def check_metadata(value: dict[str, str]) -> dict[str, str]:
    """`metadata` within OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512 (it is stored)."""
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"takes up to {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
            raise ValueError(f"keys take up to {MAX_METADATA_KEY} characters and values up to {MAX_METADATA_VALUE}; "
                             f"{key[:80]!r} is over")
    return value


Metadata = Annotated[dict[str, str], AfterValidator(check_metadata)]


def check_tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r} must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
    return name


def reject_unless(value: Any, allowed: tuple, why: str) -> Any:
    if value not in allowed:
        raise ValueError(why)
    return value


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingBase(Strict):
    """Fields every generation API shares (`top_k`, `min_p`, `priority` are vLLM-style extensions)."""

    model: str
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = None
    user: str | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)  # vLLM's extension; see IngressConfig
    # vLLM's extension: a prefix-cache namespace (IngressConfig.cache_salt); requests share cached prompt blocks
    # only with requests of the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class TextOutputFields(Strict):
    """Chat Completions' and Completions' shared output controls. Extensions other engines' benchmark clients
    send: `ignore_eos` (generate past the end tokens, to fix output lengths; vLLM's and SGLang's), and
    `repetition_penalty` (vLLM's `bench serve` sends 1.0 on every completions request; other values are
    refused: use presence_penalty / frequency_penalty)."""

    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output, Chat's shape (on Completions vLLM's extension: the output is held to the format from
    # its first token, so the prompt should end in a final-channel header, and it ends in <|return|>)
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict | None) -> dict | None:
        return check_response_format(value, nested=True)

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Union[str, list[str], None]) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
            raise ValueError(f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings")
        return stops

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value is not None and not -2 <= value <= 2:
            raise ValueError("must be between -2 and 2")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float | None) -> float | None:
        return reject_unless(value, (None, 1, 1.0), "only 1.0 (no penalty) is supported; use presence_penalty "
                              "or frequency_penalty")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict | None) -> dict | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"values must be between -100 and 100, got {bias!r} for token {key}")
        return value


class RequestBase(SamplingBase):
    """Fields Chat Completions and Responses share."""

    parallel_tool_calls: bool | None = None
    tool_choice: Any = None
    metadata: Metadata | None = None
    store: bool | None = None  # Responses: kept for previous_response_id and GET unless false; Chat: ignored
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Accepted, no effect: how long a prompt prefix stays cached is the server's (least recently used blocks leave
    # first, ServeAppConfig's K/V memory and host tier), not a request's
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value in (None, "none", "auto", "required") or forced_name(value) is not None:
            return value
        if isinstance(value, dict) and value.get("type") == "allowed_tools":
            allowed_tools(value)  # its own error names what is wrong
            return value
        raise ValueError("must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} "
                         "(Responses: {'type': 'function', 'name': ...}) or {'type': 'allowed_tools', ...}")


def forced_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice forces (Chat's and Responses' shapes), else None."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
    return name if isinstance(name, str) and name else None


def allowed_tools(tool_choice: Any) -> tuple[str, tuple[str, ...]] | None:
    """(mode, function names) of an `allowed_tools` tool_choice: Chat's `{"type": "allowed_tools", "allowed_tools":
    {"mode", "tools": [{"type": "function", "function": {"name"}}]}}` or Responses' `{"type": "allowed_tools",
    "mode", "tools": [{"type": "function", "name"}]}`; None for any other tool_choice. ValueError for a malformed
    one (function tools only: this server runs no hosted tools)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "allowed_tools":
        return None
    spec = tool_choice.get("allowed_tools", tool_choice)
    mode, tools = (spec.get("mode"), spec.get("tools")) if isinstance(spec, dict) else (None, None)
    if mode not in ("auto", "required"):
        raise ValueError(f"allowed_tools mode must be 'auto' or 'required', got {mode!r:.40}")
    if not isinstance(tools, list) or not tools:
        raise ValueError("allowed_tools needs a non-empty list of tools")
    names = tuple(forced_name(tool) for tool in tools)
    if None in names:
        raise ValueError("allowed_tools lists function tools only ({'type': 'function', 'name': ...}; Chat: "
                         "{'type': 'function', 'function': {'name': ...}})")
    return mode, names


# -- Chat Completions ---------------------------------------------------------------------------------


class ToolCallFunction(Lenient):
    name: str
    arguments: str


class ToolCallIn(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # what we return; clients send it back with the history
    reasoning: str | None = None  # the same, as some clients name it


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict | None) -> dict | None:
        return check_tool_schema(value)


class ChatTool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class Prediction(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to contain (an edited file), for speculative
    decoding (engine/speculative.py). It changes how fast the tokens come, never which tokens."""

    type: Literal["content"]
    content: Content


class ChatCompletionRequest(RequestBase, TextOutputFields):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: Prediction | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: Effort | None = None
    verbosity: Verbosity | None = None  # accepted, no effect: gpt-oss has no such control (Responses' text.verbosity)
    tools: list[ChatTool] | None = None
    modalities: list[str] | None = None

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, value: list[str] | None) -> list[str] | None:
        return reject_unless(value, (None, ["text"]), "only the 'text' modality is supported")

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        return tools


# -- Responses ------------------------------------------------------------------------------------------


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: Content


class ReasoningText(Lenient):
    type: str = "reasoning_text"
    text: str


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None  # ours carries the reasoning text (responses.reasoning_envelope)


class CompactionItem(Lenient):
    """POST /v1/responses/compact's summary of a conversation (compaction.py): ours carries the summary's text."""

    type: Literal["compaction"]
    id: str | None = None
    encrypted_content: str


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "compaction")


def _item_tag(value: Any) -> str | None:
    # Easy input messages (`{"role": "user", "content": "..."}`) may leave out the type. The tags are
    # not identifiers so that error locations can tell them from field names (errors.py).
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-item" if kind in INPUT_ITEM_TYPES else None


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message-item")],
        Annotated[FunctionCallItem, Tag("function_call-item")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output-item")],
        Annotated[ReasoningItem, Tag("reasoning-item")],
        Annotated[CompactionItem, Tag("compaction-item")],
    ],
    Discriminator(_item_tag, custom_error_type="input_item_type",
                  custom_error_message=f"input item type must be one of {', '.join(INPUT_ITEM_TYPES)}"),
]


INPUT_ITEMS = TypeAdapter(list[InputItem])  # stored items (a conversation's, a response chain's) read back as input


class ResponsesTool(FunctionDefinition):
    """Responses API tools are flat: the function's fields sit beside `type`."""

    type: Literal["function"]


class ReasoningOptions(Lenient):
    effort: Effort | None = None
    summary: str | None = None  # accepted; we return the raw reasoning text, never a summary


class TextOptions(Lenient):
    format: dict[str, Any] | None = None
    verbosity: Verbosity | None = None  # accepted and echoed, no effect on the output

    @field_validator("format")
    @classmethod
    def _format(cls, value: dict | None) -> dict | None:
        return check_response_format(value, nested=False)


class ConversationRef(Strict):
    id: str


class ResponsesRequest(RequestBase):
    """`previous_response_id` continues a stored response, `conversation` runs in a stored conversation and
    `background` runs it detached (stored_responses.py, conversations.py, background.py; checked where the store
    is)."""

    input: Union[str, list[InputItem]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Union[str, ConversationRef, None] = None  # its id after validation (conversations.py)
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with include "message.output_text.logprobs"
    # A cap on calls to OpenAI's built-in tools (web search, code interpreter, ...): this server runs none, only
    # the client's function tools, which it does not cap; accepted and echoed
    max_tool_calls: int | None = Field(None, ge=0)

    @field_validator("conversation")
    @classmethod
    def _conversation_id(cls, value: Union[str, ConversationRef, None]) -> str | None:
        return value.id if isinstance(value, ConversationRef) else value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[ResponsesTool] | None) -> list[ResponsesTool] | None:
        names = [t.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        return tools


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: the prompt-shaping fields of a Responses request, all optional; fields that
    only matter for generating (sampling, `store`, ...) are accepted and ignored, as is anything unknown."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Union[str, list[InputItem]] = Field(default_factory=list)
