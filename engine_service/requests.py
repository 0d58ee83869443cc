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
MAX_REPETITION_PENALTY = 10.0
MAX_OPENAI_PENALTY = 2.0  # presence_penalty and frequency_penalty are in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_STOP_STRINGS = 8
MAX_STOP_BYTES = 256
MAX_TOP_LOGPROBS = 20
MAX_RESPONSE_FORMAT_BYTES = 65_536
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
    repetition_penalty: float = 1.0  # 1 = off (transformers' definition, over prompt and output)
    presence_penalty: float = 0.0  # OpenAI's, over the output
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0 = off
    min_new_tokens: int = 0  # EOS and stop tokens masked until this many were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any of the penalties that depend on the tokens seen (logits_processors.Penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits change before temperature (bias, the min_new_tokens mask, penalties)."""
        return self.penalized or bool(self.logit_bias) or self.min_new_tokens > 0


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match: `kind` names the oneof field set, `source` its text."""

    kind: str  # "json_schema", "regex" or "lark_grammar"
    source: str

    @property
    def field(self) -> str:
        return f"response_format.{self.kind}"


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    deadline: float | None  # time.monotonic() seconds, or None
    stop: tuple[str, ...] = ()  # stop strings, in the order given
    top_logprobs: int = 0  # 0 = no log-probabilities
    echo_prompt_logprobs: bool = False
    response_format: ResponseFormat | None = None

    @property
    def logprobs(self) -> bool:
        """Whether log-probabilities are computed for this request at all."""
        return self.top_logprobs > 0 or self.echo_prompt_logprobs

    @classmethod
    def parse(cls, msg: Any, limits: Limits, tokenizer: Encoder, deadline: float | None,
              chat_template: ChatTemplate | None = None) -> Request:
        request_id = msg.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if not REQUEST_ID.fullmatch(request_id):
            raise InvalidField(
                "request_id", request_id,
                f"request_id must be 1..128 characters of [A-Za-z0-9._:-], got {request_id[:140]!r}",
            )
        # The cheap checks first: nothing is tokenized or rendered for a request refused anyway.
        max_new = msg.max_new_tokens
        if not 1 <= max_new <= limits.max_new_tokens_limit:
            raise InvalidField(
                "max_new_tokens", max_new, f"max_new_tokens must be 1..{limits.max_new_tokens_limit}, got {max_new}"
            )
        sampling = _parse_sampling(msg.sampling, max_new, limits.vocab_size)
        stops = tuple(msg.stop_token_ids)
        for token in stops:
            if token >= limits.vocab_size:
                raise InvalidField(
                    "stop_token_ids", token, f"stop_token_ids must be < vocab_size {limits.vocab_size}, got {token}"
                )
        stop = _parse_stop(msg.stop)
        if msg.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidField("top_logprobs", msg.top_logprobs,
                               f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {msg.top_logprobs}")
        response_format = _parse_response_format(msg)
        prompt = _parse_prompt(msg, limits, tokenizer, chat_template)
        if len(prompt) + max_new > limits.max_context_tokens:
            raise ContextLengthExceeded.build(len(prompt), max_new, limits.max_context_tokens)
        return cls(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            sampling=sampling,
            stop_token_ids=frozenset(stops),
            ignore_eos=msg.ignore_eos,
            deadline=deadline,
            stop=stop,
            top_logprobs=msg.top_logprobs,
            echo_prompt_logprobs=msg.echo_prompt_logprobs,
            response_format=response_format,
        )


def loggable_request_id(raw: str) -> str:
    """A request id as received, fit for logs, spans and messages before the request is parsed:
    itself when valid (or empty), else at most 64 characters of it, escaped (ascii())."""
    if not raw or REQUEST_ID.fullmatch(raw):
        return raw
    return _clip(ascii(raw[:64]), 72)


def parse_tokenize(msg: Any, limits: Limits, tokenizer: Encoder, chat_template: ChatTemplate | None,
                   add_special_tokens: bool = True) -> tuple[int, ...]:
    """The token ids a TokenizeRequest's prompt makes, validated as Decode's prompt_text or chat is
    (its `text` is Decode's prompt_text, and named so). A prompt longer than max_context_tokens is
    tokenized all the same, so that the caller can trim it, within the bounds that protect the event
    loop before tokenizing: MAX_CHARS_PER_TOKEN characters per token of context, and for chat at
    most max_context_tokens messages. `add_special_tokens` False: text without the BOS (and any other
    token the tokenizer adds), as vLLM's /tokenize offers."""
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidField("prompt", None, "prompt must be set: give text or chat")
    if which == "chat":
        return _parse_chat(msg, limits, tokenizer, chat_template, max_new_tokens=0)
    text = msg.text
    if not text:
        raise InvalidField("text", text, "text must not be empty, got ''")
    _check_text_length(len(text), f"text of {len(text)} characters", 0, limits)
    ids = tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise InvalidField("text", _clip(text), f"text {_clip(repr(text))} tokenizes to no tokens; send text that does")
    return ids


def _parse_prompt(msg: Any, limits: Limits, tokenizer: Encoder, chat_template: ChatTemplate | None) -> tuple[int, ...]:
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidField("prompt", None, "prompt must be set: give prompt_text, prompt_token_ids or chat")
    if which == "prompt_text":
        text = msg.prompt_text
        if not text:
            raise InvalidField("prompt_text", text, "prompt_text must not be empty, got ''")
        _check_text_length(len(text), f"prompt_text of {len(text)} characters", msg.max_new_tokens, limits)
        ids = tuple(tokenizer.encode(text))
        if not ids:  # a tokenizer that normalizes it all away and adds no BOS: nothing to prefill
            raise InvalidField("prompt_text", _clip(text),
                               f"prompt_text {_clip(repr(text))} tokenizes to no tokens; send text that does")
        return ids
    if which == "chat":
        return _parse_chat(msg, limits, tokenizer, chat_template, msg.max_new_tokens)
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


def _parse_chat(msg: Any, limits: Limits, tokenizer: Encoder, chat_template: ChatTemplate | None,
                max_new_tokens: int) -> tuple[int, ...]:
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
    _check_text_length(content, f"chat.messages with {content} characters of content", max_new_tokens, limits)
    roles = _clip(", ".join(m.role for m in messages))
    try:
        text = chat_template.render(messages)
    except ChatTemplateError as err:
        raise InvalidField("chat.messages", roles,
                           f"chat.messages (roles {roles}) were refused by the model's chat template: {_clip(str(err))}"
                           ) from None
    _check_text_length(len(text), f"chat.messages rendered to {len(text)} characters", max_new_tokens, limits)
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


def _parse_sampling(sampling: Any, max_new_tokens: int, vocab_size: int) -> SamplingParams:
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
    repetition = sampling.repetition_penalty if sampling.repetition_penalty != 0.0 else 1.0
    if not (math.isfinite(repetition) and 0.0 < repetition <= MAX_REPETITION_PENALTY):
        raise InvalidField("sampling.repetition_penalty", sampling.repetition_penalty,
                           f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                           f"(0 means unset: 1, off), got {sampling.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY):
            raise InvalidField(f"sampling.{name}", value,
                               f"sampling.{name} must be in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}], got {value}")
    if not (math.isfinite(sampling.min_p) and 0.0 <= sampling.min_p <= 1.0):
        raise InvalidField("sampling.min_p", sampling.min_p, f"sampling.min_p must be in [0, 1], got {sampling.min_p}")
    if sampling.min_new_tokens > max_new_tokens:
        raise InvalidField("sampling.min_new_tokens", sampling.min_new_tokens,
                           f"sampling.min_new_tokens must be at most max_new_tokens {max_new_tokens}, "
                           f"got {sampling.min_new_tokens}")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=sampling.top_k, seed=sampling.seed,
                          repetition_penalty=repetition, presence_penalty=sampling.presence_penalty,
                          frequency_penalty=sampling.frequency_penalty, min_p=sampling.min_p,
                          min_new_tokens=sampling.min_new_tokens,
                          logit_bias=_parse_logit_bias(sampling.logit_bias, vocab_size))


def _parse_logit_bias(bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField("sampling.logit_bias", f"{len(bias)} entries",
                           f"sampling.logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    entries = sorted(bias.items())
    for token, value in entries:
        if token >= vocab_size:
            raise InvalidField("sampling.logit_bias", token,
                               f"sampling.logit_bias keys must be token ids < vocab_size {vocab_size}, got {token}")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidField("sampling.logit_bias", value,
                               f"sampling.logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                               f"got {value}")
    return tuple((token, value) for token, value in entries)


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"{len(stop)} strings",
                           f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for index, text in enumerate(stop):
        size = len(text.encode("utf-8"))
        if not 1 <= size <= MAX_STOP_BYTES:
            raise InvalidField(f"stop[{index}]", _clip(text),
                               f"stop[{index}] must be 1..{MAX_STOP_BYTES} bytes of UTF-8, got {size} bytes")
    return tuple(stop)


def _parse_response_format(msg: Any) -> ResponseFormat | None:
    """The constraint's kind and text, bounded; compiling it is the engine's (constraint.py), still
    before anything is queued."""
    if not msg.HasField("response_format"):
        return None
    kind = msg.response_format.WhichOneof("format")
    if kind is None:
        raise InvalidField("response_format", None,
                           "response_format must set one of json_schema, regex or lark_grammar, got none")
    source = getattr(msg.response_format, kind)
    fmt = ResponseFormat(kind, source)
    size = len(source.encode("utf-8"))
    if not 1 <= size <= MAX_RESPONSE_FORMAT_BYTES:
        raise InvalidField(fmt.field, f"{size} bytes",
                           f"{fmt.field} must be 1..{MAX_RESPONSE_FORMAT_BYTES} bytes, got {size}")
    return fmt
