"""What the sweep asks of a server, whatever its protocol: the domain values of one call.

Each protocol has one adapter that speaks it and answers in these terms: `bench_client.rpc`
(engine.v1 over gRPC) and `bench_client.openai_http` (OpenAI-compatible HTTP: llama-server, vLLM,
SGLang, TGI). A failed call raises the domain exception of `shared.errors` that the adapter chose;
the policy table, the point runner, the metrics and the results never learn which protocol it was.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

ENGINE_V1 = "engine.v1"
OPENAI = "openai"
APIS = (ENGINE_V1, OPENAI)


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself. Fields a server does not report are 0 or "" (an OpenAI
    server reports no queue capacity, for instance); `reported` holds its own answer as it gave it
    (llama-server's /props, vLLM's /v1/models), so that the results keep its version and settings."""

    model: str
    max_context_tokens: int
    max_new_tokens_limit: int
    max_batch_size: int
    queue_capacity: int
    vocab_size: int
    eos_token_id: int
    bos_token_id: int
    device: str
    dtype: str
    tokenizer: str
    engine_version: str
    has_chat_template: bool = False
    quantization: str = ""  # engine.v1: none, int8 or int4; "" where the server does not say
    cpu_capability: str = ""  # engine.v1: torch's capability, the CPU flags and model name
    precision_reason: str = ""  # engine.v1: why dtype and quantization are what they are
    api: str = ENGINE_V1
    reported: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ChatTurn:
    role: str  # "system", "user", "assistant"
    content: str


@dataclass(frozen=True)
class DecodeSpec:
    """One measured request. Its prompt is exactly one of: token ids (`prompt_token_ids`, for a
    server that takes them: engine.v1, llama-server, vLLM), text (`prompt_text`: every server's
    completions endpoint), or chat messages (`messages`: the chat endpoint, the server renders its
    template)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    prompt_text: str = ""
    messages: tuple[ChatTurn, ...] = ()

    def __post_init__(self) -> None:
        given = sum((bool(self.prompt_token_ids), bool(self.prompt_text), bool(self.messages)))
        if given != 1:
            raise ValueError(f"a DecodeSpec takes exactly one of prompt_token_ids, prompt_text and messages, "
                             f"got {given} (request {self.request_id!r})")


class NoTokenizeEndpoint(Exception):
    """The server has no tokenize endpoint (an OpenAI-compatible server without /tokenize)."""


@dataclass(frozen=True)
class ChatSpec:
    request_id: str
    messages: tuple[ChatTurn, ...]
    max_new_tokens: int
    temperature: float  # 0: greedy
    seed: int
    stop: tuple[str, ...] = ()  # stop strings: the answer ends before the first that appears
    json_schema: str | None = None  # a JSON Schema (as JSON text) the answer must validate against
    top_logprobs: int = 0  # > 0: each token's log-probability and this many alternatives


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability as the server reported it, and its alternatives."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # (text, logprob), most likely first


@dataclass(frozen=True)
class EngineTiming:
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class Chunk:
    """One streamed message: when it arrived, how many tokens it carried and their text."""

    received_at: float  # time.perf_counter()
    num_tokens: int
    text: str  # "" where the engine's tokenizer cannot detokenize (or holds back a partial character)
    finish_reason: str | None  # "LENGTH", "EOS", "STOP" on the last message
    prompt_tokens: int | None
    completion_tokens: int | None
    timing: EngineTiming | None
    cached_prompt_tokens: int | None = None  # of prompt_tokens, those whose KV came from the prefix cache
    # The server's own view of the request, as it reported it (llama-server's `timings`: prompt_n,
    # prompt_ms, predicted_n, predicted_ms, cache_n...), on the last message; None where it reports none.
    server_timings: Mapping[str, float] | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them
    stop_string: str | None = None  # on the last message, the stop string that ended the answer


class DecodeStream:
    """The chunks of one call (iterate it once), and the replica that answered it: set once the
    server answered (a chunk or an error), None while nothing came back or when none was reached.
    An adapter builds it with the async iterator of its chunks."""

    def __init__(self, chunks: AsyncIterator[Chunk] | None = None) -> None:
        self.replica: str | None = None
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[Chunk]:
        assert self._chunks is not None, "a DecodeStream is built by an adapter's decode or chat"
        return self._chunks


class ServerClient(Protocol):
    """One adapter's client for one target, owned for the life of a sweep's server."""

    target: str

    async def close(self) -> None: ...

    async def server_info(self, timeout: float = 10.0) -> ServerInfo: ...

    async def is_serving(self, timeout: float = 2.0) -> bool: ...

    async def wait_until_serving(self, timeout: float, poll_s: float = 0.2) -> bool: ...

    def decode(self, spec: DecodeSpec, *, timeout: float,
               attributes: Mapping[str, Any] | None = None) -> DecodeStream: ...

    def chat(self, spec: ChatSpec, *, timeout: float) -> DecodeStream: ...

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        """The token ids the server's own tokenizer gives `text` (engine.v1 Tokenize, llama-server's
        and vLLM's POST /tokenize); raises NoTokenizeEndpoint where it has none, else its EngineError."""
        ...


async def poll_until_serving(is_serving: Callable[[float], Awaitable[bool]], timeout: float,
                             poll_s: float = 0.2) -> bool:
    """Ask `is_serving(per_check_timeout)` until it says yes or `timeout` seconds passed; whether it did.
    Each check gets at most 2 s, and never more than what is left (at least 0.1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        if await is_serving(max(0.1, min(2.0, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
