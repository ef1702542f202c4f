"""The streaming parser: agrees with openai-harmony on valid output, recovers from invalid output."""

from __future__ import annotations

import logging
import random

import pytest
from openai_harmony import Role

from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.parse import HarmonyOutputParser, ItemDelta, ItemDone, ItemKind, ItemStarted, classify

ENC = load_harmony_encoding()
TEXTS = ["Hello", " world", "日本語のテキスト", "🦄🧑‍🚀", "{\"a\": [1, 2]}", "naïve café", "x" * 40, "\n\n- item\n",
         "emoji at end 🎉", "3 < 4 > 2"]


def tokens(text: str) -> list[int]:
    return ENC.encode(text, allowed_special="all")


def run(ids: list[int]) -> tuple[list, HarmonyOutputParser]:
    parser = HarmonyOutputParser(ENC)
    events = [e for t in ids for e in parser.feed(t)]
    return events + parser.finish(), parser


def items(events: list) -> list[tuple[ItemKind, str, str | None]]:
    return [(e.kind, e.text, e.tool_name) for e in events if isinstance(e, ItemDone)]


def check_event_invariants(events: list) -> None:
    started = [e.index for e in events if isinstance(e, ItemStarted)]
    done = [e for e in events if isinstance(e, ItemDone)]
    assert started == [d.index for d in done] == list(range(len(started)))
    for d in done:
        assert d.text == "".join(e.text for e in events if isinstance(e, ItemDelta) and e.index == d.index)


def random_valid_output(rng: random.Random) -> str:
    """1-4 assistant messages as gpt-oss writes them (the first header continues `<|start|>assistant`)."""
    parts = []
    for n in range(rng.randint(1, 4)):
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 4)))
        kind = rng.choice(["analysis", "final", "preamble", "call_commentary", "call_analysis", "call_role"])
        head = "" if n == 0 else "<|start|>assistant"
        if kind in ("analysis", "final"):
            header = f"<|channel|>{kind}"
        elif kind == "preamble":
            header = "<|channel|>commentary"
        elif kind == "call_commentary":
            header = f"<|channel|>commentary to=functions.fn_{n} <|constrain|>json"
        elif kind == "call_analysis":
            header = f"<|channel|>analysis to=functions.fn_{n} <|constrain|>json"
        else:  # recipient in the role part of the header
            header = f" to=functions.fn_{n}<|channel|>commentary json"
        end = rng.choice(["<|end|>", "<|return|>", "<|call|>"]) if n == 3 else "<|end|>"
        parts.append(f"{head}{header}<|message|>{text}{end}")
    return "".join(parts)


@pytest.mark.parametrize("seed", range(60))
def test_valid_output_matches_openai_harmony(seed):
    rng = random.Random(seed)
    ids = tokens(random_valid_output(rng))
    if rng.random() < 0.4:  # cut by max_tokens mid-message
        ids = ids[: rng.randint(1, len(ids))]
    events, parser = run(ids)
    check_event_invariants(events)
    assert not parser.warned
    reference = ENC.parse_messages_from_completion_tokens(ids, Role.ASSISTANT, strict=False) if _complete(ids) else None
    if reference is not None:
        expected = []
        for m in reference:
            kind, tool = classify(m.channel, m.recipient)
            expected.append((kind, "".join(c.text for c in m.content), tool))
        assert items(events) == expected


def _complete(ids: list[int]) -> bool:
    """Whether the cut left the output at a message boundary or inside content (the reference parser
    rejects a cut inside a header)."""
    try:
        ENC.parse_messages_from_completion_tokens(ids, Role.ASSISTANT, strict=False)
    except Exception:  # noqa: BLE001 - the reference raises HarmonyError subclasses and ValueError alike
        return False
    return True


def test_tool_call_on_analysis_channel_is_a_tool_call():
    events, _ = run(tokens("<|channel|>analysis to=functions.lookup <|constrain|>json<|message|>{\"q\":\"x\"}<|call|>"))
    assert items(events) == [(ItemKind.TOOL_CALL, "{\"q\":\"x\"}", "lookup")]


def test_channels_map_to_kinds():
    out = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>plan<|end|>"
           "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>{}<|call|>")
    events, _ = run(tokens(out))
    assert items(events) == [(ItemKind.REASONING, "think", None), (ItemKind.CONTENT, "plan", None),
                             (ItemKind.TOOL_CALL, "{}", "f")]
    started = [e for e in events if isinstance(e, ItemStarted)]
    assert [e.channel for e in started] == ["analysis", "commentary", "commentary"]


def test_builtin_tool_recipient_is_not_a_function_call():
    events, _ = run(tokens("<|channel|>analysis to=browser.search<|message|>{\"query\":\"x\"}<|end|>"))
    assert items(events) == [(ItemKind.REASONING, "{\"query\":\"x\"}", None)]


