"""Stop strings over a stream of tokens (output_text.py), in-process: against a reference that
cuts the whole text at the earliest stop string, for every way of splitting the text into tokens,
and the hold-back rule (only a possible partial match is held; released once it cannot match)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service.generation.output_text import OutputText
from engine_service.model.byte_tokenizer import ByteStreamDecoder


class Pieces:
    """A stream decoder whose token i is the text pieces[i]."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = pieces

    def step(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(pieces: Sequence[str], stop: Sequence[str]) -> tuple[list[str], str | None, int]:
    """What each token released, the stop string matched, and how many tokens were pushed."""
    out = OutputText(Pieces(pieces), stop)
    released, pushed = [], 0
    for token in range(len(pieces)):
        released.append(out.push(token))
        pushed += 1
        if out.stop_string is not None:
            break
    else:
        released.append(out.flush())
    return released, out.stop_string, pushed


def reference(pieces: Sequence[str], stop: Sequence[str]) -> tuple[str, str | None]:
    """Generation ends at the first token after which the text holds a stop string; the text is
    cut before the earliest one in it then (the first listed of those starting at one place)."""
    text = ""
    for piece in pieces:
        text += piece
        found = [(text.find(s), i, s) for i, s in enumerate(stop) if s in text]
        if found:
            at, _, s = min(found)
            return text[:at], s
    return text, None


def test_a_stop_string_spanning_tokens_is_cut_and_named() -> None:
    released, stop, pushed = run(["Hello", " wor", "ld\n\nUs", "er: hi", " more"], ["\n\nUser:"])
    assert (released, stop, pushed) == (["Hello", " wor", "ld", ""], "\n\nUser:", 4)


def test_a_stop_string_starting_inside_one_token() -> None:
    assert run(["abcSTOPdef", "x"], ["STOP"]) == (["abc"], "STOP", 1)
    assert run(["xy", "zST", "OPq"], ["STOP"]) == (["xy", "z", ""], "STOP", 3)


def test_only_a_possible_partial_match_is_held_and_released_when_it_cannot_match() -> None:
    out = OutputText(Pieces(["ab", "S", "T", "x", "S"]), ["STOP"])
    assert [out.push(0), out.push(1), out.push(2), out.push(3)] == ["ab", "", "", "STx"]
    assert out.push(4) == ""  # "S" held: it may start "STOP"
    assert out.flush() == "S" and out.stop_string is None
    assert out.flush() == ""


def test_the_earliest_match_wins_then_the_first_listed() -> None:
    assert run(["one two three"], ["three", "two"]) == (["one "], "two", 1)
    assert run(["xaby"], ["ab", "a"]) == (["x"], "ab", 1)
    assert run(["xaby"], ["a", "ab"]) == (["x"], "a", 1)


def test_without_stop_strings_text_passes_through_and_pushing_after_a_match_releases_nothing() -> None:
    out = OutputText(Pieces(["a", "b"]))
    assert (out.push(0), out.push(1), out.flush(), out.stop_string) == ("a", "b", "", None)
    stopped = OutputText(Pieces(["xEND", "more"]), ["END"])
    assert (stopped.push(0), stopped.push(1), stopped.flush()) == ("x", "", "")


def test_incomplete_utf8_is_held_by_the_decoder_and_a_multibyte_stop_string_matches() -> None:
    encoded = "a→b".encode()
    out = OutputText(ByteStreamDecoder(), ["→"])
    released = [out.push(b) for b in encoded]
    assert (released, out.stop_string) == (["a", "", "", "", ""], "→")  # "b", after the match: nothing


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abAB\n:→", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
       stop=st.lists(st.text(alphabet="abAB\n:→", min_size=1, max_size=4), max_size=4))
def test_any_split_into_tokens_streams_exactly_the_text_before_the_earliest_stop(text: str, cuts: list[int],
                                                                                 stop: list[str]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    released, matched, pushed = run(pieces, stop)
    want_text, want_stop = reference(pieces, stop)
    assert "".join(released) == want_text
    assert matched == want_stop
    if matched is not None:  # the token that completed the match is the last pushed
        assert matched in "".join(pieces[:pushed]) and matched not in "".join(pieces[:pushed - 1])
    for i in range(len(released)):  # never a part of a stop string that then matched is streamed early
        streamed = "".join(released[:i + 1])
        assert want_text.startswith(streamed)
