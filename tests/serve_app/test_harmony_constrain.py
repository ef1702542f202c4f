"""Structured output over Harmony (serve_app/harmony/constrain.py) with the real llguidance and the Harmony
vocabulary: the reasoning is free, the final answer and strict tool calls are held to their schemas, each
message ends with its own end token, and random walks through the masks always produce valid JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.request import InvalidRequestError
from serve_app.harmony.constrain import (CALL, FINAL, HARMONY_VOCAB_SIZE, RETURN, HarmonySchemaSpec,
                                         check_json_schema, harmony_tokenizer, response_format_grammar,
                                         response_format_text)
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.render import FunctionTool, Prompt, UserMessage, render_prompt

ENC = load_harmony_encoding()
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "unit", "days", "alerts", "tags"],
    "additionalProperties": False,
}


def ids(text: str) -> list[int]:
    return ENC.encode(text, allowed_special="all")


def allowed(words: np.ndarray | None) -> np.ndarray | None:
    """The allowed ids of a packed mask (None stays None)."""
    if words is None:
        return None
    assert words.dtype == np.uint32 and words.shape == ((HARMONY_VOCAB_SIZE + 31) // 32,)
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:HARMONY_VOCAB_SIZE])


def valid(doc, schema=SCHEMA) -> bool:
    """The subset of JSON schema used here, checked directly."""
    if "enum" in schema:
        return doc in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return isinstance(doc, dict) and set(schema.get("required", [])) <= set(doc) and \
            (schema.get("additionalProperties", True) is not False or set(doc) <= set(props)) and \
            all(valid(v, props[k]) for k, v in doc.items() if k in props)
    if kind == "string":
        return isinstance(doc, str) and len(doc) <= schema.get("maxLength", len(doc))
    if kind == "integer":
        return isinstance(doc, int) and not isinstance(doc, bool) and \
            schema.get("minimum", doc) <= doc <= schema.get("maximum", doc)
    if kind == "boolean":
        return isinstance(doc, bool)
    if kind == "array":
        return isinstance(doc, list) and len(doc) <= schema.get("maxItems", len(doc)) and \
            all(valid(v, schema["items"]) for v in doc)
    return True


def spec(**kw) -> HarmonySchemaSpec:
    return HarmonySchemaSpec(**kw)


def walk(constraint, rng, end: int) -> list[int]:
    """A random walk through the masks: uniformly among the allowed ids, `end` as soon as it is allowed; the tokens
    before it (the test fails without it within 400)."""
    out: list[int] = []
    for _ in range(400):
        a = allowed(constraint.allowed_tokens())
        assert a is not None  # the grammar holds every token of the output
        t = end if end in a else int(rng.choice(a))
        constraint.accept(t)
        if t == end:
            return out
        out.append(t)
    pytest.fail(f"no {ENC.decode([end])} within 400 tokens")


def feed(constraint, tokens: list[int]) -> list[np.ndarray | None]:
    """Accept tokens one by one (each must be allowed); the allowed set before each."""
    seen = []
    for t in tokens:
        a = allowed(constraint.allowed_tokens())
        assert a is None or t in a, (t, ENC.decode([t]))
        seen.append(a)
        constraint.accept(t)
    return seen


def test_the_tokenizer_is_built_once_whoever_asks_first():
    from serve_app.harmony.constrain import _build_tokenizer, warm_up_in_background

    threads = [warm_up_in_background() for _ in range(3)]
    first = harmony_tokenizer()
    for t in threads:
        t.join(timeout=60)
    assert harmony_tokenizer() is first and _build_tokenizer.cache_info().misses == 1


def test_the_tokenizer_is_harmonys():
    tok = harmony_tokenizer()
    for text in ("Hello world", "  spaced\n\nlines\t", "naïve café 東京 🙂", '{"a":[1,2.5e-3,true,null]}'):
        assert tok.tokenize_str(text) == ENC.encode(text, allowed_special=set())
    header = ids("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert tok.decode_str(header) == "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    assert all(tok.is_special_token(t) for t in (RETURN, CALL, 200005, 200008))


def test_reasoning_is_free_and_the_final_answer_is_held_to_the_schema():
    c = spec(final=check_json_schema(SCHEMA, "s")).start(HARMONY_VOCAB_SIZE)
    reasoning = ids("<|channel|>analysis<|message|>Need JSON. {not json} <|end|><|start|>assistant")
    assert all(a is None for a in feed(c, reasoning))  # nothing constrains the analysis
    assert all(a is None for a in feed(c, ids("<|channel|>final<|message|>")))
    doc = '{"city":"Paris","unit":"celsius","days":3,"alerts":false,"tags":["a","b"]}'
    first = feed(c, ids(doc))[0]  # (one mask per token: a second call before accept() means "the next one")
    assert first is not None and ids('{"')[0] in first and ids("Sure")[0] not in first  # keys in schema order
    assert not set(first) & {RETURN, CALL, 200007, 200005}  # no special token before the JSON is whole
    assert allowed(c.allowed_tokens()).tolist() == [RETURN]  # whole: only the answer's end
    c.accept(RETURN)
    assert c.allowed_tokens() is None and not c.active


def test_look_ahead_only_where_one_more_token_cannot_start_a_grammar():
    """The engine may sample past an unread token in a free body or between messages; not in a header (the
    unread token may be the <|message|> that starts a grammar), nor inside a grammar."""
    c = spec(final=check_json_schema(SCHEMA, "s")).start(HARMONY_VOCAB_SIZE)
    states = []
    for t in ids("<|channel|>analysis<|message|>x y<|end|><|start|>assistant<|channel|>final<|message|>{"):
        c.accept(t)
        states.append(c.can_look_ahead())
    # header (2 tokens), body after <|message|>, body, body, after <|end|>, header from <|start|> on, grammar
    assert states == [False, False, True, True, True, True, False, False, False, False, False, False], states


def one_at_a_time(grammar: str, start: str, rng) -> tuple[list[int], list]:
    """A random walk of a constraint fed one token at a time: the text `start`, then random allowed ids until
    the answer's end (at most 300 tokens); (tokens, the mask before each)."""
    sync = spec(final=grammar).start(HARMONY_VOCAB_SIZE)
    tokens, masks = ids(start), []
    for t in tokens:
        masks.append(allowed(sync.allowed_tokens()))
        sync.accept(t)
    while len(tokens) < 300:
        a = allowed(sync.allowed_tokens())
        t = RETURN if RETURN in a else int(rng.choice(a))
        masks.append(a)
        sync.accept(t)
        tokens.append(t)
        if t == RETURN:
            break
    return tokens, masks


