"""The async front of the engine: submit a parsed request, stream its tokens back.

Bridges the event loop and the decode loop thread: the loop thread hands each step's emissions
over with one `call_soon_threadsafe`; each request's TokenStream coalesces the tokens that
arrived since its reader last looked into one StreamUpdate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from engine_service.config import EngineConfig
from engine_service.generation.constraint import Constraint, ConstraintCompiler
from engine_service.generation.logprobs import TokenLogprobs
from engine_service.generation.output_text import OutputText
from engine_service.model.loader import LoadedModel
from engine_service.requests import Limits, Request, ResponseFormat
from engine_service.runtime.loop import DecodeLoop, Deliver, Emission
from engine_service.scheduling.scheduler import LoadSnapshot
from engine_service.scheduling.sequence import FinishReason, Sequence
from shared.errors import EngineDraining, EngineError, EngineUnavailable, SequenceError

log = structlog.get_logger()


@dataclass(frozen=True)
class EngineInfo:
    model: str
    max_context_tokens: int
    max_new_tokens_limit: int
    max_batch_size: int
    queue_capacity: int
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None
    device: str
    dtype: str
    tokenizer: str
    has_chat_template: bool
    quantization: str
    cpu_capability: str
    precision_reason: str


@dataclass
class StreamUpdate:
    """Tokens since the reader last looked, with the text they released and their log-probabilities
    (when asked for); `finish` or `error` on the last update."""

    tokens: list[int]
    finish: FinishReason | None = None
    error: EngineError | None = None
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class TokenStream:
    """One request's tokens on the event loop side."""

    _pending: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[TokenLogprobs] = field(default_factory=list)
    _prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    _finish: FinishReason | None = None
    _error: EngineError | None = None
    _done: bool = False
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    interval: int = 1  # wake the reader once this many tokens wait (the first token and the end at once)
    _sent_first: bool = False
    _offered_at: float = 0.0

    def stalled_since(self, now: float) -> float:
        """Seconds the reader has left offered tokens untaken (0 when none are offered)."""
        return now - self._offered_at if self._ready.is_set() and not self._done else 0.0

    def _offer(self) -> None:
        if not self._ready.is_set():
            self._offered_at = time.monotonic()
            self._ready.set()

    def push(self, emission: Emission) -> None:
        if self._done:  # already ended (stalled reader, drain, fatal): later tokens are moot
            return
        self._pending.extend(emission.tokens)
        self._text.append(emission.text)
        self._logprobs.extend(emission.logprobs)
        self._prompt_logprobs.extend(emission.prompt_logprobs)
        if emission.finish is not None or emission.error is not None:
            self._finish, self._error, self._done = emission.finish, emission.error, True
        if self._done or not self._sent_first or len(self._pending) >= self.interval:
            self._offer()

    def fail(self, error: EngineError) -> None:
        if not self._done:
            self._error, self._done = error, True
            self._offer()

    async def next(self) -> StreamUpdate:
        await self._ready.wait()
        self._ready.clear()
        update = StreamUpdate(self._pending, text="".join(self._text), logprobs=self._logprobs,
                              prompt_logprobs=self._prompt_logprobs)
        self._pending, self._text, self._logprobs, self._prompt_logprobs = [], [], [], []
        self._sent_first = self._sent_first or bool(update.tokens)
        if self._done:
            update.finish, update.error = self._finish, self._error
        return update


@dataclass(eq=False)
class Handle:
    """What the servicer holds for one submitted request."""

    seq: Sequence
    stream: TokenStream


FatalCallback = Callable[[BaseException], None]
# The decode loop, all but wired: given the engine's two callbacks from its thread, it returns the
# DecodeLoop (not yet started) that delivers to them.
LoopWiring = Callable[[Deliver, FatalCallback], DecodeLoop]


