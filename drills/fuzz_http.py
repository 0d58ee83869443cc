"""The fuzz drill's HTTP side: the bench client's readers of what servers and files say.

(1) Streams. A real aiohttp server on 127.0.0.1 answers POST /v1/completions and
/v1/chat/completions with hypothesis-drawn answers: well-formed event streams (1..k tokens an
event, as llama-server sends them; usage absent, on every event as vLLM's continuous usage, just
before the finish event, in it or after it; `[DONE]` or not; `:` pings, `id:`/`event:` lines,
multi-line data, LF, CRLF or CR line ends, a BOM, gzip), each written in TCP writes cut at any byte
(inside a UTF-8 character too); the same streams with a defect (data not JSON, JSON not an object,
an error frame, no choices, finish_reason abort), with events of any shape, cut by the transport or
ended cleanly at any byte; 200 answers of another Content-Type; HTTP error statuses with any body
and Retry-After; huge lines. `OpenAIClient.decode` reads each to its end within a bound: Chunks, or
an EngineError and never another exception. A well-formed stream gives back its text, finish
reason, usage and cached tokens, and the point runner's own `_success` counts the usage's
completion tokens; an error status is classified as bench_client/openai_errors.py's table says.

(2) Dataset files. JSONL files of valid, blank and defective lines (any defect at any line, a
BOM, invalid UTF-8, CRLF): `read_jsonl` gives the requests exactly, or a DatasetError naming the
file, the FIRST bad line and its field. ShareGPT arrays cut at any kind of place (inside a string,
an escape, a UTF-8 character, after a comma...) and read in blocks of any size: `parse_sharegpt`
reads the complete elements before the cut and says torn; one with a malformed element raises a
DatasetError naming it. Each call is bounded in time; any other exception is a failure.

Cases earlier runs found, and every status of the error table, are replayed first in every run
(STREAM_EDGES, JSONL_EDGES, SHAREGPT_EDGES). The row lists each failed check with its count of cases
and an example; the first failing case of each check is printed whole on stderr, to replay it."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench_client import datasets
from bench_client.datasets import DatasetError, JsonlRequest, ShareGPTConversation, parse_sharegpt, read_jsonl
from bench_client.openai_http import CHAT_COMPLETIONS, COMPLETIONS, OpenAIClient
from bench_client.openai_json import chat_body, completion_body
from bench_client.point import _success
from bench_client.server_api import ChatMessage, Chunk, DecodeSpec
from drills.common import note
from drills.row import Checks, Row
from shared.errors import (
    BadRequest,
    ClientTimeout,
    ContextLengthExceeded,
    EngineError,
    PermissionDenied,
    QueueFull,
    TransportError,
    Unauthenticated,
    status_code_of,
)

NAME = "fuzz-http"
CLIENT_TIMEOUT_S = 20.0  # the client's own timeout: never reached (every answer ends at once)
CASE_TIMEOUT_S = 15.0  # past this a call hangs
FILE_TIMEOUT_S = 10.0

# bench_client/openai_errors.py's table, written out again: status -> (gRPC code name, classes)
REFUSAL = ("INVALID_ARGUMENT", (BadRequest, ContextLengthExceeded))
TABLE: dict[int, tuple[str, tuple[type[EngineError], ...]]] = {
    400: REFUSAL, 413: REFUSAL, 422: REFUSAL, 401: ("UNAUTHENTICATED", (Unauthenticated,)),
    403: ("PERMISSION_DENIED", (PermissionDenied,)), 404: ("UNIMPLEMENTED", (TransportError,)),
    405: ("UNIMPLEMENTED", (TransportError,)), 501: ("UNIMPLEMENTED", (TransportError,)),
    408: ("DEADLINE_EXCEEDED", (TransportError,)), 504: ("DEADLINE_EXCEEDED", (TransportError,)),
    409: ("ABORTED", (TransportError,)), 429: ("RESOURCE_EXHAUSTED", (QueueFull,)), 503: ("UNAVAILABLE", (QueueFull,)),
    424: ("INTERNAL", (TransportError,)), 500: ("INTERNAL", (TransportError,)), 502: ("UNAVAILABLE", (TransportError,)),
}


def expected_class(status: int) -> tuple[str, tuple[type[EngineError], ...]]:
    if status in TABLE:
        return TABLE[status]
    return ("FAILED_PRECONDITION" if 400 <= status < 500 else "UNKNOWN"), (TransportError,)


# -- (1) streams: what the fake server answers ---------------------------------------------------

COMPLETE, REFUSED, STATUS, TORN_CUT, TORN_END, ANY = "complete", "refused", "status", "torn-cut", "torn-end", "any"


@dataclass(frozen=True)
class Answer:
    """One answer of the fake server and what the client must make of it."""

    kind: str  # COMPLETE, REFUSED (an EngineError, no chunk), STATUS, TORN_CUT, TORN_END, ANY
    chat: bool
    body: bytes
    cuts: tuple[int, ...] = ()  # the body is written in pieces cut at these offsets
    status: int = 200
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "text/event-stream"),)
    gzip: bool = False
    end_at: int | None = None  # TORN_*: the body stops here (the connection is cut, or the body ends)
    length_header: bool = False  # TORN_CUT: with a Content-Length of the whole body, not chunked
    text: str = ""  # the answer's text (of the events before the defect: a bound, not the text)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    logprob_tokens: int | None = None  # every content event carried logprobs: the true token count
    finish_ends: int = 0  # Body's offsets
    done_data_ends: int | None = None
    done_ends: int | None = None
    context: tuple[int, int] | None = None  # STATUS: the prompt and context numbers of a context wording


def text_of(chat: bool, text: str) -> dict[str, Any]:
    return {"delta": {"content": text}} if chat else {"text": text}


FINISHES = [("length", {}, "LENGTH"), ("stop", {}, "EOS"), ("stop", {"stop_reason": "</s>"}, "STOP"),
            ("stop", {"stop_reason": None}, "EOS"), ("stop", {"stop_reason": 2}, "EOS"),
            ("stop", {"matched_stop": "\n\n"}, "STOP"), ("eos_token", {}, "EOS"), ("stop_sequence", {}, "STOP")]
token_texts = st.text(st.characters(codec="utf-8"), max_size=5)
counts = st.integers(0, 10**6)


@st.composite
def well_formed(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int, Answer]:
    """(the events as JSON objects, the finish event's index, the Answer they make, unrendered); the
    last events are the finish event and the usage-only event after it, when there is one."""
    chat = draw(st.booleans())
    tokens = draw(st.lists(token_texts, max_size=30))
    groups: list[list[str]] = []
    while len(groups) < 200 and sum(map(len, groups)) < len(tokens):
        at = sum(map(len, groups))
        groups.append(tokens[at:at + draw(st.integers(1, 5))])
    with_logprobs = draw(sometimes(5))
    place = draw(st.sampled_from(["none", "none", "continuous", "before", "finish", "after"]))
    n, prompt = len(tokens), draw(counts)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(st.integers(0, prompt))}
    timings = {"prompt_n": prompt, "predicted_n": n, "cache_n": draw(st.integers(0, prompt)),
               "prompt_ms": draw(st.floats(0, 1e4)), "predicted_ms": draw(st.floats(0, 1e4))} \
        if draw(st.booleans()) else None
    last_in_finish = bool(groups) and draw(st.booleans())  # llama-server: the finish event carries text
    events: list[dict[str, Any]] = []
    if chat and draw(st.booleans()):
        events.append({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    done = 0
    for group in groups[:-1] if last_in_finish else groups:
        done += len(group)
        choice: dict[str, Any] = {"index": 0, **text_of(chat, "".join(group)), "finish_reason": None}
        if with_logprobs:
            choice["logprobs"] = ({"content": [{"token": t, "logprob": -0.5} for t in group]} if chat
                                  else {"tokens": group, "token_logprobs": [-0.5] * len(group)})
        event: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                                 "choices": [choice]}
        if place == "continuous":
            event["usage"] = {**usage, "completion_tokens": done}
        elif place == "none" and draw(sometimes(4)):
            event["usage"] = None  # OpenAI sends usage: null on every event before the last
        events.append(event)
    if place == "before":
        events.append({"choices": [], "usage": usage})
    raw, extra, expected_finish = draw(st.sampled_from(FINISHES))
    finish_text = "".join(groups[-1]) if last_in_finish else ""
    closing: dict[str, Any] = {"index": 0, **(text_of(chat, finish_text) if finish_text or not chat else {"delta": {}}),
                               "finish_reason": raw, **extra}
    if with_logprobs and last_in_finish:
        closing["logprobs"] = ({"content": [{"token": t, "logprob": -0.5} for t in groups[-1]]} if chat
                               else {"tokens": groups[-1], "token_logprobs": [-0.5] * len(groups[-1])})
    finish: dict[str, Any] = {"choices": [closing]}
    if place in ("finish", "continuous"):
        finish["usage"] = usage
    if timings is not None:
        finish["timings"] = timings
    finish_index = len(events)
    events.append(finish)
    if place == "after":
        events.append({"choices": [], "usage": usage})
    sent_usage = usage if place != "none" else None
    answer = Answer(COMPLETE, chat, b"", text="".join(tokens), finish=expected_finish, usage=sent_usage,
                    timings=timings, logprob_tokens=n if with_logprobs else None)
    return events, finish_index, answer


@dataclass
class Frame:
    """One event as rendered: its data (JSON text or anything else) and its role in the stream."""

    data: str | bytes
    role: str = "event"  # "event", "finish", "done"
    event_type: str | None = None


@dataclass(frozen=True)
class Body:
    """A rendered stream and the offsets that decide what a stream stopped at any byte may read."""

    bytes: bytes
    finish_ends: int = 0  # just past the finish event's last data line
    done_data_ends: int | None = None  # just past "data: [DONE]" (None: no [DONE])
    done_ends: int | None = None  # just past [DONE]'s blank line


def sometimes(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in `one_in` draws (hypothesis favours the ends of a range: the middle decides)."""
    return st.integers(0, one_in - 1).map(lambda i: i == one_in // 2)


@st.composite
def rendered(draw: st.DrawFn, frames: list[Frame]) -> Body:
    """The body of these frames: one line end for the whole stream (LF, CRLF or CR: a CR before an
    LF-ended blank line would make one CRLF), an optional space after "data:", pings, comments."""
    end = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    space = draw(st.booleans())
    out = bytearray(b"\xef\xbb\xbf" if draw(sometimes(10)) else b"")
    offsets: dict[str, int] = {}
    for index, frame in enumerate(frames):
        if draw(sometimes(6)):
            out += (":" + draw(st.sampled_from(["", " ping", " keep-alive"])) + end + end).encode()
        lines: list[bytes] = []
        if frame.event_type is not None:
            lines.append(f"event: {frame.event_type}".encode())
        elif draw(sometimes(8)):
            lines.append(b"event: message")
        if draw(sometimes(8)):
            lines.append(f"id: {index}".encode())
        data = frame.data if isinstance(frame.data, bytes) else frame.data.encode()
        lines += [(b"data: " if space else b"data:") + part for part in re.split(rb"\r\n|\r|\n", data)]
        if draw(sometimes(10)):  # a comment among the fields, never after the last data line
            lines.insert(draw(st.integers(0, len(lines) - 1)), b": inside")
        out += end.encode().join(lines)
        offsets[frame.role + "_data"] = len(out)
        out += (end + end).encode()
        offsets[frame.role] = len(out)
    return Body(bytes(out), offsets.get("finish_data", 0), offsets.get("done_data"), offsets.get("done"))


def dumps(draw: st.DrawFn, value: Any) -> str:
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, None, None, 1])))