@pytest.mark.parametrize("seed", range(4))
def test_looking_ahead_past_forced_tokens_gives_the_masks_of_one_at_a_time(seed):
    """The engine's order with its lookahead (the next mask asked for before the token in flight is reported,
    where can_look_ahead() allows it) gives every step the mask of a constraint fed one token at a time; and
    it looks ahead inside the JSON (where a mask allowed one id) as well as in the free reasoning."""
    grammar = check_json_schema(SCHEMA, "s")
    ahead = spec(final=grammar).start(HARMONY_VOCAB_SIZE)
    tokens, masks = one_at_a_time(grammar, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
                                           "<|channel|>final<|message|>", np.random.default_rng(seed))
    looked, inside = 0, 0
    got = [allowed(ahead.allowed_tokens())]
    for k, t in enumerate(tokens[:-1]):
        if ahead.can_look_ahead():
            looked += 1
            inside += ahead.active
            got.append(allowed(ahead.allowed_tokens()))  # mask k + 1 while token k is in flight
            ahead.accept(t)
        else:
            ahead.accept(t)
            got.append(allowed(ahead.allowed_tokens()))
    assert len(got) == len(masks)
    for k, (g, m) in enumerate(zip(got, masks)):
        assert (g is None and m is None) or (g is not None and m is not None and np.array_equal(g, m)), k
    assert looked > 3 and inside > 0, (looked, inside)


