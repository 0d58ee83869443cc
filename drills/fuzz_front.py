"""The fuzz-front drill: bad input at the engine's OpenAI-compatible HTTP front (--http-port), as the
fuzz drill (drills/fuzz.py) sends it to the gRPC one. One real engine process (the tiny model in
float32, a bearer token, --max-receive-bytes 256 KiB) gets, over raw sockets on 127.0.0.1:

* bodies for /v1/completions, /v1/chat/completions, /tokenize and /detokenize drawn by hypothesis:
  a valid body with one known field of a wrong JSON type or past its bound (NaN, Infinity, 1e400,
  400-digit integers, lone surrogates by \\ud800 escapes, token ids past the vocabulary, stop,
  logprobs, logit_bias and response_format at and past their bounds); a valid body with unknown
  fields of any JSON; bodies of any known fields, valid or not, stream true or false; each written
  as JSON with escapes or as raw UTF-8 (its lone surrogates then bytes that are not UTF-8),
  sometimes cut short or with a byte that is not UTF-8; garbage bytes; a wrong or missing token;
* bodies over the limit (413: announced by Content-Length and never sent, sent whole, chunked, after
  `Expect: 100-continue`), JSON nested past the parser's limit, numbers past float and int;
* connections half-closed after the request, cut mid-request-body, cut (FIN or RST) mid-stream at
  drawn points, broken HTTP framing, pipelined requests, headers that are not UTF-8.

Every answer must be 2xx or 4xx, never 5xx (a connection the caller cut or half-closed may get
none; one the caller completed must get one); a 4xx from the front has the JSON error body
(`message`, `type`, `code` its status, `param`): INVALID_FIELD names the body's field (never the
engine's name for it), the one at fault where the case has one; 401 for a wrong token, 413 over the
limit, 400 `body` for bytes that are not a JSON object. An OK answer is true to its request
(completion_tokens <= max_tokens and == it when finish_reason is length, the prompt's tokens counted,
log-probabilities exactly when asked, no stop string in the text; a stream of JSON chunks with one
finish_reason, its usage when asked, then `data: [DONE]`), all of it standard JSON (no NaN). Chat is
always a 400 (the tiny model has no chat template): `messages`, or the field at fault. Meanwhile a
greedy streamed completion over HTTP and a greedy Decode over gRPC, each on its own connection, keep
giving what they gave before the fuzz; at the end the engine still serves (/health 200, gRPC
SERVING), its running sequences and KV cache are back to 0, and its log has no error event.

Cases earlier runs found are replayed first in every run (EDGES and the raw CONNECTION cases)."""

from __future__ import annotations

import json
import math
import re
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from hypothesis import strategies as st

from drills import raw_http
from drills.common import DECODE_METHOD, EngineProcess, collect, note
from drills.fuzz_cases import CaseTally, fuzz, json_values, sometimes
from drills.raw_http import READ_TIMEOUT_S, Reply, abort, exchange, parse_reply, receive, sse_events, strict_json
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc

NAME = "fuzz-front"
TOKEN = "fuzz-front-token"
VOCAB, BOS, EOS = 258, 256, 257  # the tiny preset's byte tokenizer
MAX_CONTEXT = 256
MAX_NEW = 16  # --max-new-tokens: /v1/completions' default max_tokens (16) is at it
DEFAULT_MAX_TOKENS = 16
MAX_RECEIVE = 256 * 1024
CHARS_PER_TOKEN = 64  # text longer than this many characters per context token is refused untokenized
MAX_TOP_LOGPROBS = 20
COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
STEADY_PROMPTS = ("steady one", "steady two, a little longer")
# the engine's names for the body's fields: an answer must say the body's (OpenAICall.rename)
ENGINE_NAMES = ("sampling", "prompt_text", "prompt_token_ids", "max_new_tokens", "min_new_tokens", "chat",
                "echo_prompt_logprobs", "request_id", "text")
ENGINE_WORDS = ("sampling.", "max_new_tokens", "prompt_text", "prompt_token_ids", "min_new_tokens", "chat.messages")
GOOD_AUTH = f"Bearer {TOKEN}".encode()


def http_request(path: str, body: bytes | None, *, auth: bytes | None = GOOD_AUTH, **kw: Any) -> bytes:
    """drills.raw_http.request, with the drill's token unless told otherwise."""
    return raw_http.request(path, body, auth=auth, **kw)


# -- the cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FrontCase:
    """One request. `fault`: the field at fault (a 400 naming it is due), None when unknown;
    `valid`: the body is known to be served (200, or a 400 naming `messages` on chat)."""

    kind: str
    path: str
    raw: bytes  # the body
    fault: str | None = None
    valid: bool = False
    auth: bytes | None = GOOD_AUTH
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def replay(self) -> str:
        return f"{self.kind} {self.path} auth={self.auth!r} headers={self.headers!r} body={self.raw[:3000]!r}"


def encode(body: object) -> bytes:
    return json.dumps(body).encode()


def base(path: str) -> dict[str, Any]:
    """A body the front serves (chat: refused by name, `messages`, on the tiny model)."""
    return {COMPLETIONS: {"prompt": "fuzz", "max_tokens": 4},
            CHAT: {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 4},
            TOKENIZE: {"prompt": "fuzz"}, DETOKENIZE: {"tokens": [102, 117, 122]}}[path]


surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), st.characters(categories=["Cs"]),
                           st.text(max_size=3))