@st.composite
def cuts(draw: st.DrawFn, body: bytes) -> tuple[int, ...]:
    """Where the body is cut into TCP writes: anywhere, inside UTF-8 characters, or at every byte."""
    if len(body) < 2:
        return ()
    if len(body) < 400 and draw(sometimes(20)):
        return tuple(range(1, len(body)))
    inside = [i for i in range(1, len(body)) if body[i] & 0xC0 == 0x80]  # continuation bytes
    chosen = draw(st.lists(st.integers(1, len(body) - 1), max_size=8))
    if inside:
        chosen += draw(st.lists(st.sampled_from(inside), max_size=4))
    return tuple(sorted(set(chosen)))


@st.composite
def streams(draw: st.DrawFn) -> Answer:
    """A well-formed answer, rendered."""
    events, finish_index, answer = draw(well_formed())
    frames = [Frame(dumps(draw, e), "finish" if i == finish_index else "event") for i, e in enumerate(events)]
    if not draw(sometimes(4)):
        frames.append(Frame("[DONE]", "done"))
    body = draw(rendered(frames))
    return dataclasses.replace(answer, body=body.bytes, cuts=draw(cuts(body.bytes)), gzip=draw(sometimes(10)),
                               finish_ends=body.finish_ends, done_data_ends=body.done_data_ends,
                               done_ends=body.done_ends)


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return text.strip() != "[DONE]"
    return False


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6),
                         st.sampled_from([10**309, -(10**400), 2**1100]))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)), max_leaves=8)
numbers = st.one_of(st.integers(-3, 10**6), st.floats(), st.sampled_from([10**309, 2**1100, "12", "٣", True]),
                    json_values)
odd_choice = st.fixed_dictionaries({}, optional={
    "text": st.one_of(token_texts, json_values), "delta": st.one_of(
        st.fixed_dictionaries({}, optional={"content": st.one_of(token_texts, json_values), "role": json_values,
                                            "reasoning_content": json_values, "tool_calls": json_values}), json_values),
    "finish_reason": st.one_of(st.sampled_from(["length", "stop", "eos_token", "abort", "error", "tool_calls", ""]),
                               json_values),
    "stop_reason": json_values, "matched_stop": json_values, "index": json_values,
    "logprobs": st.one_of(st.fixed_dictionaries({}, optional={"content": json_values, "tokens": json_values}),
                          json_values)})
odd_events = st.fixed_dictionaries({}, optional={
    "choices": st.one_of(st.lists(st.one_of(odd_choice, json_values), max_size=2), json_values),
    "usage": st.one_of(st.fixed_dictionaries({}, optional={
        "prompt_tokens": numbers, "completion_tokens": numbers,
        "prompt_tokens_details": st.one_of(st.fixed_dictionaries({}, optional={"cached_tokens": numbers}),
                                           json_values)}), json_values),
    "timings": st.one_of(st.dictionaries(st.one_of(st.sampled_from(["prompt_n", "predicted_n", "cache_n", "prompt_ms"]),
                                                   st.text(max_size=4)), numbers, max_size=4), json_values),
    "object": json_values})
