"""Structured output over Harmony: JSON-schema grammars enforced on the messages they belong to.

The model writes Harmony: a header (`<|channel|>final`, `<|channel|>commentary to=functions.NAME
<|constrain|>json`, ...), `<|message|>`, the content, an end token. A grammar must hold the content of
one message, not the reasoning before it, so `HarmonyConstraint` follows the output token by token:

- between messages and inside unconstrained ones, any token (the analysis channel, preambles, tools
  without a schema);
- at the `<|message|>` that closes a header, it reads the header: a final-channel message with a
  response format, or a call to a function whose tool is strict, starts that grammar;
- inside it, the allowed tokens are the grammar's (llguidance's matcher over the Harmony vocabulary;
  special tokens never, except the message's end once the JSON is complete: `<|return|>` for the
  answer, `<|call|>` for a tool call); the end token returns it to the unconstrained state.

A forced tool call (tool_choice naming a function, or 'required') holds the whole output from its first token
(`HarmonySchemaSpec.start_in` FORCED_CALL, forced_call_grammar): an analysis message and a preamble, each optional
and of a bounded number of tokens (the model reasons first, as it does before any call), then a commentary message
to one of the forced functions, its `.NAME`, the rest of its header and its arguments, ended by <|call|>.
Decisions: JSON is compact (no whitespace outside strings, `,` and `:` as separators, as gpt-oss writes tool
arguments), so a model cannot pad it forever; a matcher that fails (an llguidance limit, a token it rejects) is
logged and lets only the end token through, so the message closes instead of the request hanging.

The engine's lookahead (it samples the next token before reading the one in flight) stays on where that
token cannot change the next mask (a free body, between messages) or is known (the last mask allowed one
id: `can_look_ahead`); in headers and at free choices inside a grammar it reads each token first. A run of
forced tokens (each mask one id: JSON punctuation, the keys a schema fixes) is what `forced_tokens` gives the
engine as a draft, verified in one step (jump-forward decoding; engine/speculative.py).

The spec crosses processes (ingress -> decode and prefill replicas) as grammar strings; each engine
process builds the Harmony tokenizer for llguidance once (~1.5 s; replicas start that on a background
thread) and matchers per request.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import re
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.request import InvalidRequestError
from serve_app.harmony.encoding import VOCAB_FILE, load_harmony_encoding, vocab_dir

log = logging.getLogger(__name__)

HARMONY_VOCAB_SIZE = 201088  # the models' unembedding rows (o200k_harmony's last reserved id is beyond them)
MASK_WORDS = (HARMONY_VOCAB_SIZE + 31) // 32  # llguidance's masks may run longer: cut to the model's ids
RETURN, CALL, END, START, MESSAGE = 200002, 200012, 200007, 200006, 200008
# tiktoken's o200k_base split pattern (only llguidance's own tokenize_* calls use it, never the masks)
_O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
FINAL = "final"  # start_in: inside the final answer (a raw completion whose prompt ends in its header)
FORCED_CALL = "functions"  # start_in: the output must call a function, after any reasoning (forced_call_grammar)


def json_grammar(schema: dict | bool) -> str:
    """llguidance's grammar for JSON text matching `schema` (compact; see the module docstring)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def check_json_schema(schema: Any, param: str) -> str:
    """The grammar of a JSON schema from a request, or InvalidRequestError (HTTP 400) naming `param`."""
    try:
        import llguidance
    except ImportError as err:  # a dependency of the project; a hand-made environment may lack it
        raise InvalidRequestError("structured output is not available on this server (the llguidance package is "
                                  "not installed)", param) from err

    if not isinstance(schema, (dict, bool)) or schema is False:
        raise InvalidRequestError(f"{param} must be a JSON schema object (and not `false`, which allows nothing), "
                                  f"got {schema!r:.80}", param)
    if schema is True:  # any JSON value
        schema = {}
    try:
        grammar = json_grammar(schema)
    except ValueError as err:
        raise InvalidRequestError(f"{param} is not a usable JSON schema: {err}", param) from err
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"{param} is not a usable JSON schema: {error}", param)
    return grammar


_TOKENIZER_LOCK = threading.Lock()


def harmony_tokenizer():
    """llguidance's tokenizer over the Harmony vocabulary (o200k_base ranks + Harmony's special tokens),
    built once per process (~1.5 s); a caller arriving while another thread builds it waits for that one."""
    with _TOKENIZER_LOCK:
        return _build_tokenizer()


