"""Frozen domain requests, parsed once at the boundary; the engine trusts them.

`Request.parse` reads a DecodeRequest message by attribute (it never imports generated code)
and raises InvalidField or ContextLengthExceeded naming the field and the value.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from engine_service.model.chat_template import ChatMessage, ChatTemplate, ChatTemplateError
from shared.errors import ContextLengthExceeded, InvalidField

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_TEMPERATURE = 100.0
# No tokenizer makes fewer tokens than characters / 64: text longer than this many characters per
# token of the context is refused before it is tokenized (or rendered), with a lower bound.
MAX_CHARS_PER_TOKEN = 64


class Encoder(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    """What the boundary enforces, from the engine's configuration."""

    vocab_size: int
    max_context_tokens: int
    max_new_tokens_limit: int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    deadline: float | None  # time.monotonic() seconds, or None

    @classmethod
    def parse(cls, msg: Any, limits: Limits, tokenizer: Encoder, deadline: float | None,
              chat_template: ChatTemplate | None = None) -> Request:
        request_id = msg.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if not REQUEST_ID.fullmatch(request_id):
            raise InvalidField(
                "request_id", request_id,
                f"request_id must be 1..128 characters of [A-Za-z0-9._:-], got {request_id[:140]!r}",
            )
        max_new = msg.max_new_tokens
        prompt = _parse_prompt(msg, limits, tokenizer, chat_template)
        if not 1 <= max_new <= limits.max_new_tokens_limit:
            raise InvalidField(
                "max_new_tokens", max_new, f"max_new_tokens must be 1..{limits.max_new_tokens_limit}, got {max_new}"
            )
        if len(prompt) + max_new > limits.max_context_tokens:
            raise ContextLengthExceeded.build(len(prompt), max_new, limits.max_context_tokens)
        stops = tuple(msg.stop_token_ids)
        for token in stops:
            if token >= limits.vocab_size:
                raise InvalidField(
                    "stop_token_ids", token, f"stop_token_ids must be < vocab_size {limits.vocab_size}, got {token}"
                )
        return cls(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            sampling=_parse_sampling(msg.sampling),
            stop_token_ids=frozenset(stops),
            ignore_eos=msg.ignore_eos,
            deadline=deadline,
        )


def _parse_prompt(msg: Any, limits: Limits, tokenizer: Encoder, chat_template: ChatTemplate | None) -> tuple[int, ...]:
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidField("prompt", None, "prompt must be set: give prompt_text, prompt_token_ids or chat")
    if which == "prompt_text":
        text = msg.prompt_text
        if not text:
            raise InvalidField("prompt_text", text, "prompt_text must not be empty, got ''")
        _check_text_length(len(text), f"prompt_text of {len(text)} characters", msg.max_new_tokens, limits)
        return tuple(tokenizer.encode(text))
    if which == "chat":
        return _parse_chat(msg, limits, tokenizer, chat_template)
    ids = tuple(msg.prompt_token_ids.ids)
    if not ids:
        raise InvalidField("prompt_token_ids.ids", [], "prompt_token_ids.ids must not be empty, got []")
    if len(ids) > limits.max_context_tokens:
        raise ContextLengthExceeded.build(len(ids), msg.max_new_tokens, limits.max_context_tokens)
    largest = max(ids)
    if largest >= limits.vocab_size:
        index = ids.index(largest)
        raise InvalidField(
            "prompt_token_ids.ids", largest,
            f"prompt_token_ids.ids[{index}] must be < vocab_size {limits.vocab_size}, got {largest}",
        )
    return ids


def _parse_chat(msg: Any, limits: Limits, tokenizer: Encoder, chat_template: ChatTemplate | None) -> tuple[int, ...]:
    """Render the messages with the model's chat template (generation prompt added) and tokenize
    the text without adding special tokens, as transformers' apply_chat_template(tokenize=True) does."""
    count = len(msg.chat.messages)
    if chat_template is None:
        raise InvalidField("chat", f"{count} messages",
                           "chat needs a model with a chat template, and the engine's model has none "
                           "(ServerInfo.has_chat_template is false); send prompt_text or prompt_token_ids")
    if count == 0:
        raise InvalidField("chat.messages", [], "chat.messages must hold at least one message, got []")
    # Rendering costs time on the event loop per message, whatever its content: bound the count
    # before rendering (a chat template writes at least one token per message in practice).
    if count > limits.max_context_tokens:
        raise InvalidField("chat.messages", f"{count} messages",
                           f"chat.messages must hold at most max_context_tokens {limits.max_context_tokens} "
                           f"messages, got {count}")
    messages = [ChatMessage(role=m.role, content=m.content) for m in msg.chat.messages]
    for index, message in enumerate(messages):
        if not message.role:
            raise InvalidField(f"chat.messages[{index}].role", "", f"chat.messages[{index}].role must not be empty, got ''")
    content = sum(len(m.content) for m in messages)
    _check_text_length(content, f"chat.messages with {content} characters of content", msg.max_new_tokens, limits)
    roles = _clip(", ".join(m.role for m in messages))
    try:
        text = chat_template.render(messages)
    except ChatTemplateError as err:
        raise InvalidField("chat.messages", roles,
                           f"chat.messages (roles {roles}) were refused by the model's chat template: {_clip(str(err))}"
                           ) from None
    _check_text_length(len(text), f"chat.messages rendered to {len(text)} characters", msg.max_new_tokens, limits)
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise InvalidField("chat.messages", roles,
                           f"chat.messages (roles {roles}) rendered to {_clip(repr(text))}, which is no tokens")
    return ids


def _clip(text: str, limit: int = 200) -> str:
    """Request-sent text in an error message, kept short enough for a status trailer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_text_length(characters: int, text: str, max_new_tokens: int, limits: Limits) -> None:
    """A cheap bound before tokenizing on the event loop (see MAX_CHARS_PER_TOKEN): `text` names
    the characters counted; promptTokens is then a lower bound."""
    if characters > MAX_CHARS_PER_TOKEN * limits.max_context_tokens:
        at_least = characters // MAX_CHARS_PER_TOKEN
        raise ContextLengthExceeded(
            f"{text} is at least {at_least} tokens, more than max_context_tokens "
            f"{limits.max_context_tokens}",
            metadata={"promptTokens": at_least, "maxNewTokens": max_new_tokens,
                      "maxContextTokens": limits.max_context_tokens},
        )


def _parse_sampling(sampling: Any) -> SamplingParams:
    temperature = sampling.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidField(
            "sampling.temperature", temperature,
            f"sampling.temperature must be finite and in [0, {MAX_TEMPERATURE:g}], got {temperature}",
        )
    top_p = sampling.top_p if sampling.top_p != 0.0 else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidField("sampling.top_p", sampling.top_p, f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidField("sampling.top_k", sampling.top_k, f"sampling.top_k must be >= 0, got {sampling.top_k}")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=sampling.top_k, seed=sampling.seed)
