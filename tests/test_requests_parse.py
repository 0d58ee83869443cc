"""Request.parse in-process: every bound exactly at its edge, each refusal's field, message and
metadata, and what a valid request becomes (the boundary that tests/test_engine_contract.py drives
over gRPC, here in milliseconds; kept honest by `make mutate`, docs/mutation-testing.md)."""

from __future__ import annotations

import math
import re

import pytest

from engine.v1 import engine_pb2 as pb
from engine_service.model.chat_template import ChatTemplate
from engine_service.requests import Limits, Request, SamplingParams
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


def parse(limits: Limits = LIMITS, deadline: float | None = None, template: ChatTemplate | None = None,
          tokenizer: Bytes | None = None, **fields) -> Request:  # type: ignore[no-untyped-def]
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
