"""Request.parse in-process: every bound exactly at its edge, each refusal's field, message and
metadata, and what a valid request becomes (the boundary that tests/test_engine_contract.py drives
over gRPC, here in milliseconds; kept honest by `make mutate`, docs/mutation-testing.md). Also the
order of the checks (the cheap ones before anything is tokenized or rendered), parse_tokenize
(Tokenize's prompt) and loggable_request_id (a raw id fit for logs)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from engine.v1 import engine_pb2 as pb
from engine_service.model.chat_template import ChatMessage, ChatTemplate
from engine_service.requests import (
    Limits,
    Request,
    ResponseFormat,
    SamplingParams,
    loggable_request_id,
    parse_tokenize,
)
from shared.errors import ContextLengthExceeded, EngineError, InvalidField

LIMITS = Limits(vocab_size=300, max_context_tokens=16, max_new_tokens_limit=8)
TEMPLATE = ChatTemplate(
    "{% for m in messages %}{% if m.role == 'forbidden' %}{{ raise_exception('role forbidden is not allowed') }}"
    "{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}")
SILENT = ChatTemplate("{% for m in messages %}{% endfor %}")  # renders every conversation to ""


class Bytes:
    """A byte tokenizer with BOS 256 (as the engine's tiny model has), recording each call."""

    vocab_size = 300

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return ([256] if add_special_tokens else []) + list(text.encode())


class Normalizing:
    """A tokenizer that normalizes whitespace away and adds no BOS: some text is no tokens at all."""

    vocab_size = 300

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [b for b in text.encode() if not chr(b).isspace()]


class NeverRendered:
    """A chat template whose rendering fails the test (and is no ChatTemplateError to be caught)."""

    def render(self, messages: list[ChatMessage]) -> str:
        raise AssertionError(f"rendered {messages}")


def parse(limits: Limits = LIMITS, deadline: float | None = None, template: ChatTemplate | None = None,
          tokenizer: Bytes | Normalizing | None = None, **fields) -> Request:  # type: ignore[no-untyped-def]
    msg = pb.DecodeRequest(**fields)
    return Request.parse(msg, limits, tokenizer or Bytes(), deadline, template)


def refused(**fields) -> EngineError:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineError) as caught:
        parse(**fields)
    return caught.value


def chat(*messages: tuple[str, str]) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


def test_a_valid_request_becomes_a_frozen_domain_object() -> None:
    request = parse(deadline=12.5, request_id="r-1.a:b_C", prompt_text="hi", max_new_tokens=8,
                    stop_token_ids=[299, 10, 10], ignore_eos=True,
                    sampling=pb.SamplingParams(temperature=0.5, top_p=0.25, top_k=3, seed=7))
    assert request == Request(request_id="r-1.a:b_C", prompt_ids=(256, 104, 105), max_new_tokens=8,
                              sampling=SamplingParams(temperature=0.5, top_p=0.25, top_k=3, seed=7),
                              stop_token_ids=frozenset({10, 299}), ignore_eos=True, deadline=12.5)
    defaults = parse(prompt_token_ids=pb.TokenIds(ids=[5, 299]), max_new_tokens=1)
    assert (defaults.prompt_ids, defaults.sampling, defaults.stop_token_ids, defaults.ignore_eos, defaults.deadline) \
        == ((5, 299), SamplingParams(), frozenset(), False, None)
    assert defaults.sampling.greedy and not request.sampling.greedy
    assert re.fullmatch(r"req-[0-9a-f]{16}", defaults.request_id)
    assert parse(prompt_text="x", max_new_tokens=1).request_id != defaults.request_id


@pytest.mark.parametrize("request_id", ["x" * 128, "a", "A.Z-0_9:z"])
def test_request_id_accepted(request_id: str) -> None:
    assert parse(request_id=request_id, prompt_text="x", max_new_tokens=1).request_id == request_id


@pytest.mark.parametrize("request_id", ["x" * 129, "has space", "é", "a/b"])
def test_request_id_refused(request_id: str) -> None:
    err = refused(request_id=request_id, prompt_text="x", max_new_tokens=1)
    assert type(err) is InvalidField and err.field == "request_id"
    assert err.message == f"request_id must be 1..128 characters of [A-Za-z0-9._:-], got {request_id!r}"
    assert err.metadata == {"field": "request_id", "value": request_id if len(request_id) <= 64
                            else request_id[:61] + "..."}


def test_a_long_request_id_is_clipped_in_the_message() -> None:
    err = refused(request_id="y" * 200, prompt_text="x", max_new_tokens=1)
    assert err.message.endswith(f"got {'y' * 140!r}")


@pytest.mark.parametrize("max_new", [1, 8])
def test_max_new_tokens_edges_accepted(max_new: int) -> None:
    assert parse(prompt_text="x", max_new_tokens=max_new).max_new_tokens == max_new


