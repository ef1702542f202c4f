"""The prefill epilogues' switches compile for sm_90 (no GPU needed: Triton's bundled ptxas) and change the code as
their reason says (kernels/moe/NOTES.md, item 5; `python -m bench.sm90_sass` prints the table): the SFU sigmoid's
inline PTX assembles and replaces the full-range divisions, the word loads and the per-block reciprocal issue fewer
instructions. Outputs are compared elsewhere (interpreter cases, GPU tests); this sees what those cannot on a CPU: the
inline assembly itself, and a refactor that keeps the outputs but loses the instruction savings."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from bench import sm90_sass  # noqa: E402


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton")))
    try:
        rows = sm90_sass.rows()
    finally:
        mp.undo()
    tiles = {(r["WORDS"], r["MUFU"]): r for r in rows if r["kernel"] == "swiglu tiles"}
    dispatch = {r["FAST_DIV"]: r for r in rows if r["kernel"] == "dispatch quant"}
    return tiles, dispatch


def test_sfu_sigmoid_replaces_the_divisions(table):
    tiles, _ = table
    for words in (False, True):
        mufu, plain = tiles[words, True], tiles[words, False]
        assert mufu["ex2.approx.ftz.f32"] == mufu["rcp.approx.ftz.f32"] > 0, mufu
        assert mufu["div.full.f32"] == 0 < plain["div.full.f32"], (mufu, plain)
        assert plain["ex2.approx.ftz.f32"] == plain["rcp.approx.ftz.f32"] == 0, plain
        assert mufu["sass"] < plain["sass"], (mufu, plain)


def test_word_loads_issue_fewer_instructions(table):
    tiles, _ = table
    for mufu in (False, True):
        words, halves = tiles[True, mufu], tiles[False, mufu]
        assert words["ld.global"] < halves["ld.global"], (words, halves)
        assert words["st.shared"] < halves["st.shared"], (words, halves)  # no split of the interleaved tile
        assert words["sass"] < halves["sass"], (words, halves)
    assert tiles[True, True]["sass"] < tiles[True, False]["sass"] < tiles[False, False]["sass"]


def test_dispatch_fast_division_divides_once_per_block(table):
    _, dispatch = table
    assert dispatch[True]["div.rn.f32"] < dispatch[False]["div.rn.f32"], dispatch
    assert dispatch[True]["sass"] < dispatch[False]["sass"], dispatch
