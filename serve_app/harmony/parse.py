"""Streaming parse of generated token ids into reasoning, content and tool-call items; never raises.

The model continues a prompt that ends with `<|start|>assistant`, so its first tokens are the rest of a
message header (`<|channel|>analysis<|message|>...`). Every Harmony message becomes one output *item*:

- a message whose recipient is `functions.NAME` is a tool call, whatever its channel (gpt-oss sometimes
  calls tools from `analysis`, and engines that only look at `commentary` miss those calls);
- otherwise `analysis` is reasoning, and `final`, `commentary` (user-visible preambles) or anything
  else is content. Recipients outside `functions.` (built-in browser/python tools, which we never
  offer) do not make a tool call; the message goes by its channel.

openai-harmony's StreamableParser does the Harmony work. Output that is not valid Harmony (plain text,
a token the grammar does not allow, a header that never ends) must not fail the request: from the
offending token on, the text is recovered as content, a warning is logged once, and parsing resumes
at the next `<|start|>`. An unfinished header at the end of the output (cut by max_tokens) is dropped
if it holds Harmony structure (a control token or a leading ` to=`), else recovered as content.
"""

from __future__ import annotations

import codecs
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Union

from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser, StreamState

from serve_app.harmony.encoding import load_harmony_encoding

log = logging.getLogger(__name__)

START, CHANNEL, CONSTRAIN = 200006, 200005, 200003  # <|start|>, <|channel|>, <|constrain|>
HEADER_CONTROL_TOKENS = (CHANNEL, CONSTRAIN)  # what may appear inside a header, besides text
TOOL_PREFIX = "functions."
# A real header (`<|channel|>commentary to=functions.some_long_name <|constrain|>json`) is ~15 tokens.
# Past this many text tokens without `<|message|>`, the model is writing plain text, not a header.
MAX_HEADER_TOKENS = 128