@pytest.mark.parametrize("seed", range(4))
def test_forced_token_drafts_give_the_masks_of_one_at_a_time(seed):
    """Jump-forward: the engine's order with forced-token drafts (forced_tokens(k), then the masks of the draft's
    k + 1 rows, then the k + 1 tokens reported), with one token in flight (where can_look_ahead() allows) or
    none, gives every position the mask of a constraint fed one token at a time, and the drafts are the
    tokens those masks force."""
    rng = np.random.default_rng(seed)
    grammar = check_json_schema(SCHEMA, "s")
    jump = spec(final=grammar).start(HARMONY_VOCAB_SIZE)
    tokens, masks = one_at_a_time(grammar, "<|channel|>final<|message|>", rng)
    pos, drafted, in_flight = 0, 0, False
    while pos < len(tokens):
        limit = int(rng.integers(1, 9))
        if in_flight and not jump.can_look_ahead():  # the engine reads such a token before the next masks
            jump.accept(tokens[pos])
            pos, in_flight = pos + 1, False
        if in_flight:  # the mask of `pos` was given last time; its token not reported yet
            draft = jump.forced_tokens(limit)
            if draft:  # the token in flight was forced: the draft follows it
                assert draft == tokens[pos + 1: pos + 1 + len(draft)]
            rows = [allowed(jump.allowed_tokens()) for _ in range(len(draft) + 1)]
            expected = masks[pos + 1: pos + 2 + len(draft)]
            jump.accept(tokens[pos])
            pos += 1
        else:
            draft = jump.forced_tokens(limit)
            assert draft == tokens[pos: pos + len(draft)]
            rows = [allowed(jump.allowed_tokens()) for _ in range(len(draft) + 1)]
            expected = masks[pos: pos + 1 + len(draft)]
        assert len(expected) == min(len(rows), len(tokens) - pos)  # (rows past the output's end: nothing to check)
        for k, (g, m) in enumerate(zip(rows, expected)):
            assert (g is None and m is None) or (g is not None and m is not None and np.array_equal(g, m)), (pos, k)
        drafted += len(draft)
        for t in tokens[pos: pos + len(draft)]:  # the draft's tokens reported; the last row's stays in flight
            jump.accept(t)
        pos += len(draft)
        in_flight = pos < len(tokens)
    assert drafted > 10, drafted  # the keys and punctuation of five required keys are forced


def test_a_strict_tool_call_is_held_and_ends_with_call_either_header_form():
    grammar = check_json_schema({"type": "object", "properties": {"q": {"enum": ["x"]}}, "required": ["q"],
                                 "additionalProperties": False}, "t")
    for header in ("<|channel|>commentary to=functions.search <|constrain|>json<|message|>",
                   "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"):
        c = spec(tools=(("search", grammar),)).start(HARMONY_VOCAB_SIZE)
        feed(c, ids(header))
        assert c.active
        feed(c, ids('{"q":"x"}'))
        assert allowed(c.allowed_tokens()).tolist() == [CALL]
        c.accept(CALL)
        assert not c.active
    # a tool without a schema (not strict), and a final answer without a response format: free
    c = spec(tools=(("search", grammar),)).start(HARMONY_VOCAB_SIZE)
    assert all(a is None for a in feed(c, ids("<|channel|>commentary to=functions.other <|constrain|>json<|message|>"
                                                "not json<|call|>")))
    assert all(a is None for a in feed(c, ids("<|start|>assistant<|channel|>final<|message|>free text")))


def test_a_forced_call_and_a_raw_completion_start_inside_their_grammar():
    grammar = check_json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}}, "required": ["n"]}, "t")
    c = spec(tools=(("count", grammar),), start_in="count").start(HARMONY_VOCAB_SIZE)
    assert ids('{"')[0] in feed(c, ids('{"n":7}'))[0]
    assert allowed(c.allowed_tokens()).tolist() == [CALL]
    c = spec(final=grammar, start_in=FINAL).start(HARMONY_VOCAB_SIZE)
    feed(c, ids('{"n":0}'))
    assert allowed(c.allowed_tokens()).tolist() == [RETURN]


def forced(tools, reasoning_tokens):
    from serve_app.harmony.constrain import FORCED_CALL, forced_call_grammar

    return spec(start_in=FORCED_CALL, forced_call=forced_call_grammar(tools, reasoning_tokens)).start(HARMONY_VOCAB_SIZE)