error_frames = st.one_of(
    st.builds(lambda m, t, c: {"error": {"message": m, "type": t, "code": c}}, st.text(max_size=30), json_values,
              json_values),
    st.builds(lambda m, t: {"error": m, "error_type": t}, st.text(max_size=30),
              st.sampled_from(["validation", "overloaded", "generation", "x"])),
    st.builds(lambda m: {"error": {"message": m, "http_status_code": 422}},
              st.sampled_from(["Input validation error: `top_p` must be > 0.0 and < 1.0", "Model is overloaded", "x"])),
    st.builds(lambda v: {"error": v}, json_values))
# Each must raise an EngineError, after the chunks before it: its data, and its `event:` type
DEFECTS: dict[str, st.SearchStrategy[tuple[str | bytes, str | None]]] = {
    "data not JSON": st.tuples(st.text(max_size=40).map(lambda s: s.replace("\r", " ").replace("\n", " "))
                               .filter(_not_json), st.none()),
    "data not UTF-8": st.tuples(st.sampled_from([b"\xff\xfe", b"{\xc3", b"\xed\xa0\x80"]), st.none()),
    "JSON not an object": st.tuples(st.one_of(json_scalars, st.lists(json_scalars, max_size=3)).map(json.dumps)
                                    .filter(lambda s: s != '"[DONE]"'), st.none()),
    "an error frame": st.tuples(error_frames.map(json.dumps), st.none()),
    "event: error": st.tuples(st.dictionaries(st.text(max_size=4), json_values, max_size=2).map(json.dumps),
                              st.just("error")),
    "no choices": st.tuples(st.just('{"id": "x", "object": "text_completion"}'), st.none()),
    "a choice not an object": st.tuples(st.sampled_from(['{"choices": [1]}', '{"choices": ["a"]}']), st.none()),
    "finish_reason abort": st.tuples(st.sampled_from(['{"choices": [{"text": "", "finish_reason": "abort"}]}',
                                                      '{"choices": [{"delta": {}, "finish_reason": "error"}]}']),
                                     st.none()),
}
ODD = "events of any shape"


@st.composite
def defective(draw: st.DrawFn, defect: str) -> Answer:
    """A well-formed answer with a defect before its end ([DONE] or the end of the body): REFUSED; or,
    for ODD, with 1..3 events of any shape among its own: ANY."""
    events, _, answer = draw(well_formed())
    frames = [Frame(dumps(draw, e)) for e in events]
    at = draw(st.integers(0, len(frames)))
    if defect == ODD:
        for _ in range(draw(st.integers(1, 3))):
            frames.insert(draw(st.integers(0, len(frames))), Frame(json.dumps(draw(odd_events))))
    else:
        data, event_type = draw(DEFECTS[defect])
        frames.insert(at, Frame(data, event_type=event_type))
    before = "".join(e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content", ""))
                     for e in events[:at] if e.get("choices"))
    if draw(st.booleans()):
        frames.append(Frame("[DONE]", "done"))
    body = draw(rendered(frames)).bytes
    return dataclasses.replace(answer, kind=ANY if defect == ODD else REFUSED, body=body, cuts=draw(cuts(body)),
                               text=before, finish=defect)


@st.composite
def torn(draw: st.DrawFn) -> Answer:
    """A well-formed answer that stops at any byte: the connection cut (TORN_CUT: chunked, or short of
    its Content-Length), or the body ended there cleanly (TORN_END)."""
    answer = draw(streams())
    near = [answer.finish_ends + d for d in (-1, 0, 1)] + [len(answer.body) - 1, len(answer.body)]
    if answer.done_ends is not None and answer.done_data_ends is not None:
        near += [answer.done_ends, answer.done_ends - 1, answer.done_data_ends, answer.done_data_ends - 1]
    end_at = draw(st.one_of(st.integers(0, len(answer.body)), st.sampled_from(sorted(
        {min(max(0, at), len(answer.body)) for at in near}))))
    cut, length_header = draw(st.booleans()), draw(st.booleans())
    if length_header and end_at == len(answer.body):
        cut = False  # all its Content-Length came: the body ended, whatever the connection does
    return dataclasses.replace(answer, kind=TORN_CUT if cut else TORN_END, end_at=end_at, gzip=False,
                               cuts=tuple(c for c in answer.cuts if c < end_at), length_header=cut and length_header)


CONTEXT_WORDINGS = [  # (message, type): refusals openai_errors.py reads the numbers of
    ("the request exceeds the available context size, try increasing it: request ({p} tokens) exceeds the "
     "available context size ({c} tokens)", "exceed_context_size_error"),
    ("This model's maximum context length is {c} tokens. However, you requested {t} tokens ({p} in the messages, "
     "{n} in the completion). Please reduce the length of the messages or completion.", "BadRequestError"),
    ("`inputs` tokens + `max_new_tokens` must be <= {c}. Given: {p} `inputs` tokens and {n} `max_new_tokens`", None),
]
statuses = st.integers(0, 5).flatmap(lambda i: (  # the table's half the time, any other status else
    st.sampled_from(sorted(TABLE)) if i < 3 else st.integers(400, 599) if i == 3 else
    st.integers(201, 299).filter(lambda s: s not in (204, 205)) if i == 4 else
    st.sampled_from([300, 301, 302, 303, 307, 308, 600, 999])))
retry_afters = st.one_of(st.integers(0, 10**6).map(str), st.floats(0, 1e6).map(lambda f: f"{f:.3f}"),
                         st.sampled_from(["Wed, 21 Oct 2015 07:28:00 GMT", "Fri, 31 Dec 9999 23:59:59 GMT", "-1",
                                          "soon", "", "1e3", "9" * 400, "٣"]),
                         st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=10))


@st.composite
def refusals(draw: st.DrawFn) -> Answer:
    """An HTTP error status, with any body (JSON of the servers' shapes or any other, text, bytes)."""
    status = draw(statuses)
    context = None
    shape = draw(st.integers(0, 7))
    if shape == 0 and status in (400, 413, 422):
        p, c, n = draw(st.integers(0, 10**6)), draw(st.integers(1, 10**6)), draw(st.integers(1, 10**6))
        message, kind = draw(st.sampled_from(CONTEXT_WORDINGS))
        error: dict[str, Any] = {"message": message.format(p=p, c=c, n=n, t=p + n), "code": status}
        if kind:
            error["type"] = kind
        body = json.dumps({"error": error}).encode()
        context = (p, c)
    elif shape <= 2:
        body = json.dumps(draw(st.one_of(error_frames, st.builds(lambda d: {"detail": d}, json_values),
                                         st.builds(lambda m: {"object": "error", "message": m}, json_values)))).encode()
    elif shape == 3:
        body = json.dumps(draw(json_values)).encode()
    elif shape == 4:
        body = draw(st.text(max_size=60)).encode()
    elif shape == 5:
        body = draw(st.binary(max_size=60))
    elif shape == 6:
        body = b""
    else:
        body = b"x" * draw(st.integers(1, 1 << 20))
    headers = [("Content-Type", draw(st.sampled_from(["application/json", "text/plain", "text/event-stream",
                                                      "text/html; charset=utf-8"])))]
    if draw(st.booleans()):
        headers.append(("Retry-After", draw(retry_afters)))
    return Answer(STATUS, draw(st.booleans()), body, cuts=draw(cuts(body)), status=status, headers=tuple(headers),
                  context=context)


@st.composite
def other_types(draw: st.DrawFn) -> Answer:
    """A 200 answer that is not an event stream: REFUSED, whatever its body."""
    answer = draw(streams())
    kind = draw(st.sampled_from(["application/json", "text/plain", "text/html", "application/octet-stream", ""]))
    body = answer.body if draw(st.booleans()) else json.dumps({"choices": [{"text": answer.text}]}).encode()
    return dataclasses.replace(answer, kind=REFUSED, body=body, headers=(("Content-Type", kind),), text="",
                               finish="a 200 answer of another Content-Type")


