"""Bad input fuzz: hypothesis-generated DecodeRequests (NaN and infinite floats, huge integers,
empty and huge prompts, unicode, token ids at and past the vocabulary, unset oneofs, unknown fields;
stop strings, log-probabilities, penalties, min_p, min_new_tokens, logit_bias and response_formats
at and past each bound; chat prompts, which the tiny model has no template for), TokenizeRequests,
and raw garbage bytes, all sent as bytes on the method paths. Every answer must be OK or
INVALID_ARGUMENT (INVALID_FIELD with a BadRequest field violation, or CONTEXT_LENGTH_EXCEEDED), and
the one the contract predicts for those bytes: the status, the field named, the prompt tokens
counted; an OK stream is checked against the request (log-probabilities, stop strings, the
response_format, min_new_tokens), an OK Tokenize gives the byte tokenizer's ids and one piece
each. Meanwhile well-formed greedy requests on another connection keep producing the same tokens."""

from __future__ import annotations

import json
import math
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drills.common import DECODE_METHOD, CallResult, EngineProcess, answer_of, collect, note
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb

NAME = "fuzz"
TOKENIZE_METHOD = "/engine.v1.EngineService/Tokenize"
VOCAB = 258  # the tiny preset's byte tokenizer: 256 bytes + BOS + EOS
BOS, EOS = 256, 257
MAX_CONTEXT = 256
MAX_NEW = 8
GOOD_PROMPTS = ("steady one", "steady two, a little longer", "3")

# The contract's bounds (proto/engine/v1/engine.proto; engine_service/requests.py enforces them).
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: [-2, 2]
MAX_BIAS = 100.0
MAX_BIAS_ENTRIES = 300
MAX_STOPS = 8
MAX_STOP_BYTES = 256
MAX_TOP_LOGPROBS = 20
MAX_FORMAT_BYTES = 65_536
CHARS_PER_TOKEN = 64  # text longer than this many characters per context token is refused untokenized
MAX_TEXT_CHARS = CHARS_PER_TOKEN * MAX_CONTEXT

u32 = st.integers(0, 2**32 - 1)
f32 = st.floats(allow_nan=True, allow_infinity=True, width=32)
huge_text = st.builds(lambda ch, n: ch * n, st.characters(), st.integers(MAX_CONTEXT, 70 * MAX_CONTEXT))


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid about four times in five, so that enough requests pass the boundary and decode."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i in (3, 7) else valid)


def optional(default: object, valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """For the newer fields: unset half the time, invalid one time in twenty (there are many of
    them; each is refused on its own, and enough requests must still decode). Hypothesis draws the
    simplest value (0) often: that is the default, never the invalid one."""
    return st.integers(0, 19).flatmap(lambda i: invalid if i == 13 else valid if i >= 10 else st.just(default))


def _f32_step(x: float, up: bool) -> float:
    """The float32 next to x (upwards or downwards): the first value past a bound."""
    if x == 0.0:
        return 2.0**-149 if up else -(2.0**-149)
    bits = struct.unpack("<I", struct.pack("<f", x))[0] + (1 if (x > 0) == up else -1)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def f32_in(lo: float, hi: float, *also: float) -> st.SearchStrategy[float]:
    """Valid float32 values: the bounds themselves, the smallest subnormal when in range, any between."""
    edges = [v for v in (lo, hi, 2.0**-149, -(2.0**-149), *also) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, width=32))