@pytest.mark.parametrize("max_new", [0, 9])
def test_max_new_tokens_edges_refused(max_new: int) -> None:
    err = refused(prompt_text="x", max_new_tokens=max_new)
    assert type(err) is InvalidField and err.field == "max_new_tokens"
    assert err.message == f"max_new_tokens must be 1..8, got {max_new}"
    assert err.metadata == {"field": "max_new_tokens", "value": str(max_new)}


def test_context_exactly_full_is_accepted_and_one_more_is_refused() -> None:
    assert len(parse(prompt_token_ids=pb.TokenIds(ids=[1] * 8), max_new_tokens=8).prompt_ids) == 8
    err = refused(prompt_token_ids=pb.TokenIds(ids=[1] * 9), max_new_tokens=8)
    assert type(err) is ContextLengthExceeded
    assert err.metadata == {"promptTokens": "9", "maxNewTokens": "8", "maxContextTokens": "16"}
    # a prompt longer than the whole context is refused before its ids are checked
    err = refused(prompt_token_ids=pb.TokenIds(ids=[1] * 16 + [999]), max_new_tokens=1)
    assert type(err) is ContextLengthExceeded
    assert err.metadata == {"promptTokens": "17", "maxNewTokens": "1", "maxContextTokens": "16"}
    # one that only fills it has its ids checked first
    err = refused(prompt_token_ids=pb.TokenIds(ids=[1] * 15 + [999]), max_new_tokens=1)
    assert type(err) is InvalidField and err.message == "prompt_token_ids.ids[15] must be < vocab_size 300, got 999"
    assert type(refused(prompt_token_ids=pb.TokenIds(ids=[1] * 16), max_new_tokens=1)) is ContextLengthExceeded
    assert len(parse(prompt_token_ids=pb.TokenIds(ids=[1] * 15), max_new_tokens=1).prompt_ids) == 15


def test_stop_token_ids_must_be_in_the_vocabulary() -> None:
    assert parse(prompt_text="x", max_new_tokens=1, stop_token_ids=[0, 299]).stop_token_ids == {0, 299}
    err = refused(prompt_text="x", max_new_tokens=1, stop_token_ids=[3, 300, 301])
    assert type(err) is InvalidField and err.field == "stop_token_ids"
    assert err.message == "stop_token_ids must be < vocab_size 300, got 300"
    assert err.metadata == {"field": "stop_token_ids", "value": "300"}


@pytest.mark.parametrize(("fields", "field", "message", "value"), [
    ({"max_new_tokens": 1}, "prompt", "prompt must be set: give prompt_text, prompt_token_ids or chat", "None"),
    ({"prompt_text": "", "max_new_tokens": 1}, "prompt_text", "prompt_text must not be empty, got ''", ""),
    ({"prompt_token_ids": pb.TokenIds(ids=[]), "max_new_tokens": 1}, "prompt_token_ids.ids",
     "prompt_token_ids.ids must not be empty, got []", "[]"),
    ({"prompt_token_ids": pb.TokenIds(ids=[1, 400, 2, 400]), "max_new_tokens": 1}, "prompt_token_ids.ids",
     "prompt_token_ids.ids[1] must be < vocab_size 300, got 400", "400"),
    ({"prompt_token_ids": pb.TokenIds(ids=[300]), "max_new_tokens": 1}, "prompt_token_ids.ids",
     "prompt_token_ids.ids[0] must be < vocab_size 300, got 300", "300"),
])
def test_prompt_refusals(fields, field: str, message: str, value: str) -> None:  # type: ignore[no-untyped-def]
    err = refused(**fields)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


def test_the_largest_bad_id_is_named_even_after_a_smaller_bad_one() -> None:
    err = refused(prompt_token_ids=pb.TokenIds(ids=[301, 1, 350]), max_new_tokens=1)
    assert err.message == "prompt_token_ids.ids[2] must be < vocab_size 300, got 350"


def test_prompt_text_length_bound_before_tokenizing() -> None:
    tokenizer = Bytes()
    limits = Limits(vocab_size=300, max_context_tokens=2, max_new_tokens_limit=8)
    with pytest.raises(ContextLengthExceeded) as caught:  # 64 * 2 characters pass the bound, then are too many
        parse(limits, tokenizer=tokenizer, prompt_text="x" * 128, max_new_tokens=1)
    assert caught.value.metadata["promptTokens"] == "129" and len(tokenizer.calls) == 1
    with pytest.raises(ContextLengthExceeded) as caught:
        parse(limits, tokenizer=tokenizer, prompt_text="x" * 129, max_new_tokens=3)
    assert len(tokenizer.calls) == 1, "refused before tokenizing"
    err = caught.value
    assert err.message == "prompt_text of 129 characters is at least 2 tokens, more than max_context_tokens 2"
    assert err.metadata == {"promptTokens": "2", "maxNewTokens": "3", "maxContextTokens": "2"}
    assert err.reason == "CONTEXT_LENGTH_EXCEEDED" and err.field is None


