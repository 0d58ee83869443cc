"""The fuzz-http drill's dataset-file half: the bench client's readers of what files say.

JSONL files of valid, blank and defective lines (any defect at any line, a BOM, invalid UTF-8,
CRLF): `read_jsonl` gives the requests exactly, or a DatasetError naming the file, the FIRST bad line
and its field. ShareGPT arrays cut at any kind of place (inside a string, an escape, a UTF-8
character, after a comma...) and read in blocks of any size: `parse_sharegpt` reads the complete
elements before the cut and says torn; one with a malformed element raises a DatasetError naming
it. Each call is bounded in time; any other exception is a failure.

Here: the strategies of those files, the judges of each read, the cases earlier runs found
(JSONL_EDGES, SHAREGPT_EDGES, replayed first in every run) and `fuzz_all`, which reads them all into
the drill's CaseTally. drills/fuzz_http.py runs it, after the streams, as part of the one drill."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from bench_client import datasets
from bench_client.datasets import DatasetError, JsonlRequest, ShareGPTConversation, parse_sharegpt, read_jsonl
from bench_client.server_api import ChatTurn
from drills.fuzz_cases import DEEP, LONG_NUMBER, CaseTally, fuzz, json_scalars, json_values, sometimes

FILE_TIMEOUT_S = 10.0

# Examples of each strategy (those per kind: of each kind, at least 2), quick and full.
QUICK = {"jsonl": 130, "sharegpt cuts": 108, "sharegpt malformed": 42}
FULL = {"jsonl": 1300, "sharegpt cuts": 1200, "sharegpt malformed": 420}


# -- JSONL files ---------------------------------------------------------------------------------

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
        request = JsonlRequest(line, messages=tuple(ChatTurn(r, c) for r, c in messages))
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


# -- ShareGPT arrays -----------------------------------------------------------------------------

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


# -- cases earlier runs found, replayed first in every run ---------------------------------------

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


def fuzz_all(n: dict[str, int], tally: CaseTally) -> None:
    """Every dataset-file case: the edges first, then those hypothesis draws of each kind."""
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