class Engine:
    """A model served: built whole by `build_engine` (build.py), never half. A constructed Engine
    runs: its decode loop thread and its stall watch start here (on the running event loop, which
    the loop thread hands its emissions to), and `stop()` ends them."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, info: EngineInfo, limits: Limits,
                 decode_loop: LoopWiring) -> None:
        self.config = config
        self.loaded = loaded
        self.info = info
        self.limits = limits
        self._constraints: ConstraintCompiler | None = None  # built on first use (compile)
        self._constraints_built = asyncio.Lock()
        self.draining = False
        self._grace = 0.0
        self._fatal_message: str | None = None  # set once the decode loop has died: the engine is going down
        self._live: set[Handle] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._fatal_callbacks: list[FatalCallback] = []
        self._event_loop = asyncio.get_running_loop()
        self._loop_thread = decode_loop(self._deliver_threadsafe, self._fatal_threadsafe)
        self._scheduler = self._loop_thread.scheduler
        self._loop_thread.start()
        self._stall_watch = asyncio.create_task(self._watch_stalls(config.stall_seconds))

    # -- lifecycle -------------------------------------------------------------------------
    def on_fatal(self, callback: FatalCallback) -> None:
        self._fatal_callbacks.append(callback)

    def begin_drain(self, grace_seconds: float) -> None:
        self.draining, self._grace = True, grace_seconds

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def end_all(self, error: EngineError) -> int:
        """End every stream still in flight with `error`; returns how many."""
        live = list(self._live)
        for handle in live:
            handle.seq.cancelled = True
            handle.stream.fail(error)
        self._scheduler.wake()
        return len(live)

    async def _watch_stalls(self, stall_seconds: float) -> None:
        """A reader that takes no tokens for `stall_seconds` has its sequence aborted
        (SEQUENCE_ABORTED, cause "reader stalled") so that its KV rows serve others."""
        while True:
            await asyncio.sleep(min(1.0, stall_seconds / 4))
            now = time.monotonic()
            for handle in list(self._live):
                stalled = handle.stream.stalled_since(now)
                if stalled >= stall_seconds:
                    seq = handle.seq
                    seq.cancelled = True
                    handle.stream.fail(SequenceError.build(
                        seq.request_id, len(seq.generated), f"reader stalled: took no tokens for {stalled:.1f} s"))
                    log.warning("reader_stalled", request_id=seq.request_id, **seq.trace, stalled_s=round(stalled, 3))
                    self._scheduler.wake()

    def stop(self) -> None:
        self._stall_watch.cancel()
        self._loop_thread.stop()

    # -- requests --------------------------------------------------------------------------
    async def compile(self, response_format: ResponseFormat, request_id: str) -> Constraint:
        """A request's response_format compiled for this model's tokenizer (InvalidField when the
        compiler refuses it): once per request, when it arrives, before it is queued, on the
        compiler's own thread (a compile takes 1-50 ms, a pathological one seconds)."""
        async with self._constraints_built:
            if self._constraints is None:  # built on first use (0.3-0.6 s): most engines never constrain
                self._constraints = await asyncio.to_thread(
                    ConstraintCompiler, self.loaded.tokenizer, self.loaded.config.vocab_size,
                    self._loop_thread.end_token_ids)
        return await self._constraints.compile_async(response_format, request_id)

    def submit(self, request: Request, trace: dict[str, str] | None = None,
               constraint: Constraint | None = None) -> Handle:
        """Queue a request. Raises EngineUnavailable (after a fatal error), EngineDraining or QueueFull.
        `trace`: the log ids of its span; `constraint`: its compiled response_format."""
        if self._fatal_message is not None:
            raise EngineUnavailable(self._fatal_message)
        if self.draining:
            raise EngineDraining.build(self._grace)
        scheduler = self._scheduler
        stream = TokenStream(interval=self.config.stream_interval)
        text = OutputText(self.loaded.tokenizer.stream_decoder(), request.stop)
        handle = Handle(Sequence(request, sink=None, trace=trace or {}, text=text, constraint=constraint), stream)
        handle.seq.sink = handle.stream
        scheduler.submit(handle.seq)
        self._live.add(handle)
        self._idle.clear()
        return handle

    def release(self, handle: Handle) -> None:
        """The servicer is done with this request (finished, failed or cancelled by the caller).
        A sequence still held by the loop is cancelled and frees its row within one step."""
        if handle in self._live:
            self._live.discard(handle)
            if not handle.stream._done:
                handle.seq.cancelled = True
                self._scheduler.wake()
        if not self._live:
            self._idle.set()

    def load(self) -> LoadSnapshot:
        return self._scheduler.load

    def waiting(self) -> int:
        return self._scheduler.waiting_count()

    # -- from the decode loop thread -------------------------------------------------------
    def _deliver_threadsafe(self, emissions: list[Emission]) -> None:
        if emissions:
            self._event_loop.call_soon_threadsafe(self._deliver, emissions)

    @staticmethod
    def _deliver(emissions: list[Emission]) -> None:
        for emission in emissions:
            emission.seq.sink.push(emission)  # type: ignore[attr-defined]

    def _fatal_threadsafe(self, exc: BaseException) -> None:
        self._event_loop.call_soon_threadsafe(self._fatal, exc)

    def _fatal(self, exc: BaseException) -> None:
        # New calls get the same UNAVAILABLE as the streams in flight, never ENGINE_DRAINING: this
        # is no drain, and the process exits within seconds.
        self._fatal_message = f"engine stopped on a fatal error ({type(exc).__name__}); retry after restart"
        self.end_all(EngineUnavailable(self._fatal_message))
        for callback in self._fatal_callbacks:
            callback(exc)