def test_chat_is_rendered_with_the_template_and_tokenized_without_special_tokens() -> None:
    tokenizer = Bytes()
    request = parse(template=TEMPLATE, tokenizer=tokenizer, chat=chat(("user", "hi")), max_new_tokens=1)
    assert tokenizer.calls == [("<user>hi>", False)]
    assert request.prompt_ids == tuple(b"<user>hi>")


@pytest.mark.parametrize(("prompt", "template", "field", "message", "value"), [
    (chat(("user", "hi")), None, "chat",
     "chat needs a model with a chat template, and the engine's model has none "
     "(ServerInfo.has_chat_template is false); send prompt_text or prompt_token_ids", "1 messages"),
    (chat(), TEMPLATE, "chat.messages", "chat.messages must hold at least one message, got []", "[]"),
    (chat(*[("u", "")] * 17), TEMPLATE, "chat.messages",
     "chat.messages must hold at most max_context_tokens 16 messages, got 17", "17 messages"),
    (chat(("user", "a"), ("", "b")), TEMPLATE, "chat.messages[1].role",
     "chat.messages[1].role must not be empty, got ''", ""),
    (chat(("user", "a"), ("forbidden", "b")), TEMPLATE, "chat.messages",
     "chat.messages (roles user, forbidden) were refused by the model's chat template: role forbidden is not allowed",
     "user, forbidden"),
    (chat(("user", "a")), SILENT, "chat.messages", "chat.messages (roles user) rendered to '', which is no tokens",
     "user"),
])
def test_chat_refusals(prompt, template, field: str, message: str, value: str) -> None:  # type: ignore[no-untyped-def]
    err = refused(template=template, chat=prompt, max_new_tokens=1)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


def test_chat_with_as_many_messages_as_the_context_is_rendered() -> None:
    tokenizer = Bytes()
    limits = Limits(vocab_size=300, max_context_tokens=4, max_new_tokens_limit=8)
    with pytest.raises(ContextLengthExceeded):  # 4 messages pass the count bound; their tokens do not fit
        parse(limits, template=TEMPLATE, tokenizer=tokenizer, chat=chat(*[("u", "")] * 4), max_new_tokens=1)
    assert len(tokenizer.calls) == 1


def test_long_role_lists_are_clipped_in_messages() -> None:
    err = refused(template=SILENT, chat=chat(*[("role", "")] * 16), max_new_tokens=1)
    roles = ", ".join(["role"] * 16)  # 94 characters: not clipped
    assert err.message == f"chat.messages (roles {roles}) rendered to '', which is no tokens"
    long_roles = chat(*[("r" * 15, "")] * 16)  # 16 * 15 + 15 * 2 = 270 characters
    err = refused(template=SILENT, chat=long_roles, max_new_tokens=1)
    clipped = ", ".join(["r" * 15] * 16)[:197] + "..."
    assert err.message == f"chat.messages (roles {clipped}) rendered to '', which is no tokens"
    err = refused(template=SILENT, chat=chat(("s" * 99, ""), ("t" * 99, "")), max_new_tokens=1)
    assert err.message == f"chat.messages (roles {'s' * 99}, {'t' * 99}) rendered to '', which is no tokens"  # 200


def test_chat_text_length_bounds() -> None:
    limits = Limits(vocab_size=300, max_context_tokens=2, max_new_tokens_limit=8)
    tokenizer = Bytes()
    with pytest.raises(ContextLengthExceeded) as caught:
        parse(limits, template=TEMPLATE, tokenizer=tokenizer, chat=chat(("u", "x" * 100), ("v", "y" * 29)),
              max_new_tokens=2)
    assert caught.value.message == ("chat.messages with 129 characters of content is at least 2 tokens, "
                                    "more than max_context_tokens 2")
    assert caught.value.metadata == {"promptTokens": "2", "maxNewTokens": "2", "maxContextTokens": "2"}
    # 128 characters of content pass; rendered with the roles' markup they are 132, over the bound
    with pytest.raises(ContextLengthExceeded) as caught:
        parse(limits, template=TEMPLATE, tokenizer=tokenizer, chat=chat(("u", "x" * 128)), max_new_tokens=2)
    assert caught.value.message == ("chat.messages rendered to 132 characters is at least 2 tokens, "
                                    "more than max_context_tokens 2")
    assert caught.value.metadata == {"promptTokens": "2", "maxNewTokens": "2", "maxContextTokens": "2"}
    assert tokenizer.calls == [], "refused before tokenizing"


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.0, 0.0, 0), (100.0, 1.0, 0), (1e-30, 1e-6, 300)])
def test_sampling_edges_accepted(temperature: float, top_p: float, top_k: int) -> None:
    sampling = parse(prompt_text="x", max_new_tokens=1, sampling=pb.SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=2**64 - 1)).sampling
    assert sampling.temperature == pytest.approx(temperature) and sampling.top_k == top_k
    assert sampling.top_p == (1.0 if top_p == 0.0 else pytest.approx(top_p))  # 0 (unset) means no nucleus
    assert sampling.seed == 2**64 - 1