def test_last_token_kind_attributes_tokens():
    parser = HarmonyOutputParser(ENC)
    kinds = []
    for t in tokens("<|channel|>analysis<|message|>ab<|end|><|start|>assistant<|channel|>final<|message|>cd<|return|>"):
        parser.feed(t)
        kinds.append(parser.last_token_kind)
    texts = [k for k in kinds if k is not None]
    assert texts == [ItemKind.REASONING] * len(tokens("ab")) + [ItemKind.CONTENT] * len(tokens("cd"))


def test_plain_text_becomes_content_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="serve_app.harmony.parse"):
        events, parser = run(tokens("Just plain text, no Harmony at all."))
    assert items(events) == [(ItemKind.CONTENT, "Just plain text, no Harmony at all.", None)]
    assert parser.warned and len([r for r in caplog.records if "not valid Harmony" in r.message]) == 1


def test_control_token_inside_a_header_is_not_swallowed():
    # StreamableParser itself keeps <|return|> as header text; the words must still reach the user.
    events, parser = run(tokens("No header here.<|return|>"))
    assert items(events) == [(ItemKind.CONTENT, "No header here.", None)] and parser.warned


def test_garbage_after_end_is_recovered_then_harmony_resumes(caplog):
    out = ("<|channel|>final<|message|>Good.<|end|>stray words<|return|> more"
           "<|start|>assistant<|channel|>final<|message|>Back.<|return|>")
    with caplog.at_level(logging.WARNING):
        events, parser = run(tokens(out))
    check_event_invariants(events)
    assert items(events) == [(ItemKind.CONTENT, "Good.", None), (ItemKind.CONTENT, "stray words more", None),
                             (ItemKind.CONTENT, "Back.", None)]
    assert parser.warned


def test_endless_header_is_recovered_as_text():
    parser = HarmonyOutputParser(ENC, max_header_tokens=8)
    text = "This model forgot the header and keeps talking for a while."
    events = [e for t in tokens(text) for e in parser.feed(t)]
    assert any(isinstance(e, ItemDelta) for e in events)  # streamed before the end, not held back
    events += parser.finish()
    assert items(events) == [(ItemKind.CONTENT, text, None)]


def test_header_cut_by_max_tokens_is_dropped_quietly():
    events, parser = run(tokens("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin"))
    assert items(events) == [(ItemKind.REASONING, "hm", None)]
    assert not parser.warned


def test_constrain_in_header_never_errors():
    out = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\":1}<|call|>"
    events, parser = run(tokens(out))
    assert items(events) == [(ItemKind.TOOL_CALL, "{\"x\":1}", "f")] and not parser.warned


def test_split_utf8_is_never_emitted_half():
    events, _ = run(tokens("<|channel|>final<|message|>🧑‍🚀🦄日本<|return|>"))
    deltas = [e.text for e in events if isinstance(e, ItemDelta)]
    assert "".join(deltas) == "🧑‍🚀🦄日本" and all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("seed", range(4))
def test_random_tokens_never_raise(seed):
    rng = random.Random(seed)
    pieces = [tokens(t) for t in ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>",
                                  "<|return|>", "<|call|>", "<|start|>", "assistant", " to=functions.f",
                                  "<|constrain|>", "json", " word", "🦄", "{\"a\": 1}"]]
    pieces += [[199999], [200000], [201087]]  # endoftext and reserved tokens
    for _ in range(150):
        ids = [t for _ in range(rng.randint(0, 40)) for t in rng.choice(pieces)]
        events, _ = run(ids)
        check_event_invariants(events)


@pytest.mark.parametrize("max_header_tokens", [5, 1000])
def test_recovered_header_tokens_are_reported_once_in_order(max_header_tokens):
    """Plain text where a header belongs: every text token ends up either reported as content when fed
    (last_token_kind) or, later, through take_recovered(); never both, never lost, in output order."""
    ids = ENC.encode("plain words where a header should be, repeated words words", allowed_special="all")
    parser = HarmonyOutputParser(ENC, max_header_tokens=max_header_tokens)
    placed: list[int] = []
    unplaced: list[int] = []
    for token_id in ids:
        parser.feed(token_id)
        recovered = parser.take_recovered()
        assert recovered == unplaced[len(unplaced) - len(recovered):] if recovered else True
        placed += recovered
        unplaced = unplaced[: len(unplaced) - len(recovered)] if recovered else unplaced
        (placed if parser.last_token_kind is ItemKind.CONTENT else unplaced).append(token_id)
    parser.finish()
    placed += parser.take_recovered()
    assert placed == ids