@st.composite
def huge(draw: st.DrawFn, size: int) -> Answer:
    """A huge line: one event of `size` characters of text (COMPLETE), a comment line as long, or data
    as long that is not JSON (REFUSED), written in pieces of 64 KiB."""
    kind = draw(st.sampled_from(["text", "comment", "not JSON"]))
    char = draw(st.sampled_from(["a", "é", "😀"]))
    chat = draw(st.booleans())
    text = char * size
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    finish = json.dumps({"choices": [{**text_of(chat, ""), "finish_reason": "length"}], "usage": usage})
    if kind == "text":
        head = "data: " + json.dumps({"choices": [text_of(chat, text)]}, ensure_ascii=False) + "\n\n"
    else:
        head = (": " if kind == "comment" else "data: ") + text + "\n\n"
    body = (head + "data: " + finish + "\n\ndata: [DONE]\n\n").encode()
    return Answer(REFUSED if kind == "not JSON" else COMPLETE, chat, body, text=text if kind == "text" else "",
                  cuts=tuple(range(1 << 16, len(body), 1 << 16)), finish="LENGTH", usage=usage)


# -- (1) streams: the server and the judge -------------------------------------------------------


class FakeServer:
    """aiohttp on 127.0.0.1:0 answering each request with the Answer registered for its prompt."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.received: dict[str, tuple[str, dict[str, Any]]] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post(COMPLETIONS, self.handle)
        app.router.add_post(CHAT_COMPLETIONS, self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = body.get("prompt") or body["messages"][0]["content"]
        self.received[key] = (request.path, body)
        answer = self.answers[key]
        reason = "Fuzzed" if answer.status >= 600 else None
        response = web.StreamResponse(status=answer.status, reason=reason, headers=dict(answer.headers))
        if answer.gzip:
            response.enable_compression(force=web.ContentCoding.gzip)
        if answer.length_header:
            response.content_length = len(answer.body)
        await response.prepare(request)
        end = len(answer.body) if answer.end_at is None else answer.end_at
        try:
            for start, stop in zip((0, *answer.cuts), (*answer.cuts, end), strict=True):
                await response.write(answer.body[start:stop])
                await asyncio.sleep(0)  # let the client read this piece alone
                await asyncio.sleep(0)
            if answer.kind == TORN_CUT and request.transport is not None:
                while request.transport.get_write_buffer_size():  # all of it sent, then the cut
                    await asyncio.sleep(0.001)
                request.transport.abort()
                return response
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client stopped reading ([DONE], or the error it raised) and closed the connection
        return response


@dataclass
class Got:
    chunks: list[Chunk] = field(default_factory=list)
    error: EngineError | None = None
    crash: BaseException | None = None  # any other exception
    hung: bool = False


async def read_answer(client: OpenAIClient, key: str, chat: bool, got: Got) -> None:
    spec = DecodeSpec(request_id=key, prompt_token_ids=(), max_new_tokens=16, ignore_eos=False, temperature=0.0,
                      top_p=1.0, top_k=0, seed=0, prompt_text="" if chat else key,
                      messages=(ChatMessage("user", key),) if chat else ())
    try:
        async for chunk in client.decode(spec, timeout=CLIENT_TIMEOUT_S):
            got.chunks.append(chunk)
    except EngineError as err:
        got.error = err


def judge(answer: Answer, got: Got, request: tuple[str, dict[str, Any]] | None, key: str) -> list[tuple[str, str]]:
    """The checks this answer fails: (check, what happened)."""
    if got.hung:
        return [("never a hang", f"no end within {CASE_TIMEOUT_S:g} s")]
    if got.crash is not None:
        return [("Chunks or an EngineError, never another exception", f"{type(got.crash).__name__}: {got.crash}"[:200])]
    wrong: list[tuple[str, str]] = []
    spec_body = (completion_body if not answer.chat else chat_body)(DecodeSpec(
        key, (), 16, False, 0.0, 1.0, 0, 0, prompt_text="" if answer.chat else key,
        messages=(ChatMessage("user", key),) if answer.chat else ()), None)
    if request != ((CHAT_COMPLETIONS if answer.chat else COMPLETIONS), spec_body):
        wrong.append(("the request as completion_body/chat_body make it", f"sent {request}"))
    if isinstance(got.error, ClientTimeout):
        return [*wrong, ("never a hang", f"the client's own timeout: {got.error.message[:120]}")]
    text = "".join(c.text for c in got.chunks)
    err = f"{type(got.error).__name__}: {got.error.message[:120]}" if got.error else "no error"
    if answer.kind == STATUS:
        code, classes = expected_class(answer.status)
        e = got.error
        if e is None or got.chunks:
            wrong.append(("an error status raises its EngineError", f"{len(got.chunks)} chunks, {err}"))
        elif status_code_of(e).name != code or not isinstance(e, classes) or e.http_status != answer.status:
            wrong.append(("an error status is classified as openai_errors.py's table says",
                          f"HTTP {answer.status}: {type(e).__name__} {status_code_of(e).name} http_status "
                          f"{e.http_status}, expected {code} ({'/'.join(c.__name__ for c in classes)})"))
        elif answer.context is not None and (not isinstance(e, ContextLengthExceeded) or (
                e.metadata.get("promptTokens"), e.metadata.get("maxContextTokens")) != tuple(map(str, answer.context))):
            wrong.append(("a context refusal's numbers are read", f"{type(e).__name__} {e.metadata}, expected "
                                                                  f"{answer.context}"))
        elif e.retry_delay is not None and not (math.isfinite(e.retry_delay) and e.retry_delay >= 0):
            wrong.append(("Retry-After gives a finite delay (the policy sleeps it: never a hang)",
                          f"retry_delay {e.retry_delay} from {dict(answer.headers).get('Retry-After', '')[:40]!r}"))
        return wrong
    if answer.kind == REFUSED:
        if got.error is None:
            wrong.append((f"{answer.finish} raises an EngineError", f"no error, {len(got.chunks)} chunks, "
                                                                    f"text {text[:60]!r}"))
        if not answer.text.startswith(text):
            wrong.append(("the chunks before a defect are those sent", f"text {text[:60]!r}"))
        return wrong
    if answer.kind == ANY:
        return wrong
    if answer.kind in (TORN_CUT, TORN_END):
        assert answer.end_at is not None
        # "data: [DONE]" came whole: a clean end reads it (the parser closes the line); a cut connection
        # may still raise before its blank line came
        done_came = answer.done_data_ends is not None and answer.end_at >= answer.done_data_ends
        complete = done_came and (answer.kind == TORN_END or got.error is None
                                  or answer.end_at >= (answer.done_ends or 0))
        if not answer.text.startswith(text):
            wrong.append(("a torn stream yields a prefix of the text sent", f"text {text[:60]!r}"))
        if answer.kind == TORN_CUT and not done_came and got.error is None:
            wrong.append(("a stream cut by the transport before [DONE] raises", f"{len(got.chunks)} chunks, no error"))
        if got.chunks and got.chunks[-1].finish_reason and answer.end_at < answer.finish_ends:
            wrong.append(("a stream torn before its finish event never reads as finished",
                          f"finish_reason {got.chunks[-1].finish_reason} at byte {answer.end_at} of "
                          f"{len(answer.body)}, the finish event ends at {answer.finish_ends}"))
        if not complete:
            return wrong
    # COMPLETE (or torn after [DONE])
    last = got.chunks[-1] if got.chunks else None
    if got.error is not None or last is None:
        return [*wrong, ("a well-formed stream reads to its end", f"{len(got.chunks)} chunks, {err}")]
    if text != answer.text:
        wrong.append(("a well-formed stream's text is the text sent", f"{text[:60]!r}, sent {answer.text[:60]!r}"))
    if last.finish_reason != answer.finish or any(c.finish_reason for c in got.chunks[:-1]):
        wrong.append(("the last chunk alone carries the finish_reason",
                      f"{[c.finish_reason for c in got.chunks]}, expected {answer.finish} last"))
    usage = answer.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details["cached_tokens"] if "cached_tokens" in details else (answer.timings or {}).get("cache_n")
    expected = (usage.get("completion_tokens"), usage.get("prompt_tokens"), cached)
    if (last.completion_tokens, last.prompt_tokens, last.cached_prompt_tokens) != expected:
        wrong.append(("the last chunk carries the usage sent (completion, prompt, cached tokens)",
                      f"{(last.completion_tokens, last.prompt_tokens, last.cached_prompt_tokens)}, sent {expected}"))
    if answer.logprob_tokens is not None and sum(c.num_tokens for c in got.chunks) != answer.logprob_tokens:
        wrong.append(("events with logprobs count their tokens", f"{[c.num_tokens for c in got.chunks]}, "
                                                                 f"{answer.logprob_tokens} sent"))
    n = answer.usage["completion_tokens"] if answer.usage else answer.logprob_tokens
    outcome = _success(0, False, 1, time.perf_counter(), got.chunks, 0, n or 0)
    if outcome.timeline is None:
        wrong.append(("the point runner measures a well-formed stream", f"{outcome.reason}: {outcome.message}"))
    elif answer.usage is not None and (outcome.timeline.output_tokens != n or outcome.truncated):
        wrong.append(("the point counts usage.completion_tokens as the output tokens",
                      f"output_tokens {outcome.timeline.output_tokens} (source "
                      f"{outcome.timeline.output_token_source}), usage {n}, truncated {outcome.truncated}"))
    return wrong


# -- (2) dataset files ---------------------------------------------------------------------------

JSON_SPACE = st.sampled_from(["", " ", "\t", "  "])


@st.composite
def jsonl_request(draw: st.DrawFn, line: int) -> tuple[dict[str, Any], JsonlRequest]:
    value: dict[str, Any] = {}
    if draw(st.booleans()):
        prompt = draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=20))
        value["prompt"] = prompt
        request = JsonlRequest(line, prompt=prompt)
    else:
        messages = draw(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", ""]), st.text(max_size=10)),
                                 min_size=1, max_size=3))
        value["messages"] = [{"role": r, "content": c} for r, c in messages]
        request = JsonlRequest(line, messages=tuple(ChatMessage(r, c) for r, c in messages))
    choice = draw(st.integers(0, 3))
    if choice == 1:
        value["max_tokens"] = draw(st.one_of(st.integers(1, 4096), st.integers(1, 10**30)))
        request = dataclasses.replace(request, max_tokens=value["max_tokens"])
    elif choice == 2:
        value["max_tokens"] = None  # null: the workload's
    keys = draw(st.permutations(sorted(value)))
    return {k: value[k] for k in keys}, request


def _line(draw: st.DrawFn, value: Any) -> bytes:
    sep = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    return (draw(JSON_SPACE) + json.dumps(value, ensure_ascii=draw(st.booleans()), separators=sep)
            + draw(JSON_SPACE)).encode()


BAD_UTF8 = [b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"]


BAD_LINES = ("not JSON", "not an object", "neither", "both", "unknown key", "prompt", "messages", "a message",
             "role or content", "max_tokens", "huge max_tokens", "not UTF-8", "a control character")


@st.composite
def bad_line(draw: st.DrawFn, kind: str) -> tuple[bytes, tuple[str, ...], str]:
    """A line with one defect of this kind: (its bytes, the words its refusal names (any of them), kind)."""
    good, _ = draw(jsonl_request(1))
    if kind == "not JSON":
        text = draw(st.sampled_from(["{not json", "prompt=x", "{'prompt': 'x'}", '{"prompt": "x",}', "[", "}",
                                     '{"prompt": "x"} {"prompt": "y"}', '{"prompt" "x"}', "NaN]"]))
        return text.encode(), ("not JSON",), kind
    if kind == "not an object":
        value = draw(st.one_of(json_scalars, st.lists(json_scalars, max_size=2)))
        return _line(draw, value), ("must be a JSON object",), kind
    if kind == "neither":
        return _line(draw, draw(st.sampled_from([{}, {"max_tokens": 3}]))), ("neither",), kind
    if kind == "both":
        return _line(draw, {"prompt": "x", "messages": draw(st.sampled_from([[], [{"role": "u", "content": "c"}]]))}), \
            ("both",), kind
    if kind == "unknown key":
        key = draw(st.text(max_size=8).filter(lambda k: k not in datasets.JSONL_KEYS))
        return _line(draw, {**good, key: draw(json_values)}), (f"unknown key {key!r}",), kind
    if kind == "prompt":
        value = draw(st.sampled_from([5, None, [], {}, "", True, 1.5, ["x"]]))
        return _line(draw, {"prompt": value}), ("prompt",), kind
    if kind == "messages":
        return _line(draw, {"messages": draw(st.sampled_from(["hi", [], {}, None, 3, {"role": "u"}]))}), \
            ("messages must",), kind
    if kind == "a message":
        at = draw(st.integers(0, 2))
        messages = [{"role": "u", "content": "c"}] * at + [draw(json_scalars)]
        return _line(draw, {"messages": messages}), (f"messages[{at}] must",), kind
    if kind == "role or content":
        name = draw(st.sampled_from(["role", "content"]))
        message: dict[str, Any] = {"role": "u", "content": "c"}
        if draw(st.booleans()):
            del message[name]
        else:
            message[name] = draw(json_scalars.filter(lambda v: not isinstance(v, str)))
        return _line(draw, {"messages": [{"role": "u", "content": "c"}, message]}), (f"messages[1].{name}",), kind
    if kind == "max_tokens":
        bad = draw(st.sampled_from(["0", "-1", "-100000000000000000000", "1.5", "2.0", "true", "false", '"8"', "[]",
                                    "{}", "1e400", "-0", "1E2"]))
        return f'{{"prompt": "x", "max_tokens": {bad}}}'.encode(), ("max_tokens",), kind
    if kind == "huge max_tokens":  # more digits than Python reads (4300): not a number it can use either
        return b'{"prompt": "x", "max_tokens": ' + b"9" * draw(st.integers(4301, 6000)) + b"}", \
            ("max_tokens", "not JSON"), kind
    if kind == "not UTF-8":
        raw = json.dumps({"prompt": "ab"}).encode()
        return raw.replace(b"ab", b"a" + draw(st.sampled_from(BAD_UTF8)) + b"b"), ("not UTF-8",), kind
    return b'{"prompt": "a' + draw(st.sampled_from([b"\x00", b"\x01", b"\x1f", b"\t"])) + b'b"}', ("not JSON",), kind


@dataclass(frozen=True)
class JsonlCase:
    body: bytes
    requests: tuple[JsonlRequest, ...]
    bad: tuple[int, tuple[str, ...], str] | None  # the first bad line: its number, words, kind
    bom: bool


@st.composite
def jsonl_files(draw: st.DrawFn, kind: str) -> JsonlCase:
    """0..8 lines: valid ones, blank ones, and about one in five with a defect of this kind."""
    end = draw(st.sampled_from([b"\n", b"\r\n"]))
    lines: list[bytes] = []
    requests: list[JsonlRequest] = []
    bad = None
    for number in range(1, draw(st.integers(0, 8)) + 1):
        what = draw(st.integers(0, 9).map(lambda i: (i + 5) % 10))  # 0 (valid), not 9 (bad), the likeliest
        if what <= 5:
            value, request = draw(jsonl_request(number))
            lines.append(_line(draw, value))
            requests.append(request)
        elif what <= 7:
            lines.append(draw(st.sampled_from([b"", b" ", b"\t", b"  \t "])))
        else:
            raw, words, _ = draw(bad_line(kind))
            lines.append(raw)
            bad = bad or (number, words, kind)
    body = end.join(lines) + (end if lines and draw(st.booleans()) else b"")
    bom = draw(sometimes(10))
    return JsonlCase((b"\xef\xbb\xbf" if bom else b"") + body, tuple(requests), bad, bom)


def judge_jsonl(case: JsonlCase, path: Path, got: Any) -> list[tuple[str, str]]:
    if isinstance(got, BaseException) and not isinstance(got, DatasetError):
        return [("read_jsonl: requests or a DatasetError, never another exception",
                 f"{type(got).__name__}: {str(got)[:160]}")]
    message = str(got) if isinstance(got, DatasetError) else ""
    if case.bom and isinstance(got, DatasetError) and re.search(r"line 1\b", message) and "BOM" in message:
        return []  # a BOM refused at line 1, or read as if absent: either
    if case.bad is not None:
        number, words, kind = case.bad
        if not isinstance(got, DatasetError):
            return [("read_jsonl refuses a bad line", f"{kind} at line {number} read as {got!r:.160}")]
        lines = re.findall(r"\bline (\d+)\b", message)
        if repr(str(path)) not in message or lines[:1] != [str(number)] or not any(w in message for w in words):
            return [("read_jsonl names the file, the first bad line and its field",
                     f"{kind} at line {number} ({' or '.join(words)}): {message[:200]}")]
        return []
    if not case.requests:
        if not (isinstance(got, DatasetError) and repr(str(path)) in message and "no request" in message):
            return [("read_jsonl refuses a file without a request", f"{got!r:.160}")]
        return []
    if got != list(case.requests):
        return [("read_jsonl gives a valid file's requests exactly",
                 f"{got!r:.200}, expected {list(case.requests)!r:.200}")]
    return []


sharegpt_turns = st.fixed_dictionaries({"from": st.one_of(st.sampled_from(["human", "gpt", "system"]),
                                                          st.text(max_size=4)),
                                        "value": st.text(st.characters(codec="utf-8"), max_size=24)})
sharegpt_elements = st.one_of(
    st.fixed_dictionaries({"id": st.one_of(st.text(max_size=6), st.integers(0, 10**6)),
                           "conversations": st.lists(sharegpt_turns, max_size=4)},
                          optional={"model": json_values, "lang": st.text(max_size=3)}),
    st.fixed_dictionaries({"id": st.text(max_size=4)}))


def conversation_of(element: dict[str, Any]) -> ShareGPTConversation | None:
    turns = element.get("conversations") or []
    if len(turns) < 2:
        return None
    return ShareGPTConversation(str(element.get("id", "")), turns[0]["value"], turns[1]["value"],
                                turns[0]["from"] == "human")


@dataclass(frozen=True)
class ShareGPTCase:
    body: bytes
    elements: tuple[dict[str, Any], ...]
    ends: tuple[int, ...]  # the byte offset just past each element
    close: int  # just past the array's "]"
    keep: int  # the file is cut here
    block: int | None  # READ_BLOCK_CHARS for this read (None: the module's)
    where: str  # the kind of place cut at, or the malformed element's defect
    malformed: tuple[int, str] | None = None  # the malformed element's number (1-based), what its refusal says


def _array(parts: list[str], indent: str) -> tuple[str, list[int]]:
    """A JSON array of these element texts, on one line or one element a line (`indent`), and the end
    (in characters) of each."""
    text, ends = "[", []
    for i, part in enumerate(parts):
        text += ("," if i else "") + indent + part
        ends.append(len(text))
    return text + (indent[:1] if parts else "") + "]", ends


indents = st.sampled_from(["", "\n", "\n  ", "\n\t"])


def sharegpt_file(elements: list[dict[str, Any]], *, ascii_: bool, indent: str, before: str = "",
                  after: str = "") -> tuple[bytes, tuple[int, ...], int]:
    """The file of these elements: its bytes, the byte offset past each element and past the "]"."""
    text, ends = _array([json.dumps(e, ensure_ascii=ascii_) for e in elements], indent)
    text = before + text + after
    return (text.encode(), tuple(len(text[:len(before) + e].encode()) for e in ends),
            len(text[:text.rindex("]") + 1].encode()))


PLACES = ("anywhere", "inside a UTF-8 character", "inside an escape", "after a comma", "at an element's end",
          "before the closing bracket", "inside a string", "inside a number or literal", "whole")


@st.composite
def sharegpt_cut(draw: st.DrawFn, place: str) -> ShareGPTCase:
    """A ShareGPT array cut at this kind of place (anywhere, where the array has none)."""
    elements = draw(st.lists(sharegpt_elements, max_size=6))
    body, byte_ends, close = sharegpt_file(elements, ascii_=draw(st.booleans()), indent=draw(indents),
                                           before=draw(JSON_SPACE), after=draw(st.sampled_from(["", "\n"])))
    places = {
        "anywhere": list(range(len(body) + 1)),
        "inside a UTF-8 character": [i for i in range(len(body)) if body[i] & 0xC0 == 0x80],
        "inside an escape": [m.start() + k for m in re.finditer(rb"\\(u[0-9a-f]{4}|.)", body)
                             for k in range(1, m.end() - m.start())],
        "after a comma": [i + 1 for i in range(len(body)) if body[i:i + 1] == b","],
        "at an element's end": list(byte_ends),
        "before the closing bracket": [close - 1],
        "inside a string": [m.start() + k for m in re.finditer(rb'"[^"\\]{2,}"', body) for k in (1, 2)],
        "inside a number or literal": [m.start() + 1 for m in re.finditer(rb"(\d{2,}|true|false|null)", body)],
        "whole": [len(body)],
    }
    where = place if places[place] else "anywhere"
    keep = draw(st.sampled_from(places[where]))
    block = draw(st.one_of(st.none(), st.integers(1, 48)))
    return ShareGPTCase(body[:keep], tuple(elements), byte_ends, close, keep, block, where)


MALFORMED = [  # (what, element text, the words its refusal names)
    ("not an object", '"text"', "must be an object"), ("not an object", "[1, 2]", "must be an object"),
    ("not an object", "null", "must be an object"), ("not an object", "3.5", "must be an object"),
    ("conversations not a list", '{"id": "m", "conversations": "hi"}', "conversations must be a list"),
    ("conversations not a list", '{"id": "m", "conversations": {"value": "x"}}', "conversations must be a list"),
    ("a turn not an object", '{"id": "m", "conversations": ["hi", {"value": "y"}]}', "conversations[0]"),
    ("a turn without a string value", '{"id": "m", "conversations": [{"value": "x"}, {"value": 5}]}',
     "conversations[1]"),
    ("two commas", '{"id": "m",, "conversations": []}', "not valid JSON"),
    ("a trailing comma", '{"id": "m",}', "not valid JSON"),
    ("single quotes", "{'id': 'm'}", "not valid JSON"),
    ("a missing colon", '{"id" "m"}', "not valid JSON"),
    ("a control character", '{"id": "a\x01b"}', "not valid JSON"),
    ("a missing comma", '{"id": "m"} {"id": "n"}', "after element"),
]


@st.composite
def sharegpt_malformed(draw: st.DrawFn, which: int) -> ShareGPTCase:
    """MALFORMED[which] after 0..3 elements and before 0..2."""
    before = draw(st.lists(sharegpt_elements, max_size=3))
    after = draw(st.lists(sharegpt_elements, max_size=2))
    what, raw, words = MALFORMED[which]
    text, _ = _array([json.dumps(e) for e in before] + [raw] + [json.dumps(e) for e in after], draw(indents))
    body = text.encode()
    return ShareGPTCase(body, tuple(before), (), len(body), len(body), draw(st.one_of(st.none(), st.integers(1, 48))),
                        what, malformed=(len(before) + 1, words))


def judge_sharegpt(case: ShareGPTCase, source: str, got: Any) -> list[tuple[str, str]]:
    if isinstance(got, BaseException) and not isinstance(got, DatasetError):
        return [("parse_sharegpt: a read or a DatasetError, never another exception",
                 f"{type(got).__name__}: {str(got)[:160]}")]
    if case.malformed is not None:
        number, words = case.malformed
        if not isinstance(got, DatasetError):
            return [("parse_sharegpt refuses a malformed element", f"{case.where} (element {number}) read as "
                                                                     f"{got.read} elements, torn {got.torn}")]
        message = str(got)
        if repr(source) not in message or f"element {number}" not in message or words not in message:
            return [("parse_sharegpt names the file and the malformed element", f"{case.where} (element {number}, "
                                                                                 f"{words!r}): {message[:200]}")]
        return []
    if not case.body.strip():
        ok = isinstance(got, DatasetError) and "is empty" in str(got)
        return [] if ok else [("parse_sharegpt refuses an empty file", f"{got!r:.160}")]
    if isinstance(got, DatasetError):
        return [("parse_sharegpt reads a cut array as torn, not as a DatasetError",
                 f"cut {case.where} (byte {case.keep}): {str(got)[:200]}")]
    complete = sum(1 for e in case.ends if e <= case.keep)
    expected = tuple(c for e in case.elements[:complete] if (c := conversation_of(e)) is not None)
    if (got.read, got.torn, got.conversations) != (complete, case.keep < case.close, expected):
        return [("parse_sharegpt reads the complete elements before a cut, and says torn",
                 f"cut {case.where} (byte {case.keep}): read {got.read}, torn {got.torn}, {len(got.conversations)} "
                 "conversations; "
                 f"expected {complete}, {case.keep < case.close}, {len(expected)}")]
    return []


def bounded(call: Callable[[], Any], timeout: float) -> Any:
    """call() in a thread, bounded: its result or exception, or TimeoutError where it hangs."""
    box: list[Any] = [TimeoutError(f"no answer within {timeout:g} s")]

    def target() -> None:
        try:
            box[0] = call()
        except BaseException as exc:  # noqa: BLE001 - judged by the caller
            box[0] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    return box[0]


def read_sharegpt_bytes(case: ShareGPTCase, source: str) -> Any:
    original = datasets.READ_BLOCK_CHARS
    if case.block is not None:
        datasets.READ_BLOCK_CHARS = case.block
    try:
        return bounded(lambda: parse_sharegpt(io.BytesIO(case.body), source), FILE_TIMEOUT_S)
    finally:
        datasets.READ_BLOCK_CHARS = original


# -- cases earlier runs found, replayed first in every run ---------------------------------------

DEEP = 5000  # nesting past Python's recursion limit: json.loads raises RecursionError, not ValueError
LONG_NUMBER = "9" * 5000  # past the 4300 digits Python reads: json.loads raises a plain ValueError


def _sse(*datas: str) -> bytes:
    return "".join(f"data: {d}\n\n" for d in datas).encode()


FIN = '{"choices": [{"text": "", "finish_reason": "stop"}]'
STREAM_EDGES = [
    # the issue: llama-server's events carry several tokens; the point counts usage's 7, not 3 events
    Answer(COMPLETE, False, _sse('{"choices": [{"text": "Hello, "}]}', '{"choices": [{"text": "wor"}]}',
                                 '{"choices": [{"text": "ld!", "finish_reason": "length"}], "usage": '
                                 '{"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}', "[DONE]"),
           text="Hello, world!", finish="LENGTH",
           usage={"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}),
    Answer(ANY, False, _sse('{"choices": [{"text": "a"}]}', FIN + ', "timings": {"cache_n": NaN}}', "[DONE]")),
    Answer(ANY, True, _sse('{"choices": [{"delta": {"content": "a"}}]}', FIN + ', "timings": {"cache_n": Infinity}}')),
    Answer(ANY, False, _sse('{"choices": [{"text": "a"}]}', FIN + ', "timings": {"prompt_n": 1' + "0" * 400 + "}}")),
    Answer(REFUSED, False, _sse('{"choices": [{"text": "a"}]}', "[" * DEEP + "]" * DEEP), text="a",
           finish="data nested 5000 deep"),
    Answer(STATUS, False, b"[" * DEEP + b"]" * DEEP, status=400, headers=(("Content-Type", "application/json"),)),
    Answer(STATUS, False, b'{"error": {"message": "slow down"}}', status=429,
           headers=(("Content-Type", "application/json"), ("Retry-After", "9" * 400))),
    # every status of the table, and one of each other kind, whatever hypothesis draws
    *(Answer(STATUS, status % 2 == 0, b'{"error": {"message": "refused", "type": "x", "code": %d}}' % status,
             status=status, headers=(("Content-Type", "application/json"),))
      for status in (*TABLE, 418, 599, 201, 302)),
]
JSONL_EDGES = [
    JsonlCase(b'{"prompt": "x"}\n{"prompt": "y", "max_tokens": ' + LONG_NUMBER.encode() + b"}\n",
              (JsonlRequest(1, prompt="x"),), (2, ("max_tokens", "not JSON"), "huge max_tokens"), False),
    JsonlCase(b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}\n", (), (1, ("prompt", "not JSON"), "nested 5000 deep"),
              False),
    JsonlCase(b'\xef\xbb\xbf{"prompt": "x"}\r\n\r\n{"prompt": "y"}\r\n', (JsonlRequest(1, prompt="x"),
                                                                          JsonlRequest(3, prompt="y")), None, True),
]


def _sharegpt_edge(text: bytes, what: str, words: str = "element 1") -> ShareGPTCase:
    return ShareGPTCase(text, (), (), len(text), len(text), None, what, malformed=(1, words))


_TWO_TURNS = {"id": "a", "conversations": [{"from": "human", "value": "h\u00e9"}, {"from": "gpt", "value": "x"}]}
_BODY, _ENDS, _CLOSE = sharegpt_file([_TWO_TURNS, _TWO_TURNS], ascii_=False, indent="")
_INSIDE = _BODY.rindex("\u00e9".encode()) + 1  # between the two bytes of the second element's "é"
SHAREGPT_EDGES = [
    _sharegpt_edge(b'[{"id": ' + LONG_NUMBER.encode() + b"}]", "an id of 5000 digits"),
    _sharegpt_edge(b'[{"id": "a", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}]", "nested 5000 deep"),
    _sharegpt_edge(b'[{"id": "b",, "conversations": []}]', "two commas in the last element", "not valid JSON"),
    ShareGPTCase(_BODY[:_INSIDE], (_TWO_TURNS, _TWO_TURNS), _ENDS, _CLOSE, _INSIDE, None, "inside a UTF-8 character"),
]


# -- the run ---------------------------------------------------------------------------------------

# Examples of each strategy (those per kind: of each kind, at least 2), quick and full.
QUICK = {"streams": 80, "defective": 48, "odd": 30, "torn": 60, "refusals": 60, "other types": 8, "huge": 2,
         "jsonl": 130, "sharegpt cuts": 108, "sharegpt malformed": 42}
FULL = {"streams": 800, "defective": 400, "odd": 300, "torn": 500, "refusals": 400, "other types": 60, "huge": 6,
        "jsonl": 1300, "sharegpt cuts": 1200, "sharegpt malformed": 420}
HUGE_CHARS = {True: 1 << 18, False: 1 << 22}  # one line of 256 Ki characters (quick) or 4 Mi


class Tally:
    """Cases by kind, and for each failed check how many cases failed it and the first of them."""

    def __init__(self) -> None:
        self.cases: Counter[str] = Counter()
        self.failing_cases = 0
        self.failed: dict[str, list[str]] = {}

    def record(self, kind: str, wrong: list[tuple[str, str]], replay: Callable[[], str]) -> None:
        self.cases[kind] += 1
        self.failing_cases += bool(wrong)
        for check, what in wrong:
            if check not in self.failed:
                self.failed[check] = []
                note(NAME, f"first failure of {check!r} ({kind}): {what}; the whole case: {_cut(replay())}")
            self.failed[check].append(what)


def _cut(text: str) -> str:
    return text if len(text) <= 1200 else f"{text[:900]}...({len(text)} characters)...{text[-200:]}"


class LoopThread:
    """An event loop in a thread, for the server and the client; `run` bounds each coroutine."""

    def __enter__(self) -> LoopThread:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():
                raise  # the coroutine's own TimeoutError
            future.cancel()
            raise Hung from None

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class Hung(Exception):
    pass


def fuzz(strategy: st.SearchStrategy[Any], target: Callable[[Any], None], examples: int) -> None:
    settings(max_examples=max(2, examples), database=None, deadline=None, derandomize=True,
             suppress_health_check=list(HealthCheck))(given(strategy)(target))()


def fuzz_streams(quick: bool, n: dict[str, int], tally: Tally) -> None:
    with LoopThread() as loop:
        server = FakeServer()
        loop.run(server.start(), 30)
        client = OpenAIClient(server.url, concurrency=4)  # one client for all: connections are reused
        sent = iter(range(10**9))

        def send(answer: Answer) -> None:
            key = f"case-{next(sent)}"
            server.answers[key] = answer
            got = Got()
            try:
                loop.run(read_answer(client, key, answer.chat, got), CASE_TIMEOUT_S)
            except Hung:
                got.hung = True
            except Exception as exc:  # noqa: BLE001 - outside the contract: judged
                got.crash = exc
            wrong = judge(answer, got, server.received.pop(key, None), key)
            del server.answers[key]
            tally.record(f"stream {answer.kind}", wrong, lambda: repr(answer))

        try:
            for answer in STREAM_EDGES:
                send(answer)
            fuzz(streams(), send, n["streams"])
            for defect in DEFECTS:
                fuzz(defective(defect), send, n["defective"] // len(DEFECTS))
            fuzz(defective(ODD), send, n["odd"])
            fuzz(torn(), send, n["torn"])
            fuzz(refusals(), send, n["refusals"])
            fuzz(other_types(), send, n["other types"])
            fuzz(huge(HUGE_CHARS[quick]), send, n["huge"])
        finally:
            loop.run(client.close(), 30)
            assert server.runner is not None
            loop.run(server.runner.cleanup(), 30)


def fuzz_files(n: dict[str, int], tally: Tally) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-http-") as folder:
        path = Path(folder, "requests.jsonl")

        def read(case: JsonlCase) -> None:
            path.write_bytes(case.body)
            got = bounded(lambda: read_jsonl(path), FILE_TIMEOUT_S)
            wrong = [("never a hang", str(got))] if type(got) is TimeoutError else judge_jsonl(case, path, got)
            tally.record("jsonl file", wrong, lambda: repr(case.body))

        def parse(case: ShareGPTCase) -> None:
            source = "sharegpt-case.json"
            got = read_sharegpt_bytes(case, source)
            wrong = [("never a hang", str(got))] if type(got) is TimeoutError else judge_sharegpt(case, source, got)
            tally.record("sharegpt malformed" if case.malformed else "sharegpt cut", wrong,
                         lambda: f"{case.body!r} (block {case.block}, {case.where})")

        for jsonl in JSONL_EDGES:
            read(jsonl)
        for sharegpt in SHAREGPT_EDGES:
            parse(sharegpt)
        for kind in BAD_LINES:
            fuzz(jsonl_files(kind), read, n["jsonl"] // len(BAD_LINES))
        for place in PLACES:
            fuzz(sharegpt_cut(place), parse, n["sharegpt cuts"] // len(PLACES))
        for which in range(len(MALFORMED)):
            fuzz(sharegpt_malformed(which), parse, n["sharegpt malformed"] // len(MALFORMED))


def run(quick: bool) -> Row:
    n = QUICK if quick else FULL
    tally = Tally()
    checks = Checks()
    started = time.monotonic()
    note(NAME, f"{sum(n[k] for k in ('streams', 'defective', 'odd', 'torn', 'refusals', 'other types', 'huge'))} "
               f"answers over HTTP, {n['jsonl'] + n['sharegpt cuts'] + n['sharegpt malformed']} dataset files")
    fuzz_streams(quick, n, tally)
    http_s = time.monotonic() - started
    fuzz_files(n, tally)
    files_s = time.monotonic() - started - http_s
    planned = sum(n.values()) + len(STREAM_EDGES) + len(JSONL_EDGES) + len(SHAREGPT_EDGES)
    ran = sum(tally.cases.values())
    checks.expect(ran >= planned * 0.9, f"only {ran} of about {planned} cases ran")
    for check, whats in tally.failed.items():
        checks.expect(False, f"{check}: {len(whats)} cases, e.g. {whats[0][:160]}")
    streamed = sum(v for k, v in tally.cases.items() if k.startswith("stream"))
    return checks.row(
        NAME,
        done=f"{ran} hypothesis cases ({', '.join(f'{k} {v}' for k, v in sorted(tally.cases.items()))}): answers of "
             "an aiohttp server on 127.0.0.1 read by OpenAIClient.decode (well-formed streams of 1..5 tokens an "
             "event, with usage anywhere or none, written in pieces cut at any byte; defects; torn; error statuses; "
             "other Content-Types; huge lines), JSONL files read by read_jsonl, ShareGPT arrays cut or malformed "
             "read by parse_sharegpt",
        expected="Chunks or an EngineError, never another exception or a hang; a well-formed stream's text, finish "
                 "reason and usage back, and _success counts usage.completion_tokens; error statuses classified "
                 "as openai_errors.py's table says, Retry-After finite; a JSONL file's requests exactly, or a "
                 "DatasetError naming the file, the first bad line and its field; a cut ShareGPT array's complete "
                 "elements and torn, a malformed element a DatasetError naming it",
        lost=len(tally.failed.get("a well-formed stream reads to its end", [])),
        figures={"http cases fuzzed": streamed, "file cases fuzzed": ran - streamed,
                 "failing cases": tally.failing_cases, "checks failed": len(tally.failed),
                 "seconds http/files": f"{http_s:.1f}/{files_s:.1f}"},
    )