@pytest.mark.parametrize(("sampling", "field", "message"), [
    (pb.SamplingParams(temperature=-0.5), "sampling.temperature",
     "sampling.temperature must be finite and in [0, 100], got -0.5"),
    (pb.SamplingParams(temperature=100.5), "sampling.temperature",
     "sampling.temperature must be finite and in [0, 100], got 100.5"),
    (pb.SamplingParams(temperature=math.nan), "sampling.temperature",
     "sampling.temperature must be finite and in [0, 100], got nan"),
    (pb.SamplingParams(temperature=math.inf), "sampling.temperature",
     "sampling.temperature must be finite and in [0, 100], got inf"),
    (pb.SamplingParams(top_p=1.5), "sampling.top_p", "sampling.top_p must be in (0, 1], got 1.5"),
    (pb.SamplingParams(top_p=-0.5), "sampling.top_p", "sampling.top_p must be in (0, 1], got -0.5"),
    (pb.SamplingParams(top_p=math.nan), "sampling.top_p", "sampling.top_p must be in (0, 1], got nan"),
    (pb.SamplingParams(top_p=math.inf), "sampling.top_p", "sampling.top_p must be in (0, 1], got inf"),
    (pb.SamplingParams(top_k=-1), "sampling.top_k", "sampling.top_k must be >= 0, got -1"),
])
def test_sampling_refusals(sampling: pb.SamplingParams, field: str, message: str) -> None:
    err = refused(prompt_text="x", max_new_tokens=1, sampling=sampling)
    assert type(err) is InvalidField and (err.field, err.message) == (field, message)
    assert err.metadata["field"] == field and err.metadata["value"] == message.rpartition("got ")[2]


def up(x: float) -> float:
    """The next float32 above x: the one step past an upper edge that the wire can carry."""
    return float(np.nextafter(np.float32(x), np.float32(math.inf)))


def down(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-math.inf)))


def tokenize(tokenizer: Bytes | Normalizing | None = None, template: ChatTemplate | None = None,
             limits: Limits = LIMITS, **fields) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return parse_tokenize(pb.TokenizeRequest(**fields), limits, tokenizer or Bytes(), template)


def tokenize_refused(**fields) -> EngineError:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineError) as caught:
        tokenize(**fields)
    return caught.value


def test_every_generation_control_lands_in_the_frozen_request() -> None:
    request = parse(request_id="g", prompt_text="hi", max_new_tokens=4, stop=["b", "\n\n", "b"], top_logprobs=20,
                    echo_prompt_logprobs=True, response_format=pb.ResponseFormat(regex="a+"),
                    sampling=pb.SamplingParams(repetition_penalty=1.5, presence_penalty=-2.0, frequency_penalty=2.0,
                                               min_p=0.5, min_new_tokens=4, logit_bias={299: -100.0, 0: 100.0, 7: 0.5}))
    assert request == Request(
        request_id="g", prompt_ids=(256, 104, 105), max_new_tokens=4,
        sampling=SamplingParams(repetition_penalty=1.5, presence_penalty=-2.0, frequency_penalty=2.0, min_p=0.5,
                                min_new_tokens=4, logit_bias=((0, 100.0), (7, 0.5), (299, -100.0))),
        stop_token_ids=frozenset(), ignore_eos=False, deadline=None, stop=("b", "\n\n", "b"), top_logprobs=20,
        echo_prompt_logprobs=True, response_format=ResponseFormat("regex", "a+"))
    assert type(request.sampling.logit_bias) is tuple and type(request.stop) is tuple
    defaults = parse(prompt_text="x", max_new_tokens=1)
    assert (defaults.stop, defaults.top_logprobs, defaults.echo_prompt_logprobs, defaults.response_format) \
        == ((), 0, False, None)
    sampling = defaults.sampling
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p,
            sampling.min_new_tokens, sampling.logit_bias) == (1.0, 0.0, 0.0, 0.0, 0, ())
    assert not sampling.penalized and not sampling.processed and not defaults.logprobs


@pytest.mark.parametrize(("kind", "source"), [("json_schema", '{"type": "object"}'), ("regex", "[0-9]+"),
                                              ("lark_grammar", "start: /a/")])
def test_each_response_format_kind_is_kept_with_its_field_name(kind: str, source: str) -> None:
    fmt = parse(prompt_text="x", max_new_tokens=1, response_format=pb.ResponseFormat(**{kind: source})).response_format
    assert fmt == ResponseFormat(kind, source) and fmt.field == f"response_format.{kind}"
    assert ResponseFormat("regex", "").field == "response_format.regex"