texts = st.one_of(st.text(max_size=12), surrogate_text)
not_number = st.one_of(st.text(max_size=4), st.booleans(), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
not_integer = st.one_of(not_number, st.sampled_from([1.5, -0.5, math.nan, math.inf, -math.inf, 1e-300]))
not_bool = st.one_of(st.text(max_size=4), st.integers(), st.floats(), st.lists(st.booleans(), max_size=2),
                     st.dictionaries(st.text(max_size=2), st.booleans(), max_size=1))
huge_numbers = st.sampled_from([10**400, -(10**400), 2**1100, 10**309, 1e308 * 10, -1e308 * 10, math.nan])
token = st.integers(0, VOCAB - 1)
past_vocab = st.one_of(st.integers(VOCAB, VOCAB + 2), st.integers(2**32 - 1, 2**32 + 1), st.integers(-3, -1))


def _floats_past(lo: float, hi: float) -> st.SearchStrategy[Any]:
    return st.one_of(not_number, huge_numbers, st.sampled_from([lo - 0.01, hi + 0.01, hi * 2 + 1, math.inf]))


# field -> values of a wrong type or past a bound: each refused, alone in a valid body, naming the field
WRONG_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(not_integer, st.sampled_from([0, MAX_NEW + 1, 2**32, -1, 10**400])),
    "max_completion_tokens": st.one_of(not_integer, st.sampled_from([0, MAX_NEW + 1, 2**32])),
    "temperature": _floats_past(0.0, 100.0),
    "top_p": st.one_of(not_number, huge_numbers, st.sampled_from([-0.5, 1.01, math.inf])),
    "top_k": st.one_of(not_integer, st.sampled_from([-2, 2**31, 10**400])),
    "min_p": _floats_past(0.0, 1.0),
    "repetition_penalty": st.one_of(not_number, huge_numbers, st.sampled_from([-1.0, 10.01, math.inf])),
    "presence_penalty": _floats_past(-2.0, 2.0),
    "frequency_penalty": _floats_past(-2.0, 2.0),
    "seed": st.one_of(not_integer, st.sampled_from([-1, 2**64, 10**400])),
    "min_tokens": st.one_of(not_integer, st.sampled_from([5, 2**32, -1])),  # 5 > the base's max_tokens 4
    "stop": st.one_of(st.integers(), st.booleans(), st.dictionaries(st.text(max_size=2), st.text(), max_size=1),
                      st.lists(st.one_of(st.integers(), st.none(), surrogate_text), min_size=1, max_size=2),
                      st.just(["a"] * 9), st.just([""]), st.just(["a" * 257]), st.just(["é" * 128 + "a"])),
    "stop_token_ids": st.one_of(st.integers(), st.text(max_size=3), st.lists(past_vocab, min_size=1, max_size=2),
                                st.just([1.5]), st.just([True])),
    "ignore_eos": not_bool,
    "stream": not_bool,
    "stream_options": st.one_of(not_bool, st.just({"include_usage": True})),  # without stream true: refused
    "logit_bias": st.one_of(
        st.text(max_size=3), st.lists(st.integers(), max_size=2),
        st.dictionaries(st.sampled_from(["a", "-1", "1.5", "", " 1", str(VOCAB), str(2**32), "9" * 11]),
                        st.just(1.0), min_size=1, max_size=1),
        st.dictionaries(st.sampled_from(["5", "0"]), st.one_of(not_number, huge_numbers,
                                                                st.sampled_from([100.5, -100.5])), min_size=1,
                        max_size=1),
        st.just({str(i): 1.0 for i in range(301)})),
    "response_format": st.one_of(
        st.text(max_size=5), st.lists(st.integers(), max_size=1),
        st.just({"type": "xml"}), st.just({}), st.just({"type": "json_schema"}),
        st.just({"type": "json_schema", "json_schema": 5}),
        st.just({"type": "json_schema", "json_schema": {"schema": 5}}),
        st.just({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        st.just({"type": "json_schema", "json_schema": {"schema": {"const": "\ud800"}}}),
        st.just({"type": "json_schema", "json_schema": {"schema": {"maximum": math.nan}}}),
        st.just({"type": "json_schema", "json_schema": {"schema": {"description": "a" * 70_000}}})),
    "model": st.one_of(st.integers(), st.booleans(), st.just("gpt-4"), surrogate_text, st.just({})),
    "n": st.sampled_from([2, 0, "1", -1, [1]]),
    "best_of": st.sampled_from([2, 0, "1"]),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
}
WRONG: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    COMPLETIONS: {
        **WRONG_COMMON,
        "prompt": st.one_of(st.integers(), st.booleans(), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                           max_size=1),
                            st.just([]), st.just([[]]), st.lists(past_vocab, min_size=1, max_size=3),
                            st.just([1.5]), st.just(["a", "b"]), st.just([[1], [2]]), st.just(""),
                            surrogate_text, st.just("a" * (CHARS_PER_TOKEN * MAX_CONTEXT + 1)),
                            st.just([65] * (MAX_CONTEXT - 1))),
        "logprobs": st.one_of(not_integer, st.sampled_from([MAX_TOP_LOGPROBS + 1, 2**32, -1])),
        "echo": not_bool,
        "suffix": st.one_of(st.just("x"), st.integers()),
    },
    CHAT: {
        **WRONG_COMMON,
        "messages": st.one_of(st.text(max_size=3), st.integers(), st.just({}), st.lists(st.integers(), min_size=1,
                                                                                          max_size=2),
                              st.just([{"role": 5, "content": "x"}]), st.just([{"content": "x"}]),
                              st.just([{"role": "user", "content": 5}]),
                              st.just([{"role": "user", "content": [{"type": "image_url"}]}]),
                              st.just([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                              st.builds(lambda t: [{"role": "user", "content": t}], surrogate_text)),
        "logprobs": not_bool,
        "top_logprobs": st.one_of(not_integer, st.sampled_from([MAX_TOP_LOGPROBS + 1, 2**32, -1])),
        "echo": st.sampled_from([True, 1, "yes"]),
    },
    TOKENIZE: {
        "prompt": st.one_of(st.integers(), st.booleans(), st.just(""), st.lists(st.integers(), max_size=2),
                            surrogate_text),
        "add_special_tokens": not_bool,
        "messages": st.one_of(st.just([{"role": 5, "content": "x"}]), st.just([5]),
                              st.just([{"role": "user", "content": "\ud800"}])),
    },
    DETOKENIZE: {"tokens": st.one_of(st.text(max_size=3), st.integers(), st.just({}),
                                     st.lists(past_vocab, min_size=1, max_size=2), st.just([1.5]),
                                     st.just([True]), st.just(["a"]))},
}
# each endpoint's fields, valid alone in the base body (bodies of many fields mix these with the wrong ones)
VALID_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, MAX_NEW), "temperature": st.sampled_from([0, 0.0, 0.7, 1, 100.0]),
    "top_p": st.sampled_from([1, 0.5, 1e-6]), "top_k": st.sampled_from([-1, 0, 1, 40, VOCAB, 2.0]),
    "min_p": st.sampled_from([0, 0.1, 1.0]), "repetition_penalty": st.sampled_from([1, 1.3, 10.0, 1e-3]),
    "presence_penalty": st.sampled_from([-2, 0.5, 2.0]), "frequency_penalty": st.sampled_from([-2.0, 0, 2]),
    "seed": st.sampled_from([0, 7, 2**64 - 1]), "min_tokens": st.integers(0, 4),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=8),
                      st.just(["é" * 128])),
    "stop_token_ids": st.lists(token, max_size=3), "ignore_eos": st.booleans(),
    "logit_bias": st.one_of(st.dictionaries(token.map(str), st.floats(-100, 100), max_size=4),
                            st.just({str(i): -100 for i in range(VOCAB)})),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}},
                                        {"type": "json_schema", "json_schema": {"schema": True}}]),
    "stream": st.booleans(), "model": st.just("tiny"), "n": st.just(1), "best_of": st.just(1), "tools": st.just([]),
    "user": texts,  # not the engine's: ignored
}
VALID: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    COMPLETIONS: {**VALID_COMMON,
                  "prompt": st.one_of(st.text(min_size=1, max_size=24), st.lists(token, min_size=1, max_size=24),
                                      st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=1),
                                      st.lists(st.lists(token, min_size=1, max_size=8), min_size=1, max_size=1)),
                  "logprobs": st.integers(0, MAX_TOP_LOGPROBS), "echo": st.booleans(), "suffix": st.just("")},
    CHAT: {**VALID_COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, MAX_TOP_LOGPROBS)},
    TOKENIZE: {"prompt": st.text(min_size=1, max_size=24), "add_special_tokens": st.booleans(),
               "return_token_strs": st.booleans()},
    DETOKENIZE: {"tokens": st.lists(token, max_size=12)},
}
ROUTES = (COMPLETIONS, COMPLETIONS, COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)  # completions decode: most of it

