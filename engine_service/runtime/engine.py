"""The async front of the engine: submit a parsed request, stream its tokens back.

Bridges the event loop and the decode loop thread: the loop thread hands each step's deltas
over with one `call_soon_threadsafe`; each request's TokenStream joins the deltas that arrived
since its reader last looked into one (runtime/delta.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from engine_service.config import EngineConfig
from engine_service.generation.constraint import Constraint, ConstraintCompiler
from engine_service.generation.controls import Controls
from engine_service.generation.output_text import OutputText
from engine_service.model.loader import LoadedModel
from engine_service.requests import Limits, Request, ResponseFormat
from engine_service.runtime.delta import Delta
from engine_service.runtime.loop import DecodeLoop, Deliver
from engine_service.scheduling.scheduler import LoadSnapshot
from engine_service.scheduling.sequence import Sequence
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


@dataclass(eq=False)
class TokenStream:
    """One request's deltas on the event loop side: those its reader has not taken yet, joined
    into one when it looks (`next`)."""

    seq: Sequence | None = None  # the sequence whose deltas these are (set when submitted)
    _pending: list[Delta] = field(default_factory=list)
    _end: Delta | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    interval: int = 1  # wake the reader once this many tokens wait (the first token and the end at once)
    _waiting_tokens: int = 0
    _sent_first: bool = False
    _offered_at: float = 0.0

    @property
    def done(self) -> bool:
        return self._end is not None

    def stalled_since(self, now: float) -> float:
        """Seconds the reader has left offered tokens untaken (0 when none are offered)."""
        return now - self._offered_at if self._ready.is_set() and not self.done else 0.0

    def _offer(self) -> None:
        if not self._ready.is_set():
            self._offered_at = time.monotonic()
            self._ready.set()

    def push(self, delta: Delta) -> None:
        if self.done:  # already ended (stalled reader, drain, fatal): later tokens are moot
            return
        self._pending.append(delta)
        self._waiting_tokens += len(delta.tokens)
        if delta.ends:
            self._end = delta
        if self.done or not self._sent_first or self._waiting_tokens >= self.interval:
            self._offer()

    def fail(self, error: EngineError) -> None:
        if not self.done:
            self._end = Delta(self.seq, (), error=error, at=time.monotonic())  # type: ignore[arg-type]
            self._pending.append(self._end)
            self._offer()

    async def next(self) -> Delta:
        """The deltas since the last call as one: their tokens, text and log-probabilities in order,
        the end (finish or error) when it came."""
        await self._ready.wait()
        self._ready.clear()
        pending, self._pending, self._waiting_tokens = self._pending, [], 0
        end = self._end if self.done else None
        joined = Delta(self.seq,  # type: ignore[arg-type]
                       tuple(t for d in pending for t in d.tokens),
                       finish=end.finish if end is not None else None, error=end.error if end is not None else None,
                       at=pending[-1].at if pending else time.monotonic(), text="".join(d.text for d in pending),
                       logprobs=tuple(lp for d in pending for lp in d.logprobs),
                       prompt_logprobs=tuple(lp for d in pending for lp in d.prompt_logprobs))
        self._sent_first = self._sent_first or bool(joined.tokens)
        return joined


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
    the loop thread hands its deltas to), and `stop()` ends them."""

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
        text = OutputText(self.loaded.tokenizer.stream_decoder(), request.stop)
        stream = TokenStream(interval=self.config.stream_interval)
        seq = Sequence(request, sink=stream, trace=trace or {}, controls=Controls(request, text, constraint))
        stream.seq = seq
        handle = Handle(seq, stream)
        scheduler.submit(handle.seq)
        self._live.add(handle)
        self._idle.clear()
        return handle

    def release(self, handle: Handle) -> None:
        """The servicer is done with this request (finished, failed or cancelled by the caller).
        A sequence still held by the loop is cancelled and frees its row within one step."""
        if handle in self._live:
            self._live.discard(handle)
            if not handle.stream.done:
                handle.seq.cancelled = True
                self._scheduler.wake()
        if not self._live:
            self._idle.set()

    def load(self) -> LoadSnapshot:
        return self._scheduler.load

    def waiting(self) -> int:
        return self._scheduler.waiting_count()

    # -- from the decode loop thread -------------------------------------------------------
    def _deliver_threadsafe(self, deltas: list[Delta]) -> None:
        if deltas:
            self._event_loop.call_soon_threadsafe(self._deliver, deltas)

    @staticmethod
    def _deliver(deltas: list[Delta]) -> None:
        for delta in deltas:
            delta.seq.sink.push(delta)  # type: ignore[attr-defined]

    def _fatal_threadsafe(self, exc: BaseException) -> None:
        self._event_loop.call_soon_threadsafe(self._fatal, exc)

    def _fatal(self, exc: BaseException) -> None:
        # New calls get the same UNAVAILABLE as the streams in flight, never ENGINE_DRAINING: this
        # is no drain, and the process exits within seconds.
        self._fatal_message = f"engine stopped on a fatal error ({type(exc).__name__}); retry after restart"
        self.end_all(EngineUnavailable(self._fatal_message))
        for callback in self._fatal_callbacks:
            callback(exc)