@pytest.mark.parametrize(("fields", "expected"), [
    ({"repetition_penalty": 0.0}, {"repetition_penalty": 1.0}),  # 0 = unset = 1, off
    ({"repetition_penalty": -0.0}, {"repetition_penalty": 1.0}),
    ({"repetition_penalty": 10.0}, {"repetition_penalty": 10.0}),
    ({"repetition_penalty": up(0.0)}, {"repetition_penalty": up(0.0)}),
    ({"repetition_penalty": 1.0}, {"repetition_penalty": 1.0}),
    ({"presence_penalty": -2.0, "frequency_penalty": 2.0}, {"presence_penalty": -2.0, "frequency_penalty": 2.0}),
    ({"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"presence_penalty": 2.0, "frequency_penalty": -2.0}),
    ({"min_p": 1.0}, {"min_p": 1.0}),
    ({"min_p": up(0.0)}, {"min_p": up(0.0)}),
    ({"min_new_tokens": 4}, {"min_new_tokens": 4}),  # exactly max_new_tokens
    ({"logit_bias": {299: 100.0, 0: -100.0}}, {"logit_bias": ((0, -100.0), (299, 100.0))}),
])
def test_generation_sampling_edges_accepted(fields, expected) -> None:  # type: ignore[no-untyped-def]
    sampling = parse(prompt_text="x", max_new_tokens=4, sampling=pb.SamplingParams(**fields)).sampling
    assert sampling == SamplingParams(**expected)


def _bound(name: str, low: str, high: str, value: float) -> tuple[pb.SamplingParams, str, str, str]:
    return (pb.SamplingParams(**{name: value}), f"sampling.{name}",
            f"sampling.{name} must be in {low}, {high}, got {value}", repr(value))


@pytest.mark.parametrize(("sampling", "field", "message", "value"), [
    *[(pb.SamplingParams(repetition_penalty=v), "sampling.repetition_penalty",
       f"sampling.repetition_penalty must be in (0, 10] (0 means unset: 1, off), got {v}", repr(v))
      for v in (up(10.0), down(0.0), -0.5, -1.0, math.nan, math.inf, -math.inf)],
    *[_bound(name, "[-2", "2]", v) for name in ("presence_penalty", "frequency_penalty")
      for v in (up(2.0), down(-2.0), math.nan, math.inf, -math.inf)],
    *[_bound("min_p", "[0", "1]", v) for v in (up(1.0), down(0.0), -0.5, math.nan, math.inf, -math.inf)],
    (pb.SamplingParams(min_new_tokens=5), "sampling.min_new_tokens",
     "sampling.min_new_tokens must be at most max_new_tokens 4, got 5", "5"),  # the request's, not the limit 8
    (pb.SamplingParams(logit_bias={k: 0.0 for k in range(301)}), "sampling.logit_bias",
     "sampling.logit_bias must hold at most 300 entries, got 301", "301 entries"),  # counted before key 300
    (pb.SamplingParams(logit_bias={5: 1.0, 300: 1.0}), "sampling.logit_bias",
     "sampling.logit_bias keys must be token ids < vocab_size 300, got 300", "300"),
    (pb.SamplingParams(logit_bias={301: 1.0, 300: 1.0}), "sampling.logit_bias",
     "sampling.logit_bias keys must be token ids < vocab_size 300, got 300", "300"),  # in ascending order
    (pb.SamplingParams(logit_bias={7: 101.0, 3: -101.0}), "sampling.logit_bias",
     "sampling.logit_bias[3] must be in [-100, 100], got -101.0", "-101.0"),
    (pb.SamplingParams(logit_bias={2: 0.0, 9: up(100.0)}), "sampling.logit_bias",
     f"sampling.logit_bias[9] must be in [-100, 100], got {up(100.0)}", repr(up(100.0))),
    (pb.SamplingParams(logit_bias={9: down(-100.0)}), "sampling.logit_bias",
     f"sampling.logit_bias[9] must be in [-100, 100], got {down(-100.0)}", repr(down(-100.0))),
    *[(pb.SamplingParams(logit_bias={1: v}), "sampling.logit_bias",
       f"sampling.logit_bias[1] must be in [-100, 100], got {v}", repr(v)) for v in (math.nan, math.inf, -math.inf)],
])
def test_generation_sampling_refusals(sampling: pb.SamplingParams, field: str, message: str, value: str) -> None:
    err = refused(prompt_text="x", max_new_tokens=4, sampling=sampling)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


def test_logit_bias_at_its_entry_bound_is_kept_sorted() -> None:
    bias = {k: float(k % 201 - 100) for k in reversed(range(300))}
    sampling = parse(prompt_text="x", max_new_tokens=1, sampling=pb.SamplingParams(logit_bias=bias)).sampling
    assert sampling.logit_bias == tuple(sorted(bias.items())) and len(sampling.logit_bias) == 300
    assert sampling.processed and not sampling.penalized


@pytest.mark.parametrize(("fields", "penalized", "processed"), [
    ({}, False, False),
    ({"repetition_penalty": 1.5}, True, True),
    ({"repetition_penalty": 0.5}, True, True),
    ({"presence_penalty": 0.5}, True, True),
    ({"frequency_penalty": -0.5}, True, True),
    ({"logit_bias": {3: 0.0}}, False, True),  # a bias of 0 still asks for the processed path
    ({"min_new_tokens": 1}, False, True),
    ({"min_p": 0.5, "temperature": 1.0, "top_k": 5, "top_p": 0.5}, False, False),  # warpers, after temperature
])
def test_penalized_and_processed(fields, penalized: bool, processed: bool) -> None:  # type: ignore[no-untyped-def]
    sampling = parse(prompt_text="x", max_new_tokens=1, sampling=pb.SamplingParams(**fields)).sampling
    assert (sampling.penalized, sampling.processed) == (penalized, processed)


@pytest.mark.parametrize(("top_logprobs", "echo", "logprobs"), [(0, False, False), (1, False, True),
                                                                (20, False, True), (0, True, True), (3, True, True)])
def test_request_logprobs(top_logprobs: int, echo: bool, logprobs: bool) -> None:
    request = parse(prompt_text="x", max_new_tokens=1, top_logprobs=top_logprobs, echo_prompt_logprobs=echo)
    assert (request.top_logprobs, request.echo_prompt_logprobs, request.logprobs) == (top_logprobs, echo, logprobs)


@pytest.mark.parametrize("stop", [["x"] * 8, ["a" * 256], ["é" * 128], ["\U0001f600" * 64], ["z", "z"]])
def test_stop_edges_accepted(stop: list[str]) -> None:
    assert parse(prompt_text="x", max_new_tokens=1, stop=stop).stop == tuple(stop)


@pytest.mark.parametrize(("stop", "field", "message", "value"), [
    (["x"] * 9, "stop", "stop must hold at most 8 strings, got 9", "9 strings"),
    (["ok", "fine", ""], "stop[2]", "stop[2] must be 1..256 bytes of UTF-8, got 0 bytes", ""),
    (["a" * 257], "stop[0]", "stop[0] must be 1..256 bytes of UTF-8, got 257 bytes", "a" * 61 + "..."),
    (["x", "é" * 128 + "a"], "stop[1]", "stop[1] must be 1..256 bytes of UTF-8, got 257 bytes", "é" * 61 + "..."),
    (["\U0001f600" * 64 + "a"], "stop[0]", "stop[0] must be 1..256 bytes of UTF-8, got 257 bytes",
     "\U0001f600" * 61 + "..."),
])
def test_stop_refusals(stop: list[str], field: str, message: str, value: str) -> None:
    err = refused(prompt_text="x", max_new_tokens=1, stop=stop)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


def test_top_logprobs_edges() -> None:
    assert parse(prompt_text="x", max_new_tokens=1, top_logprobs=20).top_logprobs == 20
    err = refused(prompt_text="x", max_new_tokens=1, top_logprobs=21)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (
        "top_logprobs", "top_logprobs must be 0..20, got 21", {"field": "top_logprobs", "value": "21"})


@pytest.mark.parametrize("source", ["a", "a" * 65_536, "é" * 32_768])
def test_response_format_size_edges_accepted(source: str) -> None:
    fmt = parse(prompt_text="x", max_new_tokens=1, response_format=pb.ResponseFormat(lark_grammar=source))
    assert fmt.response_format == ResponseFormat("lark_grammar", source)


@pytest.mark.parametrize(("fmt", "field", "message", "value"), [
    (pb.ResponseFormat(), "response_format",
     "response_format must set one of json_schema, regex or lark_grammar, got none", "None"),
    (pb.ResponseFormat(regex=""), "response_format.regex", "response_format.regex must be 1..65536 bytes, got 0",
     "0 bytes"),
    (pb.ResponseFormat(json_schema="a" * 65_537), "response_format.json_schema",
     "response_format.json_schema must be 1..65536 bytes, got 65537", "65537 bytes"),
    (pb.ResponseFormat(lark_grammar="é" * 32_768 + "a"), "response_format.lark_grammar",
     "response_format.lark_grammar must be 1..65536 bytes, got 65537", "65537 bytes"),
])
def test_response_format_refusals(fmt: pb.ResponseFormat, field: str, message: str, value: str) -> None:
    err = refused(prompt_text="x", max_new_tokens=1, response_format=fmt)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


CHEAP_REFUSALS = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 9}, "max_new_tokens"),
    ({"sampling": pb.SamplingParams(temperature=math.nan)}, "sampling.temperature"),
    ({"sampling": pb.SamplingParams(repetition_penalty=11.0)}, "sampling.repetition_penalty"),
    ({"sampling": pb.SamplingParams(min_new_tokens=2)}, "sampling.min_new_tokens"),
    ({"sampling": pb.SamplingParams(logit_bias={300: 0.0})}, "sampling.logit_bias"),
    ({"stop_token_ids": [300]}, "stop_token_ids"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop": ["x"] * 9}, "stop"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"response_format": pb.ResponseFormat()}, "response_format"),
    ({"response_format": pb.ResponseFormat(regex="")}, "response_format.regex"),
]