@pytest.mark.parametrize("seed", range(8))
def test_a_forced_call_may_reason_then_calls_one_of_the_tools(seed):
    """tool_choice forcing a call among several tools: random walks through the masks (the prompt ends in
    `<|start|>assistant`) write at most an analysis message and a preamble, in that order, of at most 6 tokens
    each, then `.NAME` of one of the tools, the rest of the header, arguments held to that tool's schema, then
    only <|call|>. The walks pick among the allowed tokens, so the paths with and without reasoning come up."""
    search = {"type": "object", "properties": {"q": {"enum": ["x", "y"]}}, "required": ["q"],
              "additionalProperties": False}
    out = walk(forced([("get_weather", SCHEMA), ("search", search)], 6), np.random.default_rng(seed), CALL)
    *before, call = ENC.decode(out).split("<|end|><|start|>assistant")
    assert [m.split("<|message|>")[0] for m in before] in ([], ["<|channel|>analysis"], ["<|channel|>commentary"],
                                                          ["<|channel|>analysis", "<|channel|>commentary"])
    end = ids("<|end|>")[0]
    while end in out:  # each message before the call: at most 6 tokens of text
        thought, out = out[out.index(ids("<|message|>")[0]) + 1:out.index(end)], out[out.index(end) + 1:]
        assert len(thought) <= 6 and not any(t >= 199998 for t in thought)
    head, rest = call.split(" <|constrain|>json<|message|>")
    name = head.removeprefix("<|channel|>commentary to=functions.")
    assert name in ("get_weather", "search") and valid(json.loads(rest), SCHEMA if name == "get_weather" else search)


def test_a_forced_call_ends_its_reasoning_at_the_budget_and_writes_no_answer():
    """After the budget only <|end|> is allowed, then the next message's start and its channel are forced (one id
    each: jump-forward drafts); then a preamble of the same budget may come, or the call; a final answer, a second
    analysis or another end token is never allowed."""
    c = forced([("get_weather", SCHEMA)], 3)
    assert allowed(c.allowed_tokens()).tolist() == ids("<|channel|>")
    c.accept(ids("<|channel|>")[0])
    first = allowed(c.allowed_tokens())
    assert ids("analysis")[0] in first and ids("final")[0] not in first and ids("comment")[0] in first
    c.accept(ids("analysis")[0])
    body = feed(c, ids("<|message|>Need the weather"))
    assert all(a is None or RETURN not in a for a in body)
    assert allowed(c.allowed_tokens()).tolist() == ids("<|end|>")  # 3 tokens of text: the budget
    c.accept(ids("<|end|>")[0])
    assert c.forced_tokens(4) == ids("<|start|>assistant<|channel|>comment")  # no second analysis
    feed(c, ids("<|start|>assistant<|channel|>commentary<|message|>Checking the<|end|><|start|>assistant"
                "<|channel|>commentary"))
    assert c.forced_tokens(3) == ids(" to=functions")  # one preamble: now the call
    feed(c, ids(' to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","unit":"celsius","days":2,'
                '"alerts":false,"tags":[]}'))
    assert allowed(c.allowed_tokens()).tolist() == [CALL]


def test_a_forced_call_without_reasoning_and_a_tool_without_a_schema():
    """Budget 0: the call at once (the header forced token by token); a tool without a schema (not strict) gets
    any JSON object as its arguments."""
    c = forced([("get_weather", SCHEMA), ("note", None)], 0)
    header = ids("<|channel|>commentary to=functions")
    assert c.forced_tokens(len(header) + 1) == header  # then the choice of a function
    feed(c, ids('<|channel|>commentary to=functions.note <|constrain|>json<|message|>{"any":[1,{"thing":null}]}'))
    assert allowed(c.allowed_tokens()).tolist() == [CALL]
    c = forced([("get_weather", SCHEMA), ("note", None)], 0)
    feed(c, ids("<|channel|>commentary to=functions.note <|constrain|>json<|message|>"))
    assert ids("[")[0] not in allowed(c.allowed_tokens())  # an object, not any JSON value
    with pytest.raises(ValueError, match="forced_call"):
        spec(start_in="functions")


def test_a_token_the_grammar_rejects_closes_the_message_instead_of_hanging():
    c = spec(final=check_json_schema(SCHEMA, "s"), start_in=FINAL).start(HARMONY_VOCAB_SIZE)
    c.accept(ids("Sure")[0])  # not allowed (a sampler never does this): the matcher fails
    assert allowed(c.allowed_tokens()).tolist() == [RETURN]


@pytest.mark.parametrize("seed", range(12))
def test_random_walks_through_the_masks_are_valid_json(seed):
    """Pick uniformly among the allowed ids (the end token as soon as it is allowed) until the message ends:
    the text is JSON that satisfies the schema, whatever the path."""
    c = spec(final=check_json_schema(SCHEMA, "s"), start_in=FINAL).start(HARMONY_VOCAB_SIZE)
    doc = json.loads(ENC.decode(walk(c, np.random.default_rng(seed), RETURN)))
    assert valid(doc), doc