def warm_up_in_background() -> threading.Thread:
    """Build the tokenizer on a daemon thread (replicas call this at start, so that the first structured
    request does not stall the engine loop for the build); without llguidance it logs and does nothing."""
    def build():
        try:
            harmony_tokenizer()
        except ImportError:
            log.info("llguidance is not installed: structured output requests will be refused")

    thread = threading.Thread(target=build, name="harmony-tokenizer-warmup", daemon=True)
    thread.start()
    return thread


@functools.lru_cache(maxsize=1)
def _build_tokenizer():
    import llguidance

    ranks = {}
    for line in (vocab_dir() / VOCAB_FILE).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    enc = load_harmony_encoding()
    specials = {name: enc.encode(name, allowed_special="all")[0] for name in enc.special_tokens_set}
    specials = {name: i for name, i in specials.items() if i < HARMONY_VOCAB_SIZE}
    return llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials, pattern=_O200K_PATTERN,
                                                eos_token=RETURN, n_vocab=HARMONY_VOCAB_SIZE)


@dataclass(frozen=True)
class HarmonySchemaSpec:
    """Which messages of a request's output a grammar holds (engine.request.ConstraintSpec)."""

    final: str | None = None  # grammar of the final answer (response_format)
    tools: tuple[tuple[str, str], ...] = ()  # (function name, grammar of its arguments): strict tools
    start_in: str | None = None  # the output starts inside a message (FINAL, a function name) or FORCED_CALL
    forced_call: str | None = None  # with start_in FORCED_CALL: the whole output's grammar (forced_call_grammar)
    after: tuple[int, ...] = ()  # output already produced (a stream taken up elsewhere): the state starts past it

    def __post_init__(self):
        names = {name for name, _ in self.tools}
        if self.start_in not in (None, FINAL, FORCED_CALL) and self.start_in not in names:
            raise ValueError(f"start_in {self.start_in!r} is neither {FINAL!r}, {FORCED_CALL!r} nor one of the tools "
                             f"{sorted(names)}")
        if self.start_in == FINAL and self.final is None:
            raise ValueError("start_in 'final' needs a final grammar")
        if (self.start_in == FORCED_CALL) != (self.forced_call is not None):
            raise ValueError("start_in 'functions' goes with a forced_call grammar, and only with it")

    def prepare(self) -> None:
        """Compile this spec's grammars into the process's cache (engine.async_engine runs this on a worker
        thread before the request reaches the engine loop: a large schema compiles in 10-200 ms)."""
        for grammar in [self.final, self.forced_call, *(g for _, g in self.tools)]:
            if grammar is not None:
                matcher_for(grammar)

    def start(self, vocab_size: int) -> "HarmonyConstraint":
        if vocab_size != HARMONY_VOCAB_SIZE:
            raise InvalidRequestError(
                f"structured output needs the Harmony vocabulary ({HARMONY_VOCAB_SIZE} tokens); this model has "
                f"{vocab_size}", "response_format")
        constraint = HarmonyConstraint(self)
        for token_id in self.after:  # as the first run's accepted tokens moved it (each once: _advance)
            constraint._advance(token_id)
        return constraint