@pytest.mark.parametrize(("fields", "field"), CHEAP_REFUSALS)
def test_cheap_refusals_come_before_tokenizing(fields, field: str) -> None:  # type: ignore[no-untyped-def]
    tokenizer = Bytes()
    err = refused(tokenizer=tokenizer, **{"prompt_text": "x" * 2000, "max_new_tokens": 1, **fields})
    assert type(err) is InvalidField and err.field == field  # not the prompt's ContextLengthExceeded
    assert tokenizer.calls == []


@pytest.mark.parametrize(("fields", "field"), CHEAP_REFUSALS)
def test_cheap_refusals_come_before_rendering(fields, field: str) -> None:  # type: ignore[no-untyped-def]
    tokenizer = Bytes()
    err = refused(tokenizer=tokenizer, template=NeverRendered(),
                  **{"chat": chat(("user", "hi")), "max_new_tokens": 1, **fields})
    assert type(err) is InvalidField and err.field == field
    assert tokenizer.calls == []


def test_cheap_refusals_come_before_the_prompt_ids_are_checked() -> None:
    err = refused(prompt_token_ids=pb.TokenIds(ids=[999] * 17), max_new_tokens=1, top_logprobs=21)
    assert err.field == "top_logprobs"


def test_prompt_text_that_tokenizes_to_nothing_is_refused() -> None:
    tokenizer = Normalizing()
    err = refused(tokenizer=tokenizer, prompt_text=" \t\n ", max_new_tokens=1)
    assert tokenizer.calls == [(" \t\n ", True)]
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (
        "prompt_text", r"prompt_text ' \t\n ' tokenizes to no tokens; send text that does",
        {"field": "prompt_text", "value": " \t\n "})
    assert parse(tokenizer=Normalizing(), prompt_text=" a b ", max_new_tokens=1).prompt_ids == (97, 98)


