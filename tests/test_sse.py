"""The server-sent-events parser: the WHATWG rules, fed in chunks cut anywhere."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench_client.sse import Event, SSEParser


def parse(*chunks: bytes) -> tuple[list[Event], Event | None]:
    parser = SSEParser()
    events: list[Event] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events, parser.close()


def test_data_events_and_done_pass_through() -> None:
    events, rest = parse(b'data: {"a": 1}\n\ndata: [DONE]\n\n')
    assert [e.data for e in events] == ['{"a": 1}', "[DONE]"]
    assert all(e.event == "message" and e.id is None for e in events)
    assert rest is None


def test_comments_and_pings_are_ignored() -> None:
    events, rest = parse(b": ping\n\n:\n\ndata: x\n: inside an event\ndata: y\n\n:\n\n")
    assert [e.data for e in events] == ["x\ny"]
    assert rest is None


def test_multi_line_data_joins_with_newline() -> None:
    events, _ = parse(b"data: first\ndata:second\ndata:  third\ndata\n\n")
    assert events == [Event(data="first\nsecond\n third\n")]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_line_endings(newline: bytes) -> None:
    body = newline.join([b"event: update", b"id: 7", b"data: one", b"", b"data: two", b"", b""])
    events, rest = parse(body)
    assert events == [Event(data="one", event="update", id="7"), Event(data="two", id="7")]
    assert rest is None


def test_crlf_split_between_chunks_is_one_line_end() -> None:
    events, _ = parse(b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n")
    assert [e.data for e in events] == ["a", "b"]


def test_fields_without_colon_unknown_fields_and_retry() -> None:
    parser = SSEParser()
    events = parser.feed(b"retry: 1500\nfoo: bar\ndata\n\nretry: soon\nid: a\0b\ndata:x\n\n")
    assert [e.data for e in events] == ["", "x"]
    assert events[1].id is None  # an id holding NUL is ignored
    assert parser.retry_ms == 1500  # a retry that is not digits is ignored
    assert parser.close() is None


def test_event_without_data_is_not_dispatched() -> None:
    events, rest = parse(b"event: nothing\n\nid: 3\n\ndata: z\n\n")
    assert events == [Event(data="z", id="3")]
    assert rest is None


def test_bom_at_start_is_dropped() -> None:
    events, _ = parse(b"\xef\xbb", b"\xbfdata: x\n\n")
    assert events == [Event(data="x")]


def test_unfinished_event_is_reported_by_close() -> None:
    events, rest = parse(b'data: {"choices": []}\n\ndata: {"error": {"message": "boom"}}')
    assert [e.data for e in events] == ['{"choices": []}']
    assert rest == Event(data='{"error": {"message": "boom"}}')
    events, rest = parse(b"data: [DONE]\n")
    assert events == [] and rest == Event(data="[DONE]")


def test_feed_after_close_is_refused() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(ValueError):
        parser.feed(b"data: x\n\n")


def test_utf8_cut_inside_a_character() -> None:
    body = 'data: {"text": "é€😀"}\n\n'.encode()
    cut = body.index("€".encode()) + 1
    events, _ = parse(body[:cut], body[cut:cut + 1], body[cut + 1:])
    assert json.loads(events[0].data) == {"text": "é€😀"}


_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, str | None]]]:
    """A body and the events it holds, with mixed line ends, pings, comments and multi-line data."""
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    lines: list[str] = []
    expected: list[tuple[str, str, str | None]] = []
    last_id: str | None = None
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            lines += [":" + draw(_TEXT).replace(":", ""), ""]  # a ping
        name = draw(st.sampled_from(["", "message", "update"]))
        if name:
            lines.append(f"event: {name}")
        if draw(st.booleans()):
            last_id = draw(_TEXT).replace("\0", "")
            lines.append(f"id: {last_id}")
        data = draw(st.lists(_TEXT, min_size=1, max_size=3))
        lines += [f"data: {d}" for d in data]
        if draw(st.booleans()):
            lines.append(": a comment inside the event")
        lines.append("")
        expected.append((name or "message", "\n".join(data), last_id))
    return (newline.join(lines) + newline).encode() if lines else b"", expected


@settings(max_examples=200, deadline=None)
@given(stream=streams(), data=st.data())
def test_any_split_gives_the_same_events(stream: tuple[bytes, list[tuple[str, str, str | None]]],
                                         data: st.DataObject) -> None:
    body, expected = stream
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    events, rest = parse(*chunks)
    assert [(e.event, e.data, e.id) for e in events] == expected
    assert rest is None


# The corners below were found by `make mutate` (docs/mutation-testing.md).


def test_invalid_utf8_becomes_the_replacement_character() -> None:
    events, _ = parse(b"data: a\xffb\n\n")
    assert events == [Event(data="a\ufffdb")]


def test_bytes_cut_at_the_end_of_the_body_are_one_replacement_character() -> None:
    events, rest = parse(b"data: x\xe2\x82")
    assert events == [] and rest == Event(data="x\ufffd")


def test_a_bom_is_dropped_only_at_the_start_of_the_stream() -> None:
    events, _ = parse(b"data: x", b"\xef\xbb\xbfy\n\n")
    assert events == [Event(data="x\ufeffy")]
    events, _ = parse(b"", b"\xef\xbb\xbfdata: z\n\n")  # an empty first chunk does not start it
    assert events == [Event(data="z")]


def test_a_lf_after_a_cr_that_ended_the_last_chunk_is_that_line_end() -> None:
    events, rest = parse(b"data: a\r", b"\ndata: b\r\n\r\n")
    assert events == [Event(data="a\nb")] and rest is None
    # only the one LF right after it: a blank line after that still dispatches
    events, rest = parse(b"data: a\r", b"\n", b"\ndata: b\n\n")
    assert events == [Event(data="a"), Event(data="b")] and rest is None


def test_a_crlf_that_ends_a_chunk_is_one_line_end() -> None:
    events, rest = parse(b"data: a\r\n", b"data: b\r\n\r\n")
    assert events == [Event(data="a\nb")] and rest is None


def test_close_returns_every_field_of_the_unfinished_event() -> None:
    events, rest = parse(b"event: update\nid: 9\ndata: a\ndata: b")
    assert events == [] and rest == Event(data="a\nb", event="update", id="9")


def test_retry_is_none_until_the_stream_sends_one() -> None:
    parser = SSEParser()
    assert parser.retry_ms is None
    parser.feed(b"retry: 20\n")
    assert parser.retry_ms == 20


def test_feed_after_close_says_so() -> None:
    parser = SSEParser()
    assert parser.close() is None
    with pytest.raises(ValueError, match=r"^feed\(\) after close\(\)$"):
        parser.feed(b"")
    assert parser.close() is None
