"""The fuzz-http drill: the bench client's readers of what servers and files say. This file holds
the HTTP-stream half and the drill's run; drills/fuzz_files.py the dataset-file half (JSONL files for
`read_jsonl`, ShareGPT arrays for `parse_sharegpt`); drills/fuzz_cases.py what both use.

Streams. A real aiohttp server on 127.0.0.1 answers POST /v1/completions and /v1/chat/completions
with hypothesis-drawn answers: well-formed event streams (1..k tokens an event, as llama-server sends
them; usage absent, on every event as vLLM's continuous usage, just before the finish event, in it or
after it; `[DONE]` or not; `:` pings, `id:`/`event:` lines, multi-line data, LF, CRLF or CR line
ends, a BOM, gzip), each written in TCP writes cut at any byte (inside a UTF-8 character too); the
same streams with a defect (data not JSON, JSON not an object, an error frame, no choices,
finish_reason abort), with events of any shape, cut by the transport or ended cleanly at any byte;
200 answers of another Content-Type; HTTP error statuses with any body and Retry-After; huge lines.
`OpenAIClient.decode` reads each to its end within a bound: Chunks, or an EngineError and never
another exception. A well-formed stream gives back its text, finish reason, usage and cached tokens,
and the point runner's own `_success` counts the usage's completion tokens; an error status is
classified as bench_client/openai_errors.py's table says.

Cases earlier runs found, and every status of the error table, are replayed first in every run
(STREAM_EDGES here; JSONL_EDGES and SHAREGPT_EDGES in fuzz_files.py). `run` fuzzes the streams, then
the files, into one CaseTally: the row lists each failed check with its count of cases and an example;
the first failing case of each check is printed whole on stderr, to replay it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from hypothesis import strategies as st

from bench_client.openai_http import CHAT_COMPLETIONS, COMPLETIONS, OpenAIClient
from bench_client.openai_json import chat_body, completion_body
from bench_client.point import _success
from bench_client.server_api import ChatTurn, Chunk, DecodeSpec
from drills import fuzz_files
from drills.common import note
from drills.fuzz_cases import DEEP, CaseTally, fuzz, json_scalars, json_values, sometimes
from drills.row import Checks, DrillRow
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


# -- what the fake server answers ----------------------------------------------------------------

COMPLETE, REFUSED, STATUS, TORN_CUT, TORN_END, ANY = "complete", "refused", "status", "torn-cut", "torn-end", "any"


@dataclass(frozen=True)
class ScriptedAnswer:
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
def well_formed(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int, ScriptedAnswer]:
    """(the events as JSON objects, the finish event's index, the ScriptedAnswer they make, unrendered); the
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
    answer = ScriptedAnswer(COMPLETE, chat, b"", text="".join(tokens), finish=expected_finish, usage=sent_usage,
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
def streams(draw: st.DrawFn) -> ScriptedAnswer:
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
def defective(draw: st.DrawFn, defect: str) -> ScriptedAnswer:
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
def torn(draw: st.DrawFn) -> ScriptedAnswer:
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
def refusals(draw: st.DrawFn) -> ScriptedAnswer:
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
    return ScriptedAnswer(STATUS, draw(st.booleans()), body, cuts=draw(cuts(body)), status=status,
                          headers=tuple(headers), context=context)


@st.composite
def other_types(draw: st.DrawFn) -> ScriptedAnswer:
    """A 200 answer that is not an event stream: REFUSED, whatever its body."""
    answer = draw(streams())
    kind = draw(st.sampled_from(["application/json", "text/plain", "text/html", "application/octet-stream", ""]))
    body = answer.body if draw(st.booleans()) else json.dumps({"choices": [{"text": answer.text}]}).encode()
    return dataclasses.replace(answer, kind=REFUSED, body=body, headers=(("Content-Type", kind),), text="",
                               finish="a 200 answer of another Content-Type")


@st.composite
def huge(draw: st.DrawFn, size: int) -> ScriptedAnswer:
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
    return ScriptedAnswer(REFUSED if kind == "not JSON" else COMPLETE, chat, body, text=text if kind == "text" else "",
                          cuts=tuple(range(1 << 16, len(body), 1 << 16)), finish="LENGTH", usage=usage)


# -- the server and the judge --------------------------------------------------------------------


class FakeServer:
    """aiohttp on 127.0.0.1:0 answering each request with the ScriptedAnswer registered for its prompt."""

    def __init__(self) -> None:
        self.answers: dict[str, ScriptedAnswer] = {}
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
                      messages=(ChatTurn("user", key),) if chat else ())
    try:
        async for chunk in client.decode(spec, timeout=CLIENT_TIMEOUT_S):
            got.chunks.append(chunk)
    except EngineError as err:
        got.error = err


def judge(answer: ScriptedAnswer, got: Got, request: tuple[str, dict[str, Any]] | None,
          key: str) -> list[tuple[str, str]]:
    """The checks this answer fails: (check, what happened)."""
    if got.hung:
        return [("never a hang", f"no end within {CASE_TIMEOUT_S:g} s")]
    if got.crash is not None:
        return [("Chunks or an EngineError, never another exception", f"{type(got.crash).__name__}: {got.crash}"[:200])]
    wrong: list[tuple[str, str]] = []
    spec_body = (completion_body if not answer.chat else chat_body)(DecodeSpec(
        key, (), 16, False, 0.0, 1.0, 0, 0, prompt_text="" if answer.chat else key,
        messages=(ChatTurn("user", key),) if answer.chat else ()), None)
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


# -- cases earlier runs found, replayed first in every run ---------------------------------------


def _sse(*datas: str) -> bytes:
    return "".join(f"data: {d}\n\n" for d in datas).encode()


FIN = '{"choices": [{"text": "", "finish_reason": "stop"}]'
STREAM_EDGES = [
    # the issue: llama-server's events carry several tokens; the point counts usage's 7, not 3 events
    ScriptedAnswer(COMPLETE, False, _sse('{"choices": [{"text": "Hello, "}]}', '{"choices": [{"text": "wor"}]}',
                                         '{"choices": [{"text": "ld!", "finish_reason": "length"}], "usage": '
                                         '{"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}', "[DONE]"),
                   text="Hello, world!", finish="LENGTH",
                   usage={"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}),
    ScriptedAnswer(ANY, False, _sse('{"choices": [{"text": "a"}]}', FIN + ', "timings": {"cache_n": NaN}}', "[DONE]")),
    ScriptedAnswer(ANY, True, _sse('{"choices": [{"delta": {"content": "a"}}]}',
                                   FIN + ', "timings": {"cache_n": Infinity}}')),
    ScriptedAnswer(ANY, False, _sse('{"choices": [{"text": "a"}]}',
                                    FIN + ', "timings": {"prompt_n": 1' + "0" * 400 + "}}")),
    ScriptedAnswer(REFUSED, False, _sse('{"choices": [{"text": "a"}]}', "[" * DEEP + "]" * DEEP), text="a",
                   finish="data nested 5000 deep"),
    ScriptedAnswer(STATUS, False, b"[" * DEEP + b"]" * DEEP, status=400,
                   headers=(("Content-Type", "application/json"),)),
    ScriptedAnswer(STATUS, False, b'{"error": {"message": "slow down"}}', status=429,
                   headers=(("Content-Type", "application/json"), ("Retry-After", "9" * 400))),
    # every status of the table, and one of each other kind, whatever hypothesis draws
    *(ScriptedAnswer(STATUS, status % 2 == 0, b'{"error": {"message": "refused", "type": "x", "code": %d}}' % status,
                     status=status, headers=(("Content-Type", "application/json"),))
      for status in (*TABLE, 418, 599, 201, 302)),
]


# -- the run ---------------------------------------------------------------------------------------

# Examples of each strategy (those per kind: of each kind, at least 2), quick and full.
# (The dataset files' are fuzz_files.QUICK and FULL.)
QUICK = {"streams": 80, "defective": 48, "odd": 30, "torn": 60, "refusals": 60, "other types": 8, "huge": 2}
FULL = {"streams": 800, "defective": 400, "odd": 300, "torn": 500, "refusals": 400, "other types": 60, "huge": 6}
HUGE_CHARS = {True: 1 << 18, False: 1 << 22}  # one line of 256 Ki characters (quick) or 4 Mi


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


def fuzz_streams(quick: bool, n: dict[str, int], tally: CaseTally) -> None:
    with LoopThread() as loop:
        server = FakeServer()
        loop.run(server.start(), 30)
        client = OpenAIClient(server.url, concurrency=4)  # one client for all: connections are reused
        sent = iter(range(10**9))

        def send(answer: ScriptedAnswer) -> None:
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


def run(quick: bool) -> DrillRow:
    n, n_files = (QUICK, fuzz_files.QUICK) if quick else (FULL, fuzz_files.FULL)
    tally = CaseTally(NAME)
    checks = Checks()
    started = time.monotonic()
    note(NAME, f"{sum(n.values())} answers over HTTP, {sum(n_files.values())} dataset files")
    fuzz_streams(quick, n, tally)
    http_s = time.monotonic() - started
    fuzz_files.fuzz_all(n_files, tally)
    files_s = time.monotonic() - started - http_s
    planned = (sum(n.values()) + sum(n_files.values()) + len(STREAM_EDGES) + len(fuzz_files.JSONL_EDGES)
               + len(fuzz_files.SHAREGPT_EDGES))
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