def test_text_that_tokenizes_to_nothing_is_clipped_in_the_message() -> None:
    err = refused(tokenizer=Normalizing(), prompt_text=" " * 198, max_new_tokens=1)  # repr: 200 characters
    assert err.message == f"prompt_text {' ' * 198!r} tokenizes to no tokens; send text that does"
    err = refused(tokenizer=Normalizing(), prompt_text=" " * 199, max_new_tokens=1)  # repr: 201
    assert err.message == f"prompt_text {(repr(' ' * 199))[:197]}... tokenizes to no tokens; send text that does"
    assert err.metadata == {"field": "prompt_text", "value": " " * 61 + "..."}
    err = refused(tokenizer=Normalizing(), prompt_text=" " * 1024, max_new_tokens=1)  # the bound: 16 * 64
    assert err.message == f"prompt_text '{' ' * 196}... tokenizes to no tokens; send text that does"


@pytest.mark.parametrize("raw", ["", "r-1", "a.B:c_d-9", "x" * 128])
def test_loggable_request_id_keeps_a_valid_or_empty_id(raw: str) -> None:
    assert loggable_request_id(raw) == raw


@pytest.mark.parametrize(("raw", "logged"), [
    ("x" * 129, "'" + "x" * 64 + "'"),  # at most 64 characters of it
    ("x" * 65 + "/", "'" + "x" * 64 + "'"),
    ("a b", "'a b'"),
    ("é", r"'\xe9'"),
    ("\x1b[31mred\x1b[0m", r"'\x1b[31mred\x1b[0m'"),
    ("\x00" * 100, "'" + r"\x00" * 17 + "..."),  # 64 escaped are 258 characters: clipped to 72
    ("\n" * 35, "'" + r"\n" * 35 + "'"),  # 72 characters: not clipped
    ("\n" * 36, "'" + r"\n" * 34 + "..."),  # 74: clipped
])
def test_loggable_request_id_escapes_and_caps_an_invalid_id(raw: str, logged: str) -> None:
    assert loggable_request_id(raw) == logged
    assert len(logged) <= 72 and logged.isascii() and logged.isprintable()


def test_tokenize_text_is_tokenized_with_bos() -> None:
    tokenizer = Bytes()
    assert tokenize(tokenizer, text="hi") == (256, 104, 105)
    assert tokenizer.calls == [("hi", True)]


def test_tokenize_chat_is_rendered_and_tokenized_without_special_tokens() -> None:
    tokenizer = Bytes()
    ids = tokenize(tokenizer, TEMPLATE, chat=chat(("system", "s"), ("user", "hi")))
    assert ids == tuple(b"<system>s<user>hi>")
    assert tokenizer.calls == [("<system>s<user>hi>", False)]