def f32_out(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Just past each bound, NaN, the infinities, or any float32 (which may happen to be valid)."""
    return st.one_of(st.sampled_from([_f32_step(lo, False), _f32_step(hi, True), math.nan, math.inf, -math.inf]), f32)


token_ids = mostly(st.integers(0, VOCAB - 1), st.one_of(st.integers(VOCAB - 2, VOCAB + 2), u32))
roles = st.one_of(st.sampled_from(["user", "assistant", "system", ""]), st.text(max_size=12))
chat_messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=40)), max_size=4)
prompts = mostly(
    st.one_of(st.tuples(st.just("text"), st.text(min_size=1, max_size=200)),
              st.tuples(st.just("ids"), st.lists(token_ids, min_size=1, max_size=64))),
    st.one_of(st.tuples(st.just("unset"), st.none()), st.tuples(st.just("text"), st.text(max_size=1)),
              st.tuples(st.just("text"), huge_text), st.tuples(st.just("ids"), st.lists(token_ids, max_size=1)),
              st.tuples(st.just("ids"), st.lists(token_ids, min_size=MAX_CONTEXT - 8, max_size=MAX_CONTEXT + 8)),
              st.tuples(st.just("chat"), chat_messages)),
)

bias_values = f32_in(-MAX_BIAS, MAX_BIAS)
logit_biases = optional(
    {},
    st.one_of(st.dictionaries(st.integers(0, VOCAB - 1), bias_values, min_size=1, max_size=6),
              st.builds(lambda v: dict.fromkeys(range(VOCAB), v), bias_values)),  # every id: at the entry bound
    st.one_of(st.dictionaries(st.one_of(st.integers(VOCAB, VOCAB + 2), u32), bias_values, min_size=1, max_size=3),
              st.dictionaries(st.integers(0, VOCAB - 1), f32_out(-MAX_BIAS, MAX_BIAS), min_size=1, max_size=3),
              st.just(dict.fromkeys(range(MAX_BIAS_ENTRIES + 1), 1.0))),
)


def sampling(max_new: int) -> st.SearchStrategy[pb.SamplingParams]:
    return st.builds(
        pb.SamplingParams,
        temperature=mostly(st.floats(0, 2, width=32), f32),
        top_p=mostly(st.floats(0, 1, width=32), f32),
        top_k=mostly(st.integers(0, VOCAB), st.integers(-(2**31), 2**31 - 1)),
        seed=st.integers(0, 2**64 - 1),
        repetition_penalty=optional(0.0, f32_in(0.0, MAX_REPETITION_PENALTY, 1.0),
                                    st.one_of(f32_out(0.0, MAX_REPETITION_PENALTY), st.just(-1.0))),
        presence_penalty=optional(0.0, f32_in(-MAX_PENALTY, MAX_PENALTY), f32_out(-MAX_PENALTY, MAX_PENALTY)),
        frequency_penalty=optional(0.0, f32_in(-MAX_PENALTY, MAX_PENALTY), f32_out(-MAX_PENALTY, MAX_PENALTY)),
        min_p=optional(0.0, f32_in(0.0, 1.0), f32_out(0.0, 1.0)),
        min_new_tokens=optional(0, st.integers(0, min(max_new, MAX_NEW)),
                                st.one_of(st.just(min(max_new + 1, 2**32 - 1)), u32)),
        logit_bias=logit_biases,
    )


stops = optional(
    [],
    st.one_of(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
              st.lists(st.text(min_size=1, max_size=2), min_size=MAX_STOPS, max_size=MAX_STOPS),
              st.just(["é" * (MAX_STOP_BYTES // 2)])),  # 256 bytes in 128 characters
    st.one_of(st.lists(st.text(max_size=3), min_size=MAX_STOPS + 1, max_size=MAX_STOPS + 3),
              st.builds(lambda good, at: [*good[:at], "", *good[at:]],
                        st.lists(st.text(min_size=1, max_size=3), max_size=3), st.integers(0, 3)),
              st.just(["é" * (MAX_STOP_BYTES // 2) + "a"])),  # 257 bytes in 129 characters
)
top_logprobs = optional(0, st.integers(1, MAX_TOP_LOGPROBS), st.one_of(st.just(MAX_TOP_LOGPROBS + 1), u32))


def _prefixes(*words: str) -> str:
    """A regex for the text a length or a stop string may cut these words to."""
    return "|".join(sorted({re.escape(w[:i]) for w in words for i in range(len(w) + 1)}))


def _json_padded(size: int, ch: str) -> str:
    """{"type":"boolean"} with a description making it exactly `size` bytes of UTF-8."""
    head, tail = '{"type":"boolean","description":"', '"}'
    room = size - len((head + tail).encode())
    k = room // len(ch.encode())
    return head + ch * k + "a" * (room - k * len(ch.encode())) + tail


# Formats whose fate is known (checked against llguidance): valid ones with the regex every text
# streamed under them must fullmatch (None: not checked; JSON is compact: no whitespace between
# tokens), and the ones the compiler refuses.
VALID_FORMATS: dict[tuple[str, str], str | None] = {
    ("regex", "[ab]{1,5}"): "[ab]{0,5}",
    ("regex", "yes|no"): _prefixes("yes", "no"),
    ("regex", "[0-9]{1,3}"): "[0-9]{0,3}",
    ("json_schema", '{"type":"boolean"}'): _prefixes("true", "false"),
    ("json_schema", '{"enum":["red","green"]}'): _prefixes('"red"', '"green"'),
    ("json_schema", '{"type":"integer"}'): None,
    ("json_schema", '{"type":"string","maxLength":4}'): None,
    ("json_schema", "{}"): None,
    ("json_schema", "true"): None,
    ("json_schema", _json_padded(MAX_FORMAT_BYTES, "a")): _prefixes("true", "false"),  # at the size bound
    ("json_schema", _json_padded(MAX_FORMAT_BYTES, "é")): _prefixes("true", "false"),  # in bytes, not characters
    ("lark_grammar", 'start: "yes" | "no"'): _prefixes("yes", "no"),
    ("lark_grammar", "start: /[ab]+/"): "[ab]*",
}
INVALID_FORMATS = {
    ("regex", "("), ("regex", "[a-"), ("regex", "a{5,2}"), ("regex", "*"),
    ("json_schema", "{"), ("json_schema", "not json"), ("json_schema", "[1,2]"), ("json_schema", '{"type":"nope"}'),
    ("json_schema", '"x"'),
    ("lark_grammar", "start: ("), ("lark_grammar", "start: undefined_rule"), ("lark_grammar", 'nostart: "a"'),
    ("lark_grammar", "%%%"),
}
FORMAT_KINDS = ("json_schema", "regex", "lark_grammar")
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["string", "integer", "a", ""]))
arbitrary_formats = st.one_of(  # the compiler decides; no counted repetition, so nothing blows up
    st.tuples(st.just("regex"), st.text(alphabet="ab()[]|*+?.^$\\-", min_size=1, max_size=10)),
    st.tuples(st.just("lark_grammar"), st.text(alphabet='ab"()|*+?/ :\n', max_size=12).map("start: ".__add__)),
    st.tuples(st.just("json_schema"), st.dictionaries(
        st.sampled_from(["type", "enum", "const", "minimum", "maxLength", "items", "required", "anyOf"]),
        st.one_of(json_scalars, st.lists(json_scalars, max_size=3)), max_size=3).map(json.dumps)),
)
response_formats = st.integers(0, 19).flatmap(lambda i: (
    st.none() if i < 12 else
    st.sampled_from(sorted(VALID_FORMATS)) if i < 16 else
    st.sampled_from(sorted(INVALID_FORMATS)) if i == 16 else
    arbitrary_formats if i == 17 else
    st.one_of(st.tuples(st.sampled_from(FORMAT_KINDS), st.just("")),  # empty
              st.just(("json_schema", _json_padded(MAX_FORMAT_BYTES + 1, "a"))),  # one byte past
              st.just(("json_schema", _json_padded(MAX_FORMAT_BYTES + 1, "é"))),
              st.just((None, "")))))  # response_format set, its oneof not


@st.composite
def requests(draw: st.DrawFn) -> pb.DecodeRequest:
    msg = pb.DecodeRequest(
        request_id=draw(mostly(st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)),
                               st.text(max_size=200))),
        max_new_tokens=draw(mostly(st.integers(1, MAX_NEW), st.one_of(st.just(0), u32))),
        stop_token_ids=draw(st.lists(token_ids, max_size=3)),
        ignore_eos=draw(st.booleans()),
    )
    kind, prompt = draw(prompts)
    if kind == "text":
        msg.prompt_text = prompt
    elif kind == "ids":
        msg.prompt_token_ids.ids.extend(prompt)
    elif kind == "chat":
        msg.chat.SetInParent()  # an empty message list is still a chat prompt
        msg.chat.messages.extend(prompt)
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling(msg.max_new_tokens)))
    msg.stop.extend(draw(stops))
    msg.top_logprobs = draw(top_logprobs)
    msg.echo_prompt_logprobs = draw(st.booleans())
    fmt = draw(response_formats)
    if fmt is not None:
        fmt_kind, source = fmt
        msg.response_format.SetInParent()
        if fmt_kind is not None:
            setattr(msg.response_format, fmt_kind, source)
    return msg


@st.composite
def tokenize_requests(draw: st.DrawFn) -> pb.TokenizeRequest:
    kind, prompt = draw(mostly(
        st.tuples(st.just("text"), st.text(min_size=1, max_size=200)),
        st.one_of(st.tuples(st.just("unset"), st.none()), st.tuples(st.just("text"), st.text(max_size=1)),
                  st.tuples(st.just("text"), huge_text), st.tuples(st.just("chat"), chat_messages))))
    msg = pb.TokenizeRequest()
    if kind == "text":
        msg.text = prompt
    elif kind == "chat":
        msg.chat.SetInParent()
        msg.chat.messages.extend(prompt)
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def unknown_fields(draw: st.DrawFn) -> bytes:
    """Tagged fields the schema does not know (or known numbers with another wire type)."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        number, wire = draw(st.integers(1, 2**29 - 1)), draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: _varint(draw(st.integers(0, 2**64 - 1))), 1: draw(st.binary(min_size=8, max_size=8)),
                   5: draw(st.binary(min_size=4, max_size=4))}.get(wire)
        if payload is None:
            blob = draw(st.binary(max_size=64))
            payload = _varint(len(blob)) + blob
        parts.append(_varint(number << 3 | wire) + payload)
    return b"".join(parts)