unknown_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(
    lambda k: all(k not in fields for fields in (*WRONG.values(), *VALID.values()))
    and k not in ("stream_options", "max_completion_tokens", "return_token_strs")), json_values, min_size=1,
    max_size=3)
# (not the token with a space after it: HTTP's whitespace around a header's value is not the value's)
bad_auth = st.one_of(st.none(), st.just(b"Bearer wrong"), st.just(b"bearer " + TOKEN.encode()),
                     st.just(GOOD_AUTH + b"x"), st.just(b"Bearer \xff\xfe" + TOKEN.encode()), st.just(b"Basic abc"))


@st.composite
def one_wrong_field(draw: st.DrawFn) -> FrontCase:
    path = draw(st.sampled_from(ROUTES))
    name = draw(st.sampled_from(sorted(WRONG[path])))
    body = {**base(path), name: draw(WRONG[path][name])}
    if name == "max_completion_tokens":
        body.pop("max_tokens")
    return FrontCase("one wrong field", path, encode(body), fault=name)


@st.composite
def valid_bodies(draw: st.DrawFn) -> FrontCase:
    """The base body with some valid fields, unknown ones (any JSON), or both: served as asked."""
    path = draw(st.sampled_from(ROUTES))
    body = base(path)
    valid = VALID[path]
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=5, unique=True)):
        body[name] = draw(valid[name])
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if path == CHAT and body.get("top_logprobs"):
        body["logprobs"] = True
    if "min_tokens" in body and "max_tokens" in body:
        body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    if draw(st.booleans()):
        body.update(draw(unknown_fields))
    return FrontCase("valid body", path, encode(body), valid=True)


@st.composite
def any_bodies(draw: st.DrawFn) -> FrontCase:
    """Any known fields, each valid, wrong or any JSON, unknown ones too, written as JSON with escapes or
    as raw UTF-8 (lone surrogates then not UTF-8), sometimes cut or with a byte that is not UTF-8."""
    path = draw(st.sampled_from(ROUTES))
    body: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(sorted({*VALID[path], *WRONG[path]})), max_size=8, unique=True)):
        choice = draw(st.integers(0, 5))
        pool = WRONG[path] if choice == 0 else VALID[path] if choice < 5 else {}
        body[name] = draw(pool[name]) if name in pool else draw(json_values)
    if draw(sometimes(3)):
        body.update(draw(unknown_fields))
    escaped = draw(st.booleans())
    raw = json.dumps(body, ensure_ascii=escaped).encode("utf-8", "surrogatepass")
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif mutation == 1:
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xf4\x90\x80\x80"])) + raw[at:]
    auth = draw(bad_auth) if draw(sometimes(15)) else GOOD_AUTH
    return FrontCase("any body", path, raw, auth=auth)


garbage = st.builds(lambda path, raw: FrontCase("garbage bytes", path, raw), st.sampled_from(ROUTES),
                    st.one_of(st.binary(max_size=512), st.text(max_size=64).map(str.encode),
                              st.sampled_from([b"", b"null", b"[]", b"5", b'"x"', b"NaN", b"{", b"}", b'{"a":}',
                                               b"\xef\xbb\xbf{}", b"{} {}", b"[" * 5000, b'{"a":' * 5000,
                                               b"9" * 5000])))

CASES = st.one_of(one_wrong_field(), one_wrong_field(), valid_bodies(), valid_bodies(), any_bodies(), garbage)


