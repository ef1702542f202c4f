"""The ingress refuses text whose unbroken runs the Harmony tokenizer would take seconds on (text_limits.py)."""

from __future__ import annotations

import base64
import itertools
import random
import unicodedata

import pytest

from engine.request import InvalidRequestError
from serve_app.harmony.render import Prompt, ToolResult, UserMessage, FunctionTool, render_prompt
from serve_app.harmony.text_limits import RUN_BUDGET, RUN_MIN_BYTES, check_tokenizable, long_runs

ALPHABET = ["x", "Q", "é", "a\u0301", "中", "ก", "😀", "-", "!", "_", " ", "\n", "\t", "\u3000", "7", "٣", "\x00"]


def reference_runs(text: str) -> list[int]:
    """The same runs one character at a time: unicodedata's category, str.isspace."""
    def kind(c: str) -> str:
        cat = unicodedata.category(c)
        return "letter" if cat[0] in "LM" else "digit" if cat[0] == "N" else "space" if c.isspace() else "other"

    runs = []
    for k, group in itertools.groupby(text, key=kind):
        chars = "".join(group)
        if k != "digit" and len(chars) >= RUN_MIN_BYTES // 4:
            runs.append(len(chars.encode("utf-8")))
    return runs


@pytest.mark.parametrize("seed", range(6))
def test_runs_match_a_character_by_character_reference(seed):
    rng = random.Random(seed)
    pieces = []
    for _ in range(rng.randint(20, 60)):  # runs of awkward lengths around the 256-character floor
        pieces.append(rng.choice(ALPHABET) * rng.choice([1, 3, 85, 255, 256, 257, 341, 1023, 1025, 4099]))
    text = "".join(pieces)
    assert long_runs(text) == reference_runs(text)


def test_runs_by_class_and_bytes():
    assert long_runs("x" * 300) == [300]
    assert long_runs("é" * 300) == [600]
    assert long_runs("a\u0301" * 200) == [600]  # a letter and its combining mark: one run, as in the tokenizer
    assert long_runs("😀" * 300) == [1200]
    assert long_runs("\n" * 100 + " " * 200) == [300]  # whitespace of any kind is one run
    assert long_runs("7" * 5000) == []  # digits go to the tokenizer by threes
    assert long_runs("x" * 255 + "1" + "y" * 255) == []
    assert long_runs("x" * 300 + "!" * 300 + "x" * 10) == [300, 300]


def test_ordinary_text_passes():
    rng = random.Random(1)
    english = "The quick brown fox jumps over the lazy dog, 1234. " * 20000
    b64 = base64.b64encode(rng.randbytes(300_000)).decode()
    hex_ = rng.randbytes(100_000).hex()
    code = "def f(x):\n    return [i * x for i in range(10)]  # comment\n" * 5000
    cjk = "中文文本，包括标点符号。" * 20000
    check_tokenizable([("messages", english), ("messages", b64), ("messages", hex_), ("tools", code), ("m", cjk)])


def test_the_budget_is_the_sum_of_squared_runs_over_all_texts():
    side = int(RUN_BUDGET ** 0.5)  # 32 KiB
    check_tokenizable([("messages", "x" * side)])  # exactly the budget
    with pytest.raises(InvalidRequestError) as info:
        check_tokenizable([("messages", "x" * (side + 1))])
    assert info.value.param == "messages" and f"{side + 1:,} bytes" in str(info.value)
    half = "y" * (side * 7 // 10)  # 0.49 of the budget each: two pass, three do not, wherever they are
    check_tokenizable([("messages", half), ("tools", half + " " + "z" * (RUN_MIN_BYTES - 1))])
    with pytest.raises(InvalidRequestError) as info:
        check_tokenizable([("messages", half), ("tools", half + "1" + half + "!")])
    assert "3 unbroken run(s)" in str(info.value)
    many = ("w" * RUN_MIN_BYTES + " ") * (RUN_BUDGET // RUN_MIN_BYTES ** 2 + 1)  # 1,025 runs of 1 KiB
    with pytest.raises(InvalidRequestError):
        check_tokenizable([("prompt", many)])
    check_tokenizable([("prompt", ("w" * (RUN_MIN_BYTES - 1) + " ") * 5000)])  # shorter runs are not counted


def test_the_error_names_the_field_with_the_longest_run():
    with pytest.raises(InvalidRequestError) as info:
        check_tokenizable([("messages", "a" * 30_000), ("tools", "-" * 40_000), ("messages", "b" * 20_000)])
    assert info.value.param == "tools"


def test_render_prompt_checks_every_text_it_tokenizes():
    run = "x" * 100_000
    cases = [(Prompt([UserMessage(run)]), "messages"), (Prompt([UserMessage("hi")], instructions=run), "messages"),
             (Prompt([UserMessage("hi")], tools=[FunctionTool("f", description=run)]), "tools"),
             (Prompt([UserMessage("hi")], tools=[FunctionTool("f", parameters={"type": "object", "description": run})]),
              "tools"),
             (Prompt([UserMessage("q"), ToolResult("f", run)]), "messages")]
    for prompt, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            render_prompt(prompt)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        render_prompt(Prompt([UserMessage(run)]), "input")
    assert info.value.param == "input"
    assert render_prompt(Prompt([UserMessage("x" * 30_000)]))  # under the budget: rendered as before