def _cases(serialized: st.SearchStrategy[bytes]) -> st.SearchStrategy[tuple[str, bytes]]:
    return st.one_of(st.tuples(st.just("message"), serialized),
                     st.tuples(st.just("unknown_fields"), st.builds(lambda m, extra: m + extra, serialized,
                                                                    unknown_fields())))


messages = requests().map(lambda m: m.SerializeToString())
cases = _cases(messages)
garbage = st.tuples(st.just("garbage"), st.binary(max_size=2048))
tokenize_cases = st.one_of(_cases(tokenize_requests().map(lambda m: m.SerializeToString())), garbage)


# Cases earlier runs found, sent first in every run (quick ones too). A subnormal temperature
# (5.7e-44) once overflowed the sampler to NaN and crashed the engine; so did a subnormal
# repetition_penalty (1.4e-45, valid: > 0) when sampling (positive logits divided by it are inf).
REGRESSIONS = [
    ("message", b"\x12\x02\xc3\xb7 \x05*\x10\r)\x00\x00\x00\x15)\x00\x00\x00\x18\xff\x01 \xceu"),
    ("message", pb.DecodeRequest(prompt_text="edge", max_new_tokens=4, sampling=pb.SamplingParams(
        temperature=0.365, repetition_penalty=2.0**-149)).SerializeToString()),
]