class ItemKind(str, Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALL = "tool_call"


@dataclass
class ItemStarted:
    index: int  # position of the item in this output, 0-based
    kind: ItemKind
    channel: str | None = None
    tool_name: str | None = None


@dataclass
class ItemDelta:
    index: int
    kind: ItemKind
    text: str


@dataclass
class ItemDone:
    index: int
    kind: ItemKind
    text: str  # the whole item; equals the concatenation of its deltas
    channel: str | None = None
    tool_name: str | None = None


ParseEvent = Union[ItemStarted, ItemDelta, ItemDone]


@dataclass
class _OpenItem:
    index: int
    kind: ItemKind
    channel: str | None
    tool_name: str | None
    parts: list[str] = field(default_factory=list)


def classify(channel: str | None, recipient: str | None) -> tuple[ItemKind, str | None]:
    """(kind, tool name) of a message from its header."""
    target = (recipient or "").strip().split(" ")[0]
    if target.startswith(TOOL_PREFIX) and len(target) > len(TOOL_PREFIX):
        return ItemKind.TOOL_CALL, target[len(TOOL_PREFIX):]
    if channel == "analysis":
        return ItemKind.REASONING, None
    return ItemKind.CONTENT, None


class HarmonyOutputParser:
    """Feed generated token ids one at a time; each call returns the item events it completes.

    `last_token_kind` tells which item kind the last fed token's text belongs to (None for header and
    control tokens), so the caller can attribute logprobs and count reasoning tokens. Header tokens
    that turn out not to be Harmony become content later: `take_recovered()` returns them (in order,
    text-carrying ones only, never the token of the feed() call itself) after the feed() or finish() call
    that recovered them.
    """

    def __init__(self, encoding: HarmonyEncoding | None = None, *, request_id: str = "",
                 max_header_tokens: int = MAX_HEADER_TOKENS):
        self._enc = encoding or load_harmony_encoding()
        self._request_id = request_id
        self._max_header_tokens = max_header_tokens
        self._parser = StreamableParser(self._enc, Role.ASSISTANT, strict=True)
        # Reading StreamableParser.state serializes the open message's tokens (O(length)), so we read
        # it only after special tokens: text tokens never change the state.
        self._state = StreamState.HEADER
        self._header_tokens: list[int] = []
        self._open: _OpenItem | None = None
        self._num_items = 0
        self._recovering = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.warned = False
        self.last_token_kind: ItemKind | None = None
        self._recovered: list[int] = []

    # -- public -----------------------------------------------------------------------------------

    def feed(self, token_id: int) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self.last_token_kind = None
        special = self._enc.is_special_token(token_id)
        if self._recovering:
            self._feed_recovering(token_id, special, events)
            return events
        try:
            self._parser.process(token_id)
        except HarmonyError as err:
            self._recover(f"{err}", [token_id], events)
            return events
        if special:
            self._after_special(token_id, events)
        elif self._state is StreamState.CONTENT:
            assert self._open is not None
            self.last_token_kind = self._open.kind
            self._delta(self._parser.last_content_delta, events)
        elif self._state is StreamState.HEADER:
            self._header_tokens.append(token_id)
            if len(self._header_tokens) > self._max_header_tokens:
                self._recover(f"no <|message|> within {self._max_header_tokens} header tokens", [], events)
                self._recovered.pop()  # the token being fed: reported through last_token_kind instead
        return events

    @property
    def current_index(self) -> int | None:
        """The index of the item text goes to now: the open item, else the last one (None before any)."""
        return self._open.index if self._open is not None else (self._num_items - 1 if self._num_items else None)

    def take_recovered(self) -> list[int]:
        """Header tokens (fed earlier, reported with kind None) whose text just became content."""
        recovered, self._recovered = self._recovered, []
        return recovered

    def finish(self) -> list[ParseEvent]:
        """End of generation: close the open item, recovering an unfinished plain-text header."""
        events: list[ParseEvent] = []
        self.last_token_kind = None
        if self._recovering:
            self._delta(self._utf8.decode(b"", final=True), events)
        elif self._state is StreamState.HEADER and self._header_tokens:
            if not self._looks_like_header(self._header_tokens):
                self._recover("output ended inside a message header", [], events)
                self._delta(self._utf8.decode(b"", final=True), events)
        elif self._state is StreamState.CONTENT:
            try:
                self._parser.process_eos()
                text = self._last_message_text()
            except HarmonyError as err:  # not expected in content; keep what was streamed
                log.warning("request %s: Harmony end of stream: %s", self._request_id, err)
                text = None
            self._close(events, text)
        self._close(events)
        return events

    # -- Harmony path -------------------------------------------------------------------------------

    def _after_special(self, token_id: int, events: list[ParseEvent]) -> None:
        before, after = self._state, self._parser.state
        self._state = after
        if before is StreamState.CONTENT and after is StreamState.CONTENT:
            # A control token inside content (the parser keeps it as text): report it like text.
            self.last_token_kind = self._open.kind if self._open else None
            self._delta(self._parser.last_content_delta, events)
        elif before is StreamState.CONTENT:
            self._close(events, self._last_message_text())
        if after is StreamState.HEADER:
            if before is not StreamState.HEADER:
                self._header_tokens = []
            elif token_id not in HEADER_CONTROL_TOKENS:
                # StreamableParser keeps e.g. <|return|> in a header as if it were text; it is not Harmony.
                self._recover(f"control token {token_id} inside a message header", [], events)
                return
            self._header_tokens.append(token_id)
        elif after is StreamState.CONTENT and before is not StreamState.CONTENT:
            self._header_tokens = []
            kind, tool = classify(self._parser.current_channel, self._parser.current_recipient)
            self._start(kind, self._parser.current_channel, tool, events)

    def _looks_like_header(self, token_ids: list[int]) -> bool:
        """A header cut short: it has Harmony control tokens or starts with a recipient (` to=`)."""
        if any(t in HEADER_CONTROL_TOKENS or t == START for t in token_ids):
            return True
        text = self._enc.decode(token_ids).lstrip()
        return text.startswith("to=") or "to=".startswith(text)

    def _last_message_text(self) -> str | None:
        messages = self._parser.messages
        if not messages:
            return None
        return "".join(getattr(c, "text", "") for c in messages[-1].content)

    # -- recovery path ------------------------------------------------------------------------------

    def _recover(self, reason: str, tokens: list[int], events: list[ParseEvent]) -> None:
        """Leave Harmony: the pending header text and `tokens` become content, until the next <|start|>."""
        if not self.warned:
            log.warning("request %s: output is not valid Harmony (%s); returning it as content",
                        self._request_id, reason)
            self.warned = True
        pending = self._header_tokens if self._state is StreamState.HEADER else []
        self._close(events)
        self._recovering = True
        self._header_tokens = []
        # The broken header is text as a whole, even if it holds a <|start|>; a live token may resync.
        for token_id in pending:
            special = self._enc.is_special_token(token_id)
            self._feed_recovering(token_id, special, events, resync=False)
            if not special:
                self._recovered.append(token_id)
        for token_id in tokens:
            self._feed_recovering(token_id, self._enc.is_special_token(token_id), events)

    def _feed_recovering(self, token_id: int, special: bool, events: list[ParseEvent], resync: bool = True) -> None:
        if token_id == START and resync:  # a new message may begin: give Harmony another chance
            self._delta(self._utf8.decode(b"", final=True), events)
            self._close(events)
            self._recovering = False
            self._parser = StreamableParser(self._enc, None, strict=True)
            self._parser.process(START)
            self._state = StreamState.HEADER
            self._header_tokens = [START]
            return
        if special:  # control tokens carry no text for the user
            return
        if self._open is None:
            self._start(ItemKind.CONTENT, None, None, events)
        self.last_token_kind = ItemKind.CONTENT
        self._delta(self._utf8.decode(self._token_bytes(token_id)), events)

    def _token_bytes(self, token_id: int) -> bytes:
        # decode() with surrogateescape keeps undecodable bytes; re-encoding returns the raw bytes.
        return self._enc.decode([token_id], errors="surrogateescape").encode("utf-8", "surrogateescape")

    # -- items --------------------------------------------------------------------------------------

    def _start(self, kind: ItemKind, channel: str | None, tool: str | None, events: list[ParseEvent]) -> None:
        self._open = _OpenItem(self._num_items, kind, channel, tool)
        self._num_items += 1
        events.append(ItemStarted(self._open.index, kind, channel, tool))

    def _delta(self, text: str | None, events: list[ParseEvent]) -> None:
        if not text or self._open is None:
            return
        self._open.parts.append(text)
        events.append(ItemDelta(self._open.index, self._open.kind, text))

    def _close(self, events: list[ParseEvent], full_text: str | None = None) -> None:
        """Close the open item; `full_text` (the parser's view) may add bytes held back mid-character."""
        item = self._open
        if item is None:
            return
        streamed = "".join(item.parts)
        if full_text is not None and full_text.startswith(streamed) and len(full_text) > len(streamed):
            self._delta(full_text[len(streamed):], events)
            streamed = full_text
        events.append(ItemDone(item.index, item.kind, streamed, item.channel, item.tool_name))
        self._open = None