def _edges() -> list[FrontCase]:
    """Each field at its bounds (served) and just past them (refused by name), the regressions
    earlier runs found, and the bytes past what json.loads reads: whatever hypothesis draws, every
    run sends these first."""
    at = {"temperature": [0, 100], "top_p": [1, 1e-9], "top_k": [-1, 0, VOCAB], "min_p": [0, 1],
          "repetition_penalty": [1e-9, 10], "presence_penalty": [-2, 2], "frequency_penalty": [-2, 2],
          "seed": [0, 2**64 - 1], "min_tokens": [4], "max_tokens": [1, MAX_NEW], "logprobs": [0, MAX_TOP_LOGPROBS],
          "stop": [["a"] * 8, ["é" * 128], ["a" * 256]], "stop_token_ids": [[EOS, BOS, 0]],
          "logit_bias": [{"0": 100}, {str(VOCAB - 1): -100}, {str(i): 100 for i in range(VOCAB)}],
          "prompt": [[BOS], [0] * (MAX_CONTEXT - 4), "a" * (MAX_CONTEXT - 5), "\x00", "\U0001f600"]}
    past = {"temperature": [100.001, -1e-9, 10**400, 1e400], "top_p": [1.001, -1e-9], "top_k": [-2],
            "min_p": [1.001, -1e-9], "repetition_penalty": [10.001, -1e-9],
            "presence_penalty": [2.001, -2.001], "frequency_penalty": [2.001, -2.001, 10**309],
            "seed": [2**64, -1], "min_tokens": [5], "max_tokens": [0, MAX_NEW + 1, 10**400],
            "logprobs": [MAX_TOP_LOGPROBS + 1], "stop": [["a"] * 9, ["é" * 128 + "a"], ["a" * 257], ["\ud800"]],
            "stop_token_ids": [[VOCAB], [2**32]], "logit_bias": [{"0": 100.001}, {str(VOCAB): 0}, {"0": 10**400},
                                                                   {str(i): 0 for i in range(301)}],
            "prompt": [[VOCAB], [0] * (MAX_CONTEXT - 3), "a" * (MAX_CONTEXT - 4), "\ud800", "a\udfffb"]}
    cases = [FrontCase("edge at a bound", COMPLETIONS, encode({**base(COMPLETIONS), name: value}), valid=True)
             for name, values in at.items() for value in values]
    cases += [FrontCase("edge past a bound", COMPLETIONS, encode({**base(COMPLETIONS), name: value}), fault=name)
              for name, values in past.items() for value in values]
    cases += [FrontCase("edge past a bound", CHAT, encode({**base(CHAT), "top_logprobs": 3}), fault="top_logprobs"),
              FrontCase("edge at a bound", CHAT, encode({**base(CHAT), "logprobs": True, "top_logprobs": 20}), valid=True),
              FrontCase("edge at a bound", CHAT, encode({"messages": []}), valid=True),
              FrontCase("edge at a bound", COMPLETIONS, encode({**base(COMPLETIONS), "stream": True, "logprobs": 2,
                                                           "echo": True, "stream_options": {"include_usage": True}}),
                   valid=True),
              FrontCase("edge at a bound", COMPLETIONS, encode({**base(COMPLETIONS), "response_format": {
                  "type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}}, "max_tokens": 8}),
                   valid=True),
              FrontCase("edge at a bound", TOKENIZE, encode({"prompt": "é\x00\U0001f600", "add_special_tokens": False,
                                                        "return_token_strs": True}), valid=True),
              FrontCase("edge at a bound", DETOKENIZE, encode({"tokens": []}), valid=True),
              FrontCase("edge at a bound", DETOKENIZE, encode({"tokens": [BOS, 0xC3, EOS]}), valid=True)]
    # regressions: answered 500 before the fix (an integer past float's range became OverflowError;
    # a lone surrogate went into the protobuf string of Tokenize)
    cases += [FrontCase("regression", COMPLETIONS, b'{"prompt":"a","temperature":1' + b"0" * 400 + b"}",
                   fault="temperature"),
              FrontCase("regression", COMPLETIONS, b'{"prompt":"a","logit_bias":{"5":1' + b"0" * 400 + b"}}",
                   fault="logit_bias"),
              FrontCase("regression", TOKENIZE, b'{"prompt":"a\\ud800"}', fault="prompt")]
    # bytes past what json.loads reads: nesting past the recursion limit, 5000 digits
    cases += [FrontCase("deep", path, raw, fault="body") for path in (COMPLETIONS, CHAT, TOKENIZE) for raw in (
        b"[" * 100_000 + b"]" * 100_000, b'{"prompt":' * 3000 + b"1" + b"}" * 3000, b'{"prompt":' + b"9" * 5000 + b"}",
        b'{"prompt":"a","n":' + b"[" * 2000 + b"]" * 2000 + b"}")]
    cases += [FrontCase("deep", COMPLETIONS, b'{"prompt":"a","n":' + b"[" * depth + b"]" * depth + b"}", fault="n")
              for depth in (500, 900, 950, 970)]
    cases += [FrontCase("deep", COMPLETIONS, b'{"prompt":"a","max_tokens":2,"response_format":{"type":"json_schema",'
                                        b'"json_schema":{"schema":' + b'{"items":' * depth + b"{}" + b"}" * depth
                   + b"}}}", fault="response_format") for depth in (200, 800)]
    cases += [FrontCase("bad auth", COMPLETIONS, encode(base(COMPLETIONS)), auth=auth)
              for auth in (None, b"Bearer wrong", b"Bearer \xff\xfe", GOOD_AUTH + b"x", b"\x80")]
    return cases


EDGES = _edges()


# -- the oracle ------------------------------------------------------------------------------------

def _loads(raw: bytes) -> object:
    """The body as the engine reads it (json.loads), or a marker when it cannot. Parsed on a thread of
    its own: nesting past the recursion limit less the stack in use is refused, and the engine's
    handler has about 25 frames under it, the drill under pytest and hypothesis many more (the deep
    cases stay clear of the few levels between the two)."""
    return _PARSER.submit(_parse, raw).result()


def _parse(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return _NOT_JSON


_NOT_JSON = object()
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="fuzz-front-oracle")


def param_root(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def required(path: str) -> set[str]:
    return {COMPLETIONS: {"prompt", "max_tokens"}, CHAT: {"messages", "max_tokens"}, TOKENIZE: {"prompt"},
            DETOKENIZE: {"tokens"}}[path]


def judge(case: FrontCase, reply: Reply) -> list[tuple[str, str]]:
    """What this answer breaks, as (check, what)."""
    wrong: list[tuple[str, str]] = []
    status = reply.status
    if status is None:
        return [("an answer to a whole request", f"no answer: {reply.note}")]
    if not (200 <= status < 300 or 400 <= status < 500):
        return [("2xx or 4xx, never 5xx", reply.short())]
    if not reply.complete:
        wrong.append(("an answer whole in its framing", reply.short()))
    body = _loads(case.raw)
    good_auth = case.auth == GOOD_AUTH
    if not good_auth:
        expected, roots = 401, set()
    elif not isinstance(body, dict):
        expected, roots = 400, {"body"}
    elif case.fault is not None:
        expected, roots = 400, {case.fault} | ({"messages"} if case.path == CHAT else set())
    elif case.valid:
        expected, roots = (400, {"messages"}) if case.path in (CHAT,) or (
            case.path == TOKENIZE and "messages" in body) else (200, set())
    else:
        expected, roots = (400 if case.path == CHAT else None), set()
    if expected is not None and status != expected:
        wrong.append((f"the status due ({expected})", f"{reply.short()}, expected {expected} {sorted(roots)}"))
    if status >= 400:
        wrong += error_body(reply, body if isinstance(body, dict) else {}, case, roots)
    elif isinstance(body, dict):
        wrong += ok_answer(case.path, body, reply)
    return wrong


def error_body(reply: Reply, body: Mapping[str, Any], case: FrontCase, roots: set[str]) -> list[tuple[str, str]]:
    try:
        error = strict_json(reply.body)["error"]
        message, kind, param, code = error["message"], error["type"], error["param"], error["code"]
    except (ValueError, KeyError, TypeError):
        return [("a 4xx's JSON error body", reply.short())]
    wrong = []
    if not (isinstance(message, str) and message and isinstance(kind, str) and kind and code == reply.status):
        wrong.append(("a 4xx's JSON error body", reply.short()))
    if reply.status == 401 and (kind != "UNAUTHENTICATED" or reply.headers.get("www-authenticate") != "Bearer"):
        wrong.append(("401 UNAUTHENTICATED with WWW-Authenticate", reply.short()))
    if reply.status == 413 and kind != "RequestTooLarge":
        wrong.append(("413 RequestTooLarge", reply.short()))
    if kind == "INVALID_FIELD":
        if not isinstance(param, str) or not param:
            wrong.append(("INVALID_FIELD names its param", reply.short()))
            return wrong
        root = param_root(param)
        if root in ENGINE_NAMES or any(w in message for w in ENGINE_WORDS):
            wrong.append(("the body's names, not the engine's", f"param {param!r}: {message[:160]}"))
        allowed = {*body, *required(case.path), "body", "X-Request-Id", "X-Request-Timeout"}
        if root not in allowed:
            wrong.append(("param a field of the body", f"param {param!r} of body fields {sorted(body)[:12]}"))
        if roots and root not in roots:
            wrong.append(("param the field at fault", f"param {param!r}, expected one of {sorted(roots)}: "
                                                      f"{message[:160]}"))
    elif roots and roots != {"body"} and not (kind == "CONTEXT_LENGTH_EXCEEDED" and roots & {
            "prompt", "max_tokens", "max_completion_tokens", "messages", "min_tokens"}):
        wrong.append(("param the field at fault", f"{kind} ({message[:160]}), expected INVALID_FIELD of "
                                                  f"{sorted(roots)}"))
    elif roots == {"body"}:
        wrong.append(("400 body for bytes that are not a JSON object", reply.short()))
    return wrong


def _max_tokens(body: Mapping[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return int(body[name])
    return DEFAULT_MAX_TOKENS


def _prompt_tokens(prompt: object) -> int | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return 1 + len(prompt.encode("utf-8"))  # BOS, then one token a byte
    return len(prompt) if isinstance(prompt, list) else None


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)] if isinstance(stop, list) \
        else []


def ok_answer(path: str, body: Mapping[str, Any], reply: Reply) -> list[tuple[str, str]]:
    """What a 200 breaks of its request."""
    if path in (TOKENIZE, DETOKENIZE):
        return _ok_tokenize(path, body, reply)
    if path != COMPLETIONS:
        return [("chat refused on the tiny model (no template)", reply.short())]
    if body.get("stream") is True:
        return _ok_stream(body, reply)
    try:
        answer = strict_json(reply.body)
        choice, usage = answer["choices"][0], answer["usage"]
        text, finish, completion = choice["text"], choice["finish_reason"], usage["completion_tokens"]
    except (ValueError, KeyError, TypeError, IndexError):
        return [("an OK answer in OpenAI's shape, standard JSON", reply.short())]
    return _consistent(body, text, finish, completion, usage, choice.get("logprobs"))


def _consistent(body: Mapping[str, Any], text: str, finish: str, completion: int, usage: Mapping[str, Any] | None,
                logprobs: Any, whole: bool = True) -> list[tuple[str, str]]:
    """`whole`: text, completion and logprobs are the whole answer's (a stream without its usage
    has no token count: its count checks are skipped)."""
    wrong = []
    max_tokens = _max_tokens(body)
    if finish not in ("stop", "length"):
        wrong.append(("finish_reason stop or length", f"finish_reason {finish!r}"))
    if whole and (completion > max_tokens or (finish == "length" and completion != max_tokens)):
        wrong.append(("completion_tokens <= max_tokens, == at length",
                      f"{completion} tokens, finish {finish}, max_tokens {max_tokens}"))
    echo = body.get("echo") is True
    prompt = body["prompt"][0] if isinstance(body["prompt"], list) and len(body["prompt"]) == 1 and isinstance(
        body["prompt"][0], (str, list)) else body["prompt"]
    if usage is not None:
        expected = _prompt_tokens(prompt)
        if usage.get("prompt_tokens") != expected or usage.get("total_tokens") != (expected or 0) + completion:
            wrong.append(("usage counts the prompt", f"usage {usage}, prompt of {expected} tokens"))
    if echo and isinstance(prompt, str) and not text.startswith(prompt):
        wrong.append(("echo: the prompt first", f"text {text[:60]!r}, prompt {prompt[:60]!r}"))
    generated = text[len(prompt):] if echo and isinstance(prompt, str) else text
    if not echo:
        for stop in _stops(body):
            if stop in generated:
                wrong.append(("no stop string in the text", f"text {generated[:60]!r} has stop {stop!r}"))
    asked = body.get("logprobs") is not None  # served, so an integer (0: the chosen tokens' alone)
    if asked != (logprobs is not None):
        wrong.append(("logprobs exactly when asked", f"logprobs {body.get('logprobs')!r}: got {str(logprobs)[:80]}"))
    elif asked and whole and not echo and len(logprobs["tokens"]) != completion:
        wrong.append(("a log-probability a token", f"{len(logprobs['tokens'])} for {completion} tokens"))
    if body.get("response_format") == {"type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}} \
            and not any(w.startswith(generated) for w in ("true", "false")):
        wrong.append(("text true to the response_format", f"{generated!r} under a boolean schema"))
    return wrong


def _ok_stream(body: Mapping[str, Any], reply: Reply) -> list[tuple[str, str]]:
    events = sse_events(reply.body)
    if reply.headers.get("content-type", "").split(";")[0] != "text/event-stream" or events[-1:] != [b"[DONE]"]:
        return [("an event stream ending in [DONE]", reply.short())]
    texts, finishes, usage, logprobs = [], [], None, []
    for raw in events[:-1]:
        try:
            chunk = strict_json(raw)
        except ValueError:
            return [("each event standard JSON", f"{raw[:120]!r}")]
        if "error" in chunk:
            code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
            if not (isinstance(code, int) and 400 <= code < 500):
                return [("2xx or 4xx, never 5xx", f"error frame {raw[:200]!r}")]
            return []  # a 4xx told at the stream's end (a deadline): nothing more to check
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            texts.append(choice["text"])
            if choice.get("logprobs") is not None:
                logprobs += choice["logprobs"]["tokens"]
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
    include = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage") is True
    if len(finishes) != 1 or (usage is not None) != include:
        return [("one finish_reason, the usage when asked", f"finishes {finishes}, usage {usage} "
                                                            f"(include_usage {include})")]
    completion = usage["completion_tokens"] if usage is not None else 0
    return _consistent(body, "".join(texts), finishes[0], completion, usage,
                       {"tokens": logprobs} if logprobs else None, whole=usage is not None)


def _ok_tokenize(path: str, body: Mapping[str, Any], reply: Reply) -> list[tuple[str, str]]:
    try:
        answer = strict_json(reply.body)
    except ValueError:
        return [("an OK answer standard JSON", reply.short())]
    if path == DETOKENIZE:
        return [] if isinstance(answer.get("prompt"), str) else [("detokenize: the prompt's text", reply.short())]
    prompt = body.get("prompt")
    ids = list(prompt.encode("utf-8")) if isinstance(prompt, str) else None
    if ids is not None and body.get("add_special_tokens", True):
        ids = [BOS, *ids]
    if answer.get("tokens") != ids or answer.get("count") != len(ids or ()) or answer.get("max_model_len") != MAX_CONTEXT:
        return [("tokenize: the byte tokenizer's ids", f"{reply.short()} for {prompt!r:.60}")]
    return []


# -- connections that do not go as a request should ------------------------------------------------

@dataclass(frozen=True)
class Cut:
    """A connection cut by the caller: after `send` bytes of the request (None: all of it), with a
    half-close (FIN) or a RST, after reading `read` bytes of the answer (None: none)."""

    stream: bool
    send: int | None
    read: int | None
    rst: bool
    half_close: bool


STREAM_BODY = {"prompt": "cut me", "max_tokens": MAX_NEW, "ignore_eos": True, "stream": True}
WHOLE_BODY = {"prompt": "cut me", "max_tokens": MAX_NEW, "ignore_eos": True}

cuts = st.builds(Cut, stream=st.booleans(), send=st.one_of(st.none(), st.integers(0, 200)),
                 read=st.one_of(st.none(), st.integers(0, 1500)), rst=st.booleans(), half_close=st.booleans())


def cut_connection(port: int, cut: Cut) -> tuple[Reply | None, bool]:
    """Run the cut: (the answer when the caller half-closed and waited for it, else None; whether
    the whole request was sent). A half-closed caller may get an answer, or a close without one, or
    a stream cut short where the front read the FIN (`cut_short_stream`)."""
    data = http_request(COMPLETIONS, encode(STREAM_BODY if cut.stream else WHOLE_BODY))
    whole = cut.send is None or cut.send >= len(data)
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
    try:
        sock.sendall(data if whole else data[:cut.send])
        if cut.half_close:
            sock.shutdown(socket.SHUT_WR)
            if cut.read is None:
                received, ended = receive(sock, READ_TIMEOUT_S)
                return (parse_reply(received, ended) if received else None), whole
        got = b""
        while whole and cut.read is not None and len(got) < cut.read:  # a part request gets no answer to read
            chunk = sock.recv(cut.read - len(got))
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        return None, whole
    finally:
        if cut.rst:
            abort(sock)
        else:
            sock.close()
    return None, whole


def cut_short_stream(reply: Reply) -> list[tuple[str, str]]:
    """A half-closed caller's stream that ended before its last chunk. The front takes a caller's
    FIN as its leaving, as uvicorn (vLLM's, SGLang's) and Go's net/http do: aiohttp's protocol
    answers EOF by closing the transport, and the handler is cancelled wherever it is (aiohttp
    issue #3659). Read before the head (the usual case) that is no answer; read under load after
    the head, a stream cut short, which is what a caller who left would have got. What did come
    must still be the stream's own: whole events, each `data: ` and JSON."""
    events = reply.body.split(b"\n\n")[:-1]  # the last is cut, or empty after a whole event
    bad = [e for e in events if not (e.startswith(b"data: {") and _is_json(e[len(b"data: "):]))]
    return [("a cut stream's whole events, each data: and JSON", f"{bad[0][:160]!r}")] if bad else []


def _is_json(data: bytes) -> bool:
    try:
        strict_json(data)
    except ValueError:
        return False
    return True


# replayed first in every run, before the drawn ones
FIXED_CUTS = [
    Cut(stream=False, send=None, read=None, rst=False, half_close=True),  # half-closed after a whole request
    Cut(stream=True, send=None, read=None, rst=False, half_close=True),
    Cut(stream=False, send=120, read=None, rst=False, half_close=True),  # half-closed mid-body
    Cut(stream=False, send=120, read=None, rst=False, half_close=False),  # cut mid-body
    Cut(stream=True, send=30, read=None, rst=True, half_close=False),  # cut mid-headers, RST
    Cut(stream=True, send=None, read=200, rst=False, half_close=False),  # a stream cut after its head
    Cut(stream=True, send=None, read=600, rst=True, half_close=False),  # a stream cut mid-way, RST
    Cut(stream=False, send=None, read=0, rst=True, half_close=False),  # cut before the answer came, RST
    # streams reset at points along their chunks: one such reset landing under the front's write once
    # raised ClientConnectionResetError out of the handler, which aiohttp answered 500 and logged as an error
    *(Cut(stream=True, send=None, read=n, rst=True, half_close=False) for n in range(150, 1950, 150)),
]


def connection_cases(port: int) -> list[tuple[str, Callable[[], Reply], int | None]]:
    """(what, how, the status due: None for any 2xx/4xx) for whole requests that break HTTP's rules,
    the limit or the headers' contract; the front's JSON error body is judged where it gives one."""
    limit_body = b'{"prompt":"' + b"a" * (MAX_RECEIVE + 10) + b'"}'
    chunked_head = http_request(COMPLETIONS, None).replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunked = chunked_head + b"".join(b"2000\r\n" + b"a" * 0x2000 + b"\r\n" for _ in range(MAX_RECEIVE // 0x2000 + 2))
    announced = http_request(COMPLETIONS, limit_body)[:-len(limit_body)]
    small = encode({"prompt": "hi", "max_tokens": 2})

    def run(data: bytes, **kw: Any) -> Callable[[], Reply]:
        return lambda: exchange(port, data, **kw)

    def header(name: bytes, value: bytes) -> Callable[[], Reply]:
        return run(http_request(COMPLETIONS, small, headers=((name, value),)))

    return [
        ("413: a body over the limit, sent whole", run(http_request(COMPLETIONS, limit_body)), 413),
        # a regression: the engine waited for the limit's worth of bytes before answering
        # (read to the answer's end: aiohttp lingers a while on a connection whose body it did not read)
        ("413: over the limit by Content-Length, the body never sent", run(announced, limit=5.0, answer_only=True),
         413),
        ("413: after Expect: 100-continue", run(announced.replace(
            b"Connection: close", b"Expect: 100-continue\r\nConnection: close"), limit=5.0, answer_only=True), 413),
        ("413: a chunked body over the limit", run(chunked + b"0\r\n\r\n"), 413),
        # a regression: 500 (aiohttp reads bytes that are not UTF-8 as lone surrogates, which protobuf refuses)
        ("400: X-Request-Id not UTF-8", header(b"X-Request-Id", b"\xff\xfe"), 400),
        ("400: X-Request-Id not the contract's", header(b"X-Request-Id", b"a b/" + b"x" * 200), 400),
        ("400: X-Request-Timeout not seconds", header(b"X-Request-Timeout", b"soon"), 400),
        ("400: X-Request-Timeout not UTF-8", header(b"X-Request-Timeout", b"\xff"), 400),
        ("400: X-Request-Timeout NaN", header(b"X-Request-Timeout", b"nan"), 400),
        ("200: a traceparent of garbage", header(b"traceparent", b"\xff-zz"), 200),
        # a regression: 500 (the same lone surrogates, encoded to compare with the token)
        ("401: Authorization not UTF-8", run(http_request("/v1/models", None, method="GET",
                                                          auth=b"Bearer \xff" + TOKEN.encode())), 401),
        ("408 or an error frame: a deadline passed mid-stream", run(http_request(
            COMPLETIONS, encode(STREAM_BODY), headers=((b"X-Request-Timeout", b"0.002"),))), None),
        ("404: no such route", run(http_request("/v1/nope", small)), 404),
        ("405: a wrong method", run(http_request(COMPLETIONS, None, method="GET")), 405),
        ("405: POST /health", run(http_request("/health", small, auth=None)), 405),
        ("200: GET /v1/models", run(http_request("/v1/models", None, method="GET")), 200),
        ("400: a request line of garbage", run(b"\x00\xff garbage\r\n\r\n"), 400),
        ("400: a chunk size of garbage", run(chunked_head + b"zz\r\nabc\r\n0\r\n\r\n"), 400),
        ("400: a Content-Length of garbage", run(http_request(COMPLETIONS, small).replace(
            f"Content-Length: {len(small)}".encode(), b"Content-Length: -5")), 400),
        ("400: a header over 8 KiB", header(b"X-Big", b"a" * 9000), 400),
        ("200 twice: pipelined requests", lambda: _pipelined(port, small), 200),
    ]


def _pipelined(port: int, body: bytes) -> Reply:
    """Two requests in one write, the second with Connection: close: both answered, in order."""
    data = http_request(COMPLETIONS, body, close=False) + http_request(COMPLETIONS, body)
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(data)
        received, ended = receive(sock, READ_TIMEOUT_S)
    first = parse_reply(received, ended)
    head = received.find(b"HTTP/1.1", 1)
    second = parse_reply(received[head:], ended) if head > 0 else Reply(None, note="one answer of two")
    return second if first.status == 200 else first


# -- well-formed traffic alongside -----------------------------------------------------------------

def steady_body(prompt: str) -> bytes:
    return encode({"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stream": True})


def stream_text(reply: Reply) -> str | None:
    """A stream's text, None unless it ended in a finish_reason then [DONE]."""
    events = sse_events(reply.body)
    if reply.status != 200 or events[-1:] != [b"[DONE]"]:
        return None
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks) or chunks[-1]["choices"][0]["finish_reason"] != "length":
        return None
    return "".join(c["choices"][0]["text"] for c in chunks)


class Steady(threading.Thread):
    """Greedy requests on their own connections, compared with what they gave before the fuzz:
    streamed completions over HTTP and Decode over gRPC in turn."""

    def __init__(self, http_port: int, grpc_address: str, baseline: dict[str, tuple[str | None, tuple[int, ...]]]):
        super().__init__(daemon=True)
        self.http_port, self.grpc_address, self.baseline = http_port, grpc_address, baseline
        self.stop = threading.Event()
        self.sent = 0
        self.wrong: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            decode = grpc_decode(ch)
            while not self.stop.is_set():
                prompt = STEADY_PROMPTS[self.sent % len(STEADY_PROMPTS)]
                try:
                    text = stream_text(exchange(self.http_port, http_request(COMPLETIONS, steady_body(prompt))))
                except OSError as err:  # the engine gone or its port closed: told, and the drill goes on
                    text = f"{type(err).__name__}: {err}"
                tokens = collect(decode(grpc_request(prompt), timeout=30, metadata=AUTH_METADATA)).tokens
                self.sent += 2
                if (text, tokens) != self.baseline[prompt]:
                    self.wrong.append(f"{prompt!r}: HTTP {text!r}, gRPC {tokens}, before {self.baseline[prompt]}")


AUTH_METADATA = (("authorization", f"Bearer {TOKEN}"),)


def grpc_decode(channel: grpc.Channel) -> Any:
    return channel.unary_stream(DECODE_METHOD, request_serializer=pb.DecodeRequest.SerializeToString,
                                response_deserializer=pb.DecodeResponse.FromString)


def grpc_request(prompt: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(prompt_text=prompt, max_new_tokens=MAX_NEW, ignore_eos=True)


def wait_idle(engine: EngineProcess, timeout: float = 10.0) -> pb.Load:
    """GetLoad (with the token) until nothing runs and the KV cache is empty, or `timeout`."""
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel())
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=5, metadata=AUTH_METADATA)
        if (load.running_sequences == 0 and load.kv_cache_used_tokens == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


# -- the drill -------------------------------------------------------------------------------------

def run(quick: bool) -> DrillRow:
    n_cases = 400 if quick else 3000
    n_cuts = 24 if quick else 200
    checks = Checks()
    tally = CaseTally(NAME)
    statuses: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="drill-fuzz-front-") as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN)
        # float32: the greedy tokens of a prompt alone and in a batch must be the same
        with EngineProcess("--model", "tiny", "--dtype", "float32", "--max-batch", "8", "--max-context",
                           str(MAX_CONTEXT), "--max-new-tokens", str(MAX_NEW), "--http-port", "0",
                           "--max-receive-bytes", str(MAX_RECEIVE), "--auth-token-file", str(token_file)) as engine:
            port = raw_http.http_port(engine)
            with engine.channel() as channel:
                decode = grpc_decode(channel)
                baseline = {p: (stream_text(exchange(port, http_request(COMPLETIONS, steady_body(p)))),
                                collect(decode(grpc_request(p), timeout=30, metadata=AUTH_METADATA)).tokens)
                            for p in STEADY_PROMPTS}
            checks.expect(all(text and len(tokens) == MAX_NEW for text, tokens in baseline.values()),
                          f"the well-formed requests failed before the fuzz: {baseline}")
            steady = Steady(port, engine.address, baseline)
            steady.start()
            started = time.monotonic()

            def send(case: FrontCase) -> None:
                reply = exchange(port, http_request(case.path, case.raw, auth=case.auth, headers=case.headers))
                statuses[str(reply.status)] += 1
                tally.record(case.kind, judge(case, reply), case.replay)

            def send_cut(cut: Cut) -> None:
                reply, whole = cut_connection(port, cut)
                statuses["cut" if reply is None else str(reply.status)] += 1
                wrong = []
                if reply is not None and whole and reply.status == 200 and cut.stream and not reply.complete:
                    wrong = cut_short_stream(reply)
                elif reply is not None and whole:  # a half-closed caller's answer: the request's own
                    wrong = judge(FrontCase("cut", COMPLETIONS, encode(STREAM_BODY if cut.stream else WHOLE_BODY),
                                       valid=True), reply)
                elif reply is not None and reply.status is not None and reply.status >= 500:
                    wrong = [("2xx or 4xx, never 5xx", f"{cut}: {reply.short()}")]
                tally.record("cut connection", wrong, lambda: repr(cut))

            def send_connection(what: str, how: Callable[[], Reply], due: int | None) -> None:
                reply = how()
                statuses[str(reply.status)] += 1
                wrong = []
                if reply.status is None:
                    wrong.append(("an answer to a whole request", f"{what}: no answer ({reply.note})"))
                elif not (200 <= reply.status < 300 or 400 <= reply.status < 500):
                    wrong.append(("2xx or 4xx, never 5xx", f"{what}: {reply.short()}"))
                elif due is not None and reply.status != due:
                    wrong.append((f"the status due ({due})", f"{what}: {reply.short()}"))
                elif reply.status >= 400 and reply.headers.get("content-type", "").startswith("application/json"):
                    wrong += error_body(reply, {}, FrontCase(what, COMPLETIONS, b""), set())  # aiohttp's own: text
                tally.record("connection", wrong, lambda: what)

            note(NAME, f"{len(EDGES)} edges, {len(FIXED_CUTS)} cuts and the connection cases, then {n_cases} drawn "
                       f"bodies and {n_cuts} drawn cuts, with well-formed requests alongside")
            for case in EDGES:
                send(case)
            for cut in FIXED_CUTS:
                send_cut(cut)
            for what, how, due in connection_cases(port):
                send_connection(what, how, due)
            fuzz(CASES, send, n_cases)
            fuzz(cuts, send_cut, n_cuts)
            elapsed = time.monotonic() - started
            steady.stop.set()
            steady.join(60)
            alive = engine.proc is not None and engine.proc.poll() is None
            checks.expect(alive, f"engine exited with {engine.proc.returncode if engine.proc else '?'}")
            if alive:
                checks.expect(engine.health() == 1, "gRPC health not SERVING after the fuzz")
                health = exchange(port, http_request("/health", None, method="GET", auth=None))
                checks.expect(health.status == 200, f"/health after the fuzz: {health.short()}")
                load = wait_idle(engine)
                checks.expect(load.running_sequences == 0 and load.kv_cache_used_tokens == 0,
                              f"load not back to zero after the fuzz: {load}")
            errors = [e for e in engine.events if e.get("level") in ("error", "critical")]
    for event in errors[:1]:
        note(NAME, f"first error event in the engine's log: {json.dumps(event)[:3000]}")
    checks.expect(not errors, f"{len(errors)} error events in the engine's log, e.g. "
                              f"{[e.get('event') for e in errors[:3]]}")
    cases_run = sum(tally.cases.values())
    checks.expect(cases_run >= n_cases + n_cuts + len(EDGES), f"only {cases_run} cases ran")
    for check, whats in tally.failed.items():
        checks.expect(False, f"{check}: {len(whats)} cases, e.g. {whats[0][:300]}")
    checks.expect(steady.sent > 0, "no well-formed request ran during the fuzz")
    checks.expect(not steady.wrong, f"well-formed requests disturbed: {steady.wrong[:2]}")
    return checks.row(
        NAME,
        done=f"{cases_run} cases at the HTTP front ({', '.join(f'{k} {v}' for k, v in sorted(tally.cases.items()))}): "
             f"JSON bodies with wrong types and values past bounds, garbage and bytes not UTF-8, bodies over "
             f"--max-receive-bytes, deep nesting, bad tokens and headers, broken framing, connections half-closed "
             f"and cut; {steady.sent} well-formed greedy requests alongside (HTTP stream and gRPC)",
        expected="every answer 2xx or 4xx, never 5xx; 4xx with the JSON error body, INVALID_FIELD naming the body's "
                 "field at fault; 401 bad token, 413 over the limit; OK answers true to the request; well-formed "
                 "text unchanged; engine serving, load back to 0, no error in its log",
        lost=len(steady.wrong),
        figures={"cases fuzzed": cases_run, "answers": dict(sorted(statuses.items())),
                 "well-formed requests": steady.sent, "seconds": round(elapsed, 1)},
    )