def _edge(**fields: object) -> pb.DecodeRequest:
    """A valid request but for the fields given (`sampling`: a dict of SamplingParams fields)."""
    sampling_fields = fields.pop("sampling", {})
    fmt = fields.pop("response_format", None)
    if not {"prompt_text", "prompt_token_ids", "chat"} & fields.keys():
        fields["prompt_text"] = "edge"
    msg = pb.DecodeRequest(**{"max_new_tokens": 4, **fields})  # type: ignore[arg-type]
    if sampling_fields:
        msg.sampling.CopyFrom(pb.SamplingParams(**sampling_fields))  # type: ignore[arg-type]
    if fmt is not None:
        msg.response_format.SetInParent()
        if fmt[0] is not None:
            setattr(msg.response_format, fmt[0], fmt[1])
    return msg


def _decode_edges() -> list[pb.DecodeRequest]:
    """Each newer field at its bounds and just past them, alone in a valid request: whatever
    hypothesis draws, every run (quick ones too) sends these first."""
    up, down = (lambda x: _f32_step(x, True)), (lambda x: _f32_step(x, False))
    floats = {
        "repetition_penalty": [0.0, 2.0**-149, 1.0, 10.0, up(10.0), down(0.0), -1.0],
        "presence_penalty": [-2.0, 2.0, down(-2.0), up(2.0)],
        "frequency_penalty": [-2.0, 2.0, down(-2.0), up(2.0)],
        "min_p": [0.0, 2.0**-149, 1.0, down(0.0), up(1.0)],
    }
    edges = [_edge(sampling={name: v}) for name, values in floats.items()
             for v in (*values, math.nan, math.inf, -math.inf)]
    edges += [_edge(sampling={"min_new_tokens": n}) for n in (4, 5)]
    edges += [_edge(sampling={"min_new_tokens": 4}, stop_token_ids=[EOS, ord("a")])]
    edges += [_edge(sampling={"logit_bias": bias}) for bias in (
        {0: MAX_BIAS}, {VOCAB - 1: -MAX_BIAS}, dict.fromkeys(range(VOCAB), -MAX_BIAS), {ord("x"): MAX_BIAS},
        {VOCAB: 0.0}, {2**32 - 1: 0.0}, {0: up(MAX_BIAS)}, {0: down(-MAX_BIAS)}, {0: math.nan}, {0: math.inf},
        dict.fromkeys(range(MAX_BIAS_ENTRIES + 1), 0.0))]
    edges += [_edge(stop=stop) for stop in (
        ["a"] * MAX_STOPS, ["a"] * (MAX_STOPS + 1),
        ["é" * (MAX_STOP_BYTES // 2)], ["é" * (MAX_STOP_BYTES // 2) + "a"],
        ["a" * MAX_STOP_BYTES], ["a" * (MAX_STOP_BYTES + 1)], [""], ["a", ""], ["\ufffd"], ["\x00"])]
    edges += [_edge(top_logprobs=k) for k in (1, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1, 2**32 - 1)]
    edges += [_edge(echo_prompt_logprobs=True, top_logprobs=k) for k in (0, MAX_TOP_LOGPROBS)]
    edges += [_edge(echo_prompt_logprobs=True, prompt_token_ids=pb.TokenIds(ids=[BOS]))]
    edges += [_edge(response_format=fmt) for fmt in (
        *sorted(VALID_FORMATS), *sorted(INVALID_FORMATS), *((kind, "") for kind in FORMAT_KINDS),
        ("json_schema", _json_padded(MAX_FORMAT_BYTES + 1, "a")),
        ("json_schema", _json_padded(MAX_FORMAT_BYTES + 1, "é")),
        (None, ""))]
    edges += [_edge(response_format=("regex", "[ab]{1,5}"), sampling={"min_new_tokens": 4}),
              _edge(response_format=("json_schema", "true"), sampling={"min_new_tokens": 4}, ignore_eos=True),
              _edge(response_format=("regex", "yes|no"), stop=["e"], top_logprobs=3)]
    edges += [_edge(chat=pb.ChatPrompt(messages=m)) for m in (
        [pb.ChatMessage(role="user", content="hi")], [],
        [pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="", content="x")])]
    edges += [_edge(prompt_text="a" * n) for n in (MAX_TEXT_CHARS, MAX_TEXT_CHARS + 1)]
    return edges


def _tokenize_edges() -> list[pb.TokenizeRequest]:
    return [pb.TokenizeRequest(text="a"), pb.TokenizeRequest(text="é\x00\U0001f600"), pb.TokenizeRequest(text=""),
            pb.TokenizeRequest(), pb.TokenizeRequest(text="a" * MAX_TEXT_CHARS),
            pb.TokenizeRequest(text="a" * (MAX_TEXT_CHARS + 1)),
            pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")])),
            pb.TokenizeRequest(chat=pb.ChatPrompt())]


DECODE_EDGES = [("edge", m.SerializeToString()) for m in _decode_edges()]
TOKENIZE_EDGES = [("edge", m.SerializeToString()) for m in _tokenize_edges()]


def acceptable(answer: CallResult) -> bool:
    """The contract for bad input: OK, or INVALID_ARGUMENT with a field violation or a context limit."""
    if answer.ok:
        return all(t < VOCAB for t in answer.tokens)
    if answer.is_("INVALID_ARGUMENT", "INVALID_FIELD"):
        return bool(answer.field)
    return answer.is_("INVALID_ARGUMENT", "CONTEXT_LENGTH_EXCEEDED")


# -- the oracle: what the contract says the engine answers to these bytes -------------------------

@dataclass(frozen=True)
class Outcome:
    code: str  # "OK" or a status name
    reason: str = ""
    field: str | None = None  # INVALID_FIELD's BadRequest field
    prompt_tokens: int | None = None  # CONTEXT_LENGTH_EXCEEDED's promptTokens

    def matches(self, answer: CallResult) -> bool:
        if answer.code != self.code or answer.reason != self.reason:
            return False
        if self.field is not None and answer.field != self.field:
            return False
        return self.prompt_tokens is None or answer.metadata.get("promptTokens") == str(self.prompt_tokens)

    def __str__(self) -> str:
        return "/".join(str(p) for p in (self.code, self.reason, self.field, self.prompt_tokens) if p)


OK = (Outcome("OK"),)


def invalid(field: str) -> tuple[Outcome, ...]:
    return (Outcome("INVALID_ARGUMENT", "INVALID_FIELD", field),)


def too_long(prompt_tokens: int) -> tuple[Outcome, ...]:
    return (Outcome("INVALID_ARGUMENT", "CONTEXT_LENGTH_EXCEEDED", prompt_tokens=prompt_tokens),)


def _within(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def sampling_violation(s: pb.SamplingParams, max_new: int) -> str | None:
    """The first sampling field refused, in the order the boundary checks them."""
    top_p = s.top_p if s.top_p != 0.0 else 1.0
    repetition = s.repetition_penalty if s.repetition_penalty != 0.0 else 1.0
    checks = (
        ("temperature", _within(s.temperature, 0.0, MAX_TEMPERATURE)),
        ("top_p", _within(top_p, 0.0, 1.0) and top_p > 0.0),
        ("top_k", s.top_k >= 0),
        ("repetition_penalty", _within(repetition, 0.0, MAX_REPETITION_PENALTY) and repetition > 0.0),
        ("presence_penalty", _within(s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)),
        ("frequency_penalty", _within(s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)),
        ("min_p", _within(s.min_p, 0.0, 1.0)),
        ("min_new_tokens", s.min_new_tokens <= max_new),
        ("logit_bias", len(s.logit_bias) <= MAX_BIAS_ENTRIES and all(
            token < VOCAB and _within(value, -MAX_BIAS, MAX_BIAS) for token, value in s.logit_bias.items())),
    )
    return next((f"sampling.{name}" for name, ok in checks if not ok), None)


def _text_ids(text: str) -> tuple[int, ...]:
    return (BOS, *text.encode("utf-8"))


def expect_decode(msg: pb.DecodeRequest) -> tuple[tuple[Outcome, ...], tuple[int, ...]]:
    """The answers the contract allows (almost always one) and, for OK, the prompt's token ids."""
    if msg.request_id and not REQUEST_ID.fullmatch(msg.request_id):
        return invalid("request_id"), ()
    max_new = msg.max_new_tokens
    if not 1 <= max_new <= MAX_NEW:
        return invalid("max_new_tokens"), ()
    if (field := sampling_violation(msg.sampling, max_new)) is not None:
        return invalid(field), ()
    if any(t >= VOCAB for t in msg.stop_token_ids):
        return invalid("stop_token_ids"), ()
    if len(msg.stop) > MAX_STOPS:
        return invalid("stop"), ()
    for index, text in enumerate(msg.stop):
        if not 1 <= len(text.encode("utf-8")) <= MAX_STOP_BYTES:
            return invalid(f"stop[{index}]"), ()
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        return invalid("top_logprobs"), ()
    fmt = None
    if msg.HasField("response_format"):
        kind = msg.response_format.WhichOneof("format")
        if kind is None:
            return invalid("response_format"), ()
        fmt = kind, getattr(msg.response_format, kind)
        if not 1 <= len(fmt[1].encode("utf-8")) <= MAX_FORMAT_BYTES:
            return invalid(f"response_format.{kind}"), ()
    which = msg.WhichOneof("prompt")
    if which is None:
        return invalid("prompt"), ()
    if which == "chat":  # the tiny preset has no chat template: refused whatever the messages
        return invalid("chat"), ()
    if which == "prompt_text":
        if not msg.prompt_text:
            return invalid("prompt_text"), ()
        if len(msg.prompt_text) > MAX_TEXT_CHARS:
            return too_long(len(msg.prompt_text) // CHARS_PER_TOKEN), ()
        prompt = _text_ids(msg.prompt_text)
    else:
        prompt = tuple(msg.prompt_token_ids.ids)
        if not prompt:
            return invalid("prompt_token_ids.ids"), ()
        if len(prompt) > MAX_CONTEXT:
            return too_long(len(prompt)), ()
        if max(prompt) >= VOCAB:
            return invalid("prompt_token_ids.ids"), ()
    if len(prompt) + max_new > MAX_CONTEXT:
        return too_long(len(prompt)), ()
    if fmt is None or fmt in VALID_FORMATS:
        return OK, prompt
    refused = invalid(f"response_format.{fmt[0]}")
    return (refused if fmt in INVALID_FORMATS else OK + refused), prompt  # unknown: the compiler decides


def expect_tokenize(msg: pb.TokenizeRequest) -> tuple[tuple[Outcome, ...], tuple[int, ...]]:
    which = msg.WhichOneof("prompt")
    if which is None:
        return invalid("prompt"), ()
    if which == "chat":
        return invalid("chat"), ()
    if not msg.text:
        return invalid("text"), ()
    if len(msg.text) > MAX_TEXT_CHARS:
        return too_long(len(msg.text) // CHARS_PER_TOKEN), ()
    return OK, _text_ids(msg.text)


def parsed(cls: type, raw: bytes):  # type: ignore[no-untyped-def]
    """The message the engine reads from these bytes (same protobuf runtime), None if it cannot."""
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


def stream_violations(msg: pb.DecodeRequest, prompt: tuple[int, ...], responses: list[pb.DecodeResponse]) -> list[str]:
    """What an OK Decode stream breaks of the contract, given its request."""
    wrong: list[str] = []
    tokens = [t for r in responses for t in r.token_ids]
    text = "".join(r.text for r in responses)
    if not responses or not responses[-1].finish_reason:
        wrong.append("no finish_reason on the last message")
    if len(tokens) > msg.max_new_tokens:
        wrong.append(f"{len(tokens)} tokens > max_new_tokens {msg.max_new_tokens}")
    k = msg.top_logprobs
    if k:
        for r in responses:
            if [lp.token_id for lp in r.logprobs] != list(r.token_ids):
                wrong.append(f"logprobs for {[lp.token_id for lp in r.logprobs]}, tokens {list(r.token_ids)}")
            elif any(len(lp.top) != k for lp in r.logprobs):
                wrong.append(f"top_logprobs {k}: tops of {[len(lp.top) for lp in r.logprobs]}")
    if msg.echo_prompt_logprobs and responses:
        echoed = [lp.token_id for lp in responses[0].prompt_logprobs]
        if echoed != list(prompt[1:]) or any(r.prompt_logprobs for r in responses[1:]):
            wrong.append(f"prompt_logprobs for {echoed[:8]}... ({sum(len(r.prompt_logprobs) for r in responses)} "
                         f"in all), prompt {list(prompt[1:9])}... ({len(prompt) - 1} after the first)")
        elif any(len(lp.top) != k for lp in responses[0].prompt_logprobs):
            wrong.append(f"prompt_logprobs with top_logprobs {k}: tops of other sizes")
    for stop in msg.stop:
        if stop in text:
            wrong.append(f"text {text[:60]!r} streamed stop string {stop!r}")
    stop_string = responses[-1].stop_string if responses else ""
    if stop_string and stop_string not in msg.stop:
        wrong.append(f"stop_string {stop_string!r} is none of {list(msg.stop)}")
    fmt = msg.response_format.WhichOneof("format") if msg.HasField("response_format") else None
    if fmt is None:
        masked = {EOS, *msg.stop_token_ids}
        if masked & set(tokens[:msg.sampling.min_new_tokens]):
            wrong.append(f"min_new_tokens {msg.sampling.min_new_tokens}: {tokens} has EOS or a stop token early")
    elif (pattern := VALID_FORMATS.get((fmt, getattr(msg.response_format, fmt)))) and not re.fullmatch(pattern, text):
        wrong.append(f"text {text!r} cannot be the start of a match of {fmt} {getattr(msg.response_format, fmt)!r}")
    return wrong


def collect_all(call: Iterable[pb.DecodeResponse]) -> tuple[CallResult, list[pb.DecodeResponse]]:
    """drills.common.collect, keeping the messages."""
    responses: list[pb.DecodeResponse] = []
    try:
        for msg in call:
            responses.append(msg)
    except grpc.RpcError as err:
        return answer_of(err, [t for r in responses for t in r.token_ids]), responses
    return CallResult("OK", tokens=tuple(t for r in responses for t in r.token_ids)), responses


class GoodTraffic(threading.Thread):
    """Well-formed greedy requests on their own connection, compared with a baseline."""

    def __init__(self, address: str, baseline: dict[str, tuple[int, ...]]) -> None:
        super().__init__(daemon=True)
        self.address, self.baseline = address, baseline
        self.stop = threading.Event()
        self.sent = 0
        self.wrong: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            decode = ch.unary_stream(DECODE_METHOD, request_serializer=pb.DecodeRequest.SerializeToString,
                                     response_deserializer=pb.DecodeResponse.FromString)
            while not self.stop.is_set():
                prompt = GOOD_PROMPTS[self.sent % len(GOOD_PROMPTS)]
                got = collect(decode(good_request(prompt), timeout=30))
                self.sent += 1
                if not got.ok or got.tokens != self.baseline[prompt]:
                    self.wrong.append(f"{prompt!r}: {got.short()}")


def good_request(prompt: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(prompt_text=prompt, max_new_tokens=MAX_NEW, ignore_eos=True)


def run(quick: bool) -> DrillRow:
    n_cases = 300 if quick else 2000
    checks = Checks()
    kinds: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    bad: list[str] = []  # outside the contract for any input
    mispredicted: list[str] = []  # not the answer the contract gives these bytes
    # float32: greedy tokens compared with the same prompt's alone must not depend on the batch
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--max-batch", "8", "--max-context", str(MAX_CONTEXT),
                       "--max-new-tokens", str(MAX_NEW)) as engine, engine.channel() as channel:
        decode_raw = channel.unary_stream(DECODE_METHOD, request_serializer=None,
                                          response_deserializer=pb.DecodeResponse.FromString)
        tokenize_raw = channel.unary_unary(TOKENIZE_METHOD, request_serializer=None,
                                           response_deserializer=pb.TokenizeResponse.FromString)
        baseline = {p: collect(decode_raw(good_request(p).SerializeToString(), timeout=30)).tokens
                    for p in GOOD_PROMPTS}
        steady = GoodTraffic(engine.address, baseline)
        steady.start()
        started = time.monotonic()

        def judge(kind: str, raw: bytes, got: CallResult, allowed: tuple[Outcome, ...], wrong: list[str]) -> None:
            kinds[kind] += 1
            answers[(f"{got.code}/{got.reason}" if got.reason else got.code)] += 1
            failures = bad if not acceptable(got) else mispredicted
            if not acceptable(got):
                bad.append(f"{kind} {raw[:60]!r}: {got.short()}")
            elif not any(o.matches(got) for o in allowed):
                mispredicted.append(f"{kind} {raw[:60]!r}: {got.short()} field {got.field} "
                                    f"{dict(got.metadata)}, expected {' or '.join(map(str, allowed))}")
            elif got.ok and wrong:
                mispredicted.append(f"{kind} {raw[:60]!r}: OK but {'; '.join(wrong[:2])}")
            else:
                return
            if len(failures) == 1:  # the whole case, to replay it (the row shows 60 bytes)
                note(NAME, f"first {'answer outside the contract' if failures is bad else 'misprediction'}: "
                           f"{failures[0]}; the whole case: {raw[:4000]!r}")

        def send(case: tuple[str, bytes]) -> None:
            kind, raw = case
            got, responses = collect_all(decode_raw(raw, timeout=30))
            msg = parsed(pb.DecodeRequest, raw)
            allowed, prompt = expect_decode(msg) if msg is not None else (invalid("request"), ())
            judge(kind, raw, got, allowed, stream_violations(msg, prompt, responses) if got.ok and msg else [])

        def send_tokenize(case: tuple[str, bytes]) -> None:
            kind, raw = case
            try:
                response, got = tokenize_raw(raw, timeout=30), CallResult("OK")
            except grpc.RpcError as err:
                response, got = None, answer_of(err)
            msg = parsed(pb.TokenizeRequest, raw)
            allowed, ids = expect_tokenize(msg) if msg is not None else (invalid("request"), ())
            wrong = []
            if response is not None and (list(response.token_ids) != list(ids)
                                         or len(response.pieces) != len(response.token_ids)):
                wrong.append(f"{len(response.token_ids)} ids {list(response.token_ids)[:8]}... and "
                             f"{len(response.pieces)} pieces, expected the ids {list(ids)[:8]}...")
            judge(f"tokenize {kind}", raw, got, allowed, wrong)

        def fuzz(strategy: st.SearchStrategy, target, examples: int) -> None:  # type: ignore[no-untyped-def]
            settings(max_examples=examples, database=None, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))(given(strategy)(target))()

        note(NAME, f"{n_cases} cases with well-formed requests alongside")
        for case in REGRESSIONS + DECODE_EDGES:
            send(case)
        for case in TOKENIZE_EDGES:
            send_tokenize(case)
        fuzz(cases, send, n_cases - n_cases // 5 - n_cases // 10)
        fuzz(garbage, send, n_cases // 5)
        fuzz(tokenize_cases, send_tokenize, n_cases // 10)
        # Past the receive limit (4 MiB by default) gRPC itself answers RESOURCE_EXHAUSTED: the contract says so.
        oversize = collect(decode_raw(b"\x12" + b"\xff\xff\xff\x02" + b"x" * (5 << 20), timeout=30))
        elapsed = time.monotonic() - started
        steady.stop.set()
        steady.join(60)
        alive = engine.proc is not None and engine.proc.poll() is None
        checks.expect(alive, f"engine exited with {engine.proc.returncode if engine.proc else '?'}")
        if alive:
            checks.expect(engine.health() == 1, "health not SERVING after the fuzz")
            load = engine.wait_load(lambda x: x.running_sequences == 0 and x.kv_cache_used_tokens == 0)
            checks.expect(load.running_sequences == 0 and load.kv_cache_used_tokens == 0,
                          f"load not back to zero: {load}")
        internal = sum(len(engine.events_named(e)) for e in ("request_internal_error", "tokenize_internal_error"))
    cases_run = sum(kinds.values())
    checks.expect(cases_run >= n_cases, f"only {cases_run} of {n_cases} cases ran")
    checks.expect(not bad, f"{len(bad)} answers outside the contract, e.g. {bad[:3]}")
    checks.expect(not mispredicted, f"{len(mispredicted)} answers not the contract's for the request, "
                                    f"e.g. {mispredicted[:3]}")
    checks.expect(oversize.code == "RESOURCE_EXHAUSTED", f"5 MiB request answered {oversize.short()}")
    checks.expect(internal == 0, f"{internal} request_internal_error or tokenize_internal_error events in the log")
    checks.expect(steady.sent > 0, "no well-formed request ran during the fuzz")
    checks.expect(not steady.wrong, f"well-formed requests disturbed: {steady.wrong[:3]}")
    return checks.row(
        NAME,
        done=f"{cases_run} hypothesis cases ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) as raw bytes "
             f"on Decode and Tokenize, plus one 5 MiB message; {steady.sent} well-formed greedy requests alongside",
        expected="each answer OK, or INVALID_ARGUMENT with INVALID_FIELD + BadRequest or CONTEXT_LENGTH_EXCEEDED, "
                 "the one the contract gives those bytes (status, field, promptTokens); OK streams true to the "
                 "request, OK Tokenize the byte ids; never UNKNOWN or a crash; 5 MiB: RESOURCE_EXHAUSTED; "
                 "well-formed tokens unchanged",
        lost=len(steady.wrong),
        figures={"cases fuzzed": cases_run, "answers": dict(sorted(answers.items())),
                 "well-formed requests": steady.sent, "seconds": round(elapsed, 1)},
    )