_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyConstraint:
    """engine.request.TokenConstraint for one request (module docstring)."""

    def __init__(self, spec: HarmonySchemaSpec):
        self.spec = spec
        self._tok = harmony_tokenizer()
        self._tools = dict(spec.tools)
        self._header: list[int] | None = []  # tokens of the header being read; None: inside a message
        self._matcher = None  # the grammar of the message being written, if any
        self._end = RETURN
        self._failed = False
        # Forced tokens (a mask that allows one id: the sampler can pick nothing else) are applied to the state
        # as soon as that mask is built, ahead of accept(): `_ahead` holds them in output order, and masks of
        # their positions are known without computing (one id each). So the engine may look ahead past them
        # (can_look_ahead), and `forced_tokens` gives a run of them as a draft (jump-forward).
        self._ahead: deque[int] = deque()  # applied to the state, not yet accepted
        self._handed = 0  # masks built for positions past the accepted tokens (their tokens in flight)
        self._version = 0  # counts _advance calls: the cached mask below is the state's while it matches
        self._cached: tuple[int, np.ndarray | None] | None = None
        if spec.start_in == FINAL:
            self._enter(spec.final, RETURN)
        elif spec.start_in == FORCED_CALL:
            self._enter(spec.forced_call, CALL)
        elif spec.start_in is not None:
            self._enter(self._tools[spec.start_in], CALL)

    @property
    def active(self) -> bool:
        """Inside a message that a grammar holds."""
        return self._matcher is not None

    def allowed_tokens(self) -> np.ndarray | None:
        """The mask of the next position without one (after the accepted tokens and those in flight)."""
        i = self._handed
        self._handed += 1
        if i < len(self._ahead):  # a forced token's position: its mask is that one id
            return _one_id(self._ahead[i])
        return self._walk_mask()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the constraint forces after the positions whose masks it gave (jump-forward
        drafts: each one's mask allows only it); [] where a token in flight is not known."""
        if limit <= 0 or self._handed > len(self._ahead):
            return []
        while len(self._ahead) < self._handed + limit and self._walk_mask(forced_only=True) is not None:
            pass
        return list(self._ahead)[self._handed: self._handed + limit]

    def can_look_ahead(self) -> bool:
        """The engine may sample past the token in flight unread when that token is known (its mask allowed
        one id) or cannot start a grammar (a free message's body or between messages: only the <|message|>
        closing a header does)."""
        return len(self._ahead) >= self._handed > 0 or (self._matcher is None and self._header is None)

    def accept(self, token_id: int) -> None:
        self._handed = max(0, self._handed - 1)
        if self._ahead:
            ahead = self._ahead.popleft()
            if token_id != ahead:  # the sampler picked outside a one-id mask: cannot happen with finite logits
                log.warning("structured output: token %d where only %d was allowed; closing the message",
                            token_id, ahead)
                self._failed = True
            return
        self._advance(token_id)

    def _walk_mask(self, forced_only: bool = False):
        """The mask at the end of the applied state; a one-id mask applies its token (`_ahead`). forced_only:
        the forced id, or None (the mask stays cached for the allowed_tokens() call that will want it)."""
        if self._cached is not None and self._cached[0] == self._version:
            words = self._cached[1]
        else:
            words = self._mask()
            self._cached = (self._version, words)
        forced = None
        if words is not None:
            ids = np.flatnonzero(words)
            if len(ids) == 1 and words[ids[0]] & (words[ids[0]] - np.uint32(1)) == 0:  # one word, one bit
                forced = int(ids[0]) * 32 + int(words[ids[0]]).bit_length() - 1
                self._advance(forced)
                self._ahead.append(forced)
        return forced if forced_only else words

    def _mask(self) -> np.ndarray | None:
        if self._matcher is None:
            return None
        if not self._failed and self._matcher.is_error():
            log.warning("structured output: the grammar failed (%s); closing the message",
                        self._matcher.get_error())
            self._failed = True
        if self._failed:
            words = np.zeros(MASK_WORDS, dtype=np.uint32)
        else:
            words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32)[:MASK_WORDS].copy()
            words[RETURN // 32] &= ~np.uint32(1 << (RETURN % 32))  # the grammar's "done" is this message's end
            if not words.any() and not self._matcher.is_accepting():
                log.warning("structured output: the grammar allows no token; closing the message")
                self._failed = True
        if self._failed or self._matcher.is_accepting():
            words[self._end // 32] |= np.uint32(1 << (self._end % 32))
        return words

    def _advance(self, token_id: int) -> None:
        self._version += 1
        if self._matcher is not None:
            if token_id == self._end:
                self._matcher, self._header = None, None  # the message (and normally the output) ends here
            elif not self._failed and not self._matcher.consume_token(token_id):
                log.warning("structured output: token %d rejected by the grammar (%s)", token_id,
                            self._matcher.get_error())
                self._failed = True
            return
        if token_id == START:
            self._header = []
        elif token_id in (END, RETURN, CALL):
            self._header = None
        elif self._header is not None:
            if token_id != MESSAGE:
                self._header.append(token_id)
                return
            header, self._header = self._header, None
            self._open(self._tok.decode_str(header))

    def _open(self, header: str) -> None:
        """A header just ended in <|message|>: start the grammar its message gets, if any."""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1).removeprefix("functions.")
            if recipient.group(1).startswith("functions.") and name in self._tools:
                self._enter(self._tools[name], CALL)
            return
        channel = _CHANNEL.search(header)
        if channel is not None and channel.group(1) == FINAL and self.spec.final is not None:
            self._enter(self.spec.final, RETURN)

    def _enter(self, grammar: str, end: int) -> None:
        self._matcher = matcher_for(grammar)
        self._end, self._failed = end, False


def _one_id(token_id: int) -> np.ndarray:
    words = np.zeros(MASK_WORDS, dtype=np.uint32)
    words[token_id // 32] = np.uint32(1 << (token_id % 32))
    return words


_TEMPLATES: "OrderedDict[str, Any]" = OrderedDict()  # grammar -> a compiled matcher never fed a token
_TEMPLATES_LOCK = threading.Lock()
MAX_TEMPLATES = 64


def matcher_for(grammar: str):
    """A fresh llguidance matcher for `grammar`: a copy of a cached compiled one (a copy costs ~1% of a compile)."""
    import llguidance

    with _TEMPLATES_LOCK:
        template = _TEMPLATES.get(grammar)
        if template is not None:
            _TEMPLATES.move_to_end(grammar)
            return template.deep_copy()
    template = llguidance.LLMatcher(harmony_tokenizer(), grammar, log_level=0)  # compiled outside the lock
    with _TEMPLATES_LOCK:
        _TEMPLATES[grammar] = template
        while len(_TEMPLATES) > MAX_TEMPLATES:
            _TEMPLATES.popitem(last=False)
    return template.deep_copy()


def forced_call_grammar(tools: list[tuple[str, dict | None]], reasoning_tokens: int) -> str:
    """The grammar of an output that must call one of `tools` (tool_choice naming one, or 'required'), from the
    output's first token (the prompt ends in `<|start|>assistant`): gpt-oss's order before a call, an optional
    analysis message and an optional preamble (a commentary message to the user), each of at most
    `reasoning_tokens` tokens of text (then only `<|end|>` is allowed) and followed by `<|start|>assistant`; then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` for one of the tools and its arguments:
    JSON held to the tool's schema, or any JSON object for a tool without one (None: not strict). 0 reasoning
    tokens: the call at once. The header is gpt-oss's own spelling of a call."""
    lines = ['start: analysis? preamble? call' if reasoning_tokens > 0 else 'start: call',
             'call: <|channel|> "commentary" " to=functions" (' + " | ".join(f"call{i}" for i in range(len(tools))) + ")"]
    if reasoning_tokens > 0:
        lines += ['analysis: <|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant"',
                  'preamble: <|channel|> "commentary" <|message|> thought <|end|> <|start|> "assistant"',
                  f"thought[max_tokens={int(reasoning_tokens)}]: /(?s:.*)/"]
    for i, (name, schema) in enumerate(tools):
        lines.append(f"call{i}: {json.dumps('.' + name)} \" \" <|constrain|> \"json\" <|message|> args{i}")
        held = schema if schema is not None else {"type": "object"}
        lines.append(f"args{i}: %json {json.dumps({**held, 'x-guidance': JSON_OPTIONS})}")  # compact, as json_grammar
    return "\n".join(lines) + "\n"


def is_plain_text(fmt: dict | None) -> bool:
    """An OpenAI response format that asks for nothing structured (absent, or type 'text')."""
    return not fmt or fmt.get("type", "text") == "text"


def response_format_grammar(fmt: dict | None, param: str) -> tuple[str | None, dict | None]:
    """(grammar, Harmony response-format section or None) of an OpenAI response format: chat's
    `response_format` or Responses' `text.format` (`json_schema` nested or flat). None: plain text."""
    if is_plain_text(fmt):
        return None, None
    if fmt["type"] == "json_object":
        return check_json_schema({"type": "object"}, param), None
    spec = fmt.get("json_schema", fmt)  # Chat nests it; Responses puts the fields beside "type"
    schema = spec.get("schema", {})
    grammar = check_json_schema(schema, f"{param}.schema" if spec is fmt else f"{param}.json_schema.schema")
    section = {"name": spec.get("name") or "response", "description": spec.get("description") or "",
               "schema": schema}
    return grammar, section


def response_format_text(section: dict) -> str:
    """The developer message's `# Response Formats` section (Harmony guide, "Structured output")."""
    lines = ["# Response Formats", "", f"## {section['name']}", ""]
    if section["description"]:
        lines.append(f"// {section['description']}")
    lines.append(json.dumps(section["schema"], separators=(",", ":")))
    return "\n".join(lines)