def test_tokenize_a_text_longer_than_the_context_within_the_characters_bound() -> None:
    assert tokenize(text="x" * 100) == (256, *[120] * 100)  # 101 tokens, max_context_tokens 16
    assert len(tokenize(text="x" * 1024)) == 1025  # 64 characters per token of the context
    tokenizer = Bytes()
    with pytest.raises(ContextLengthExceeded) as caught:
        tokenize(tokenizer, text="x" * 1025)
    assert tokenizer.calls == [], "refused before tokenizing"
    err = caught.value
    assert err.message == "text of 1025 characters is at least 16 tokens, more than max_context_tokens 16"
    assert err.metadata == {"promptTokens": "16", "maxNewTokens": "0", "maxContextTokens": "16"}


def test_tokenize_chat_longer_than_the_context_within_the_characters_bound() -> None:
    assert len(tokenize(template=TEMPLATE, chat=chat(("u", "x" * 100)))) == 104
    with pytest.raises(ContextLengthExceeded) as caught:
        tokenize(template=TEMPLATE, chat=chat(("u", "x" * 1025)))
    assert caught.value.message == ("chat.messages with 1025 characters of content is at least 16 tokens, "
                                    "more than max_context_tokens 16")
    assert caught.value.metadata == {"promptTokens": "16", "maxNewTokens": "0", "maxContextTokens": "16"}
    with pytest.raises(ContextLengthExceeded) as caught:  # 1024 of content, 1028 rendered
        tokenize(template=TEMPLATE, chat=chat(("u", "x" * 1024)))
    assert caught.value.message == ("chat.messages rendered to 1028 characters is at least 16 tokens, "
                                    "more than max_context_tokens 16")
    assert caught.value.metadata == {"promptTokens": "16", "maxNewTokens": "0", "maxContextTokens": "16"}


@pytest.mark.parametrize(("fields", "template", "tokenizer", "field", "message", "value"), [
    ({}, TEMPLATE, Bytes, "prompt", "prompt must be set: give text or chat", "None"),
    ({"text": ""}, TEMPLATE, Bytes, "text", "text must not be empty, got ''", ""),
    ({"text": " \n"}, TEMPLATE, Normalizing, "text", r"text ' \n' tokenizes to no tokens; send text that does", " \n"),
    ({"text": " " * 199}, None, Normalizing, "text",
     f"text {repr(' ' * 199)[:197]}... tokenizes to no tokens; send text that does", " " * 61 + "..."),
    ({"chat": chat(("user", "hi"))}, None, Bytes, "chat",
     "chat needs a model with a chat template, and the engine's model has none "
     "(ServerInfo.has_chat_template is false); send prompt_text or prompt_token_ids", "1 messages"),
    ({"chat": chat()}, TEMPLATE, Bytes, "chat.messages", "chat.messages must hold at least one message, got []", "[]"),
    ({"chat": chat(*[("u", "")] * 17)}, TEMPLATE, Bytes, "chat.messages",
     "chat.messages must hold at most max_context_tokens 16 messages, got 17", "17 messages"),
    ({"chat": chat(("", "a"))}, TEMPLATE, Bytes, "chat.messages[0].role",
     "chat.messages[0].role must not be empty, got ''", ""),
    ({"chat": chat(("forbidden", "b"))}, TEMPLATE, Bytes, "chat.messages",
     "chat.messages (roles forbidden) were refused by the model's chat template: role forbidden is not allowed",
     "forbidden"),
    ({"chat": chat(("user", "a"))}, SILENT, Bytes, "chat.messages",
     "chat.messages (roles user) rendered to '', which is no tokens", "user"),
])
def test_tokenize_refusals(fields, template, tokenizer, field: str, message: str,  # type: ignore[no-untyped-def]
                           value: str) -> None:
    err = tokenize_refused(tokenizer=tokenizer(), template=template, **fields)
    assert type(err) is InvalidField
    assert (err.field, err.message, err.metadata) == (field, message, {"field": field, "value": value})


def test_tokenize_text_ignores_the_chat_template() -> None:
    tokenizer = Bytes()
    assert tokenize(tokenizer, NeverRendered(), text="a") == (256, 97)  # type: ignore[arg-type]


def test_tokenize_without_special_tokens_passes_the_choice_to_the_tokenizer() -> None:
    # vLLM's /tokenize add_special_tokens=false: the text's own tokens, no BOS (found by `make mutate`)
    bytes_ = Bytes()
    assert parse_tokenize(pb.TokenizeRequest(text="hi"), LIMITS, bytes_, None, add_special_tokens=False) == (104, 105)
    assert parse_tokenize(pb.TokenizeRequest(text="hi"), LIMITS, bytes_, None) == (256, 104, 105)
    assert bytes_.calls == [("hi", False), ("hi", True)]