def test_grammars_compile_once_per_process_and_copies_are_independent():
    from serve_app.harmony.constrain import _TEMPLATES, matcher_for

    grammar = check_json_schema({"type": "object", "properties": {"unique_key_for_this_test": {"type": "boolean"}},
                                 "required": ["unique_key_for_this_test"]}, "s")
    assert grammar not in _TEMPLATES
    spec(final=grammar).prepare()
    template = _TEMPLATES[grammar]
    a, b = matcher_for(grammar), matcher_for(grammar)
    assert _TEMPLATES[grammar] is template and a is not b
    assert a.consume_tokens(ids('{"unique_key_for_this_test":true}'))
    assert a.is_accepting() and not b.is_accepting()  # b still at the start
    assert b.consume_tokens(ids('{"unique_key_for_this_test":false}')) and b.is_accepting()


def test_specs_and_formats_are_checked():
    with pytest.raises(ValueError, match="start_in"):
        spec(tools=(("a", "g"),), start_in="b")
    with pytest.raises(ValueError, match="final grammar"):
        spec(start_in=FINAL)
    with pytest.raises(InvalidRequestError, match="Harmony vocabulary") as err:
        spec(final=check_json_schema(True, "s")).start(1000)
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="foo") as err:
        check_json_schema({"type": "foo"}, "response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"
    assert response_format_grammar({"type": "text"}, "f") == (None, None)
    grammar, section = response_format_grammar({"type": "json_object"}, "f")
    assert grammar and section is None
    nested = {"type": "json_schema", "json_schema": {"name": "w", "description": "weather", "schema": SCHEMA}}
    flat = {"type": "json_schema", "name": "w", "description": "weather", "schema": SCHEMA}
    assert response_format_grammar(nested, "f") == response_format_grammar(flat, "f")
    assert response_format_text(response_format_grammar(nested, "f")[1]) == \
        "# Response Formats\n\n## w\n\n// weather\n" + json.dumps(SCHEMA, separators=(",", ":"))


def test_the_response_format_section_ends_the_developer_message():
    section = response_format_text({"name": "w", "description": "", "schema": {"type": "object"}})
    tools = [FunctionTool("f", "does f", {"type": "object", "properties": {"a": {"type": "string"}}})]
    plain = ENC.decode(render_prompt(Prompt([UserMessage("hi")], instructions="Be brief.", tools=tools)))
    text = ENC.decode(render_prompt(Prompt([UserMessage("hi")], instructions="Be brief.", tools=tools,
                                           response_format=section)))
    developer_end = plain.index("<|end|>", plain.index("<|start|>developer"))
    assert text == plain[:developer_end] + "\n\n" + section + plain[developer_end:]
    assert "Calls to these tools must go to the commentary channel" in text  # what the tools add stays
    alone = ENC.decode(render_prompt(Prompt([UserMessage("hi")], response_format=section)))
    assert f"<|start|>developer<|message|>{section}<|end|>" in alone


@pytest.mark.parametrize("seed", range(6))
def test_a_constraint_started_after_an_output_is_where_that_output_left_one(seed):
    """HarmonySchemaSpec.after (a streamed background response taken up by another replica): a constraint started
    past a prefix of a random walk allows at every later position what the constraint that wrote the prefix allows,
    for a schema final answer and a forced call (which reasons first, then calls), cut anywhere, masks of forced
    tokens (jump-forward) included."""
    from serve_app.harmony.constrain import FORCED_CALL, forced_call_grammar

    rng = np.random.default_rng(seed)
    for kw, end in ((dict(final=check_json_schema(SCHEMA, "s"), start_in=FINAL), RETURN),
                    (dict(start_in=FORCED_CALL, forced_call=forced_call_grammar([("get_weather", SCHEMA)], 6)), CALL)):
        out = walk(spec(**kw).start(HARMONY_VOCAB_SIZE), rng, end) + [end]
        cut = int(rng.integers(0, len(out)))
        whole, resumed = spec(**kw).start(HARMONY_VOCAB_SIZE), spec(**kw, after=tuple(out[:cut])).start(
            HARMONY_VOCAB_SIZE)
        feed(whole, out[:cut])
        for t in out[cut:]:
            want, got = allowed(whole.allowed_tokens()), allowed(resumed.allowed_tokens())
            assert (want is None and got is None) or np.array_equal(want, got), (seed, cut, ENC.decode([t]))
            whole.accept(t)
            resumed.accept(t)
