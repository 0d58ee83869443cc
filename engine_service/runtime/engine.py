"""The async front of the engine: submit a parsed request, stream its tokens back.

Bridges the event loop and the decode loop thread: the loop thread hands each step's emissions
over with one `call_soon_threadsafe`; each request's TokenStream joins the deltas that arrived
since its reader last looked into one (runtime/delta.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
import torch

from engine_service.config import EngineConfig
from engine_service.generation.constraint import Constraint, ConstraintCompiler
from engine_service.generation.controls import Controls
from engine_service.generation.output_text import OutputText
from engine_service.generation.speculative import SpeculativeConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import Precision, choose_dtype, choose_quantize
from engine_service.model.loader import LoadedModel, load_model
from engine_service.requests import Limits, Request, ResponseFormat
from engine_service.runtime.delta import Delta
from engine_service.runtime.faults import FaultInjector
from engine_service.runtime.loop import DecodeLoop, set_threads
from engine_service.runtime.model_runner import ModelRunner
from engine_service.runtime.speculator import Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget
from engine_service.scheduling.prefix_cache import PrefixCache
from engine_service.scheduling.scheduler import LoadSnapshot, Scheduler
from engine_service.scheduling.sequence import Sequence
from shared.errors import EngineDraining, EngineError, EngineUnavailable, SequenceError

log = structlog.get_logger()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded: LoadedModel | None = None
        self.info: EngineInfo | None = None
        self.limits: Limits | None = None
        self._constraints: ConstraintCompiler | None = None
        self._constraints_built = asyncio.Lock()
        self.ready = asyncio.Event()
        self.draining = False
        self._grace = 0.0
        self._fatal_message: str | None = None  # set once the decode loop has died: the engine is going down
        self._live: set[Handle] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._fatal_callbacks: list[Callable[[BaseException], None]] = []
        self._scheduler: Scheduler | None = None
        self._loop_thread: DecodeLoop | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stall_watch: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model off the event loop, then start the decode loop thread."""
        self._event_loop = asyncio.get_running_loop()
        cfg = self.config
        set_threads(cfg.threads)
        cpu = detect()
        dtype_name, dtype_reason = choose_dtype(cfg.dtype, cfg.device, cpu)
        device, dtype = torch.device(cfg.device), DTYPES[dtype_name]
        # Loaded in a thread that ends afterwards, not in asyncio's executor, whose threads live on.
        # libgomp gives every thread that runs a parallel torch op an OpenMP team of its own, and
        # while it manages more threads than there are cores it all but stops spin-waiting: the
        # decode loop's OpenMP workers then sleep between the hundreds of small parallel ops of a
        # step and are woken for each. Measured on SmolLM2 in bfloat16, batch 1, 2 cores: 1.4 cores
        # busy and 57-67 ms a step with a second team alive, 2.0 cores and 44-54 ms without.
        # So the decode loop's thread must be the only thread that runs torch for long.
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        try:
            loaded = await self._event_loop.run_in_executor(loader, load_model, cfg.model, device, dtype)
            quantize, quantize_reason = choose_quantize(cfg.quantize, cfg.device, loaded.weight_format)
            precision = Precision(dtype_name, quantize, f"{dtype_reason}; {quantize_reason}")
            runner = await self._event_loop.run_in_executor(
                loader, ModelRunner, loaded.model, cfg.max_batch, cfg.max_context, device, dtype, quantize,
                cfg.trace_decode)
        finally:
            loader.shutdown(wait=False)  # its thread, and with it its OpenMP team, ends once idle
        self.loaded = loaded
        self.limits = Limits(loaded.config.vocab_size, cfg.max_context, cfg.max_new_tokens_limit)
        self.info = EngineInfo(
            model=loaded.name, max_context_tokens=cfg.max_context, max_new_tokens_limit=cfg.max_new_tokens_limit,
            max_batch_size=cfg.max_batch, queue_capacity=cfg.queue_capacity, vocab_size=loaded.config.vocab_size,
            eos_token_id=loaded.config.eos_token_id if loaded.config.eos_token_id is not None
            else loaded.tokenizer.eos_token_id, bos_token_id=loaded.tokenizer.bos_token_id,
            device=str(device), dtype=precision.dtype, tokenizer=loaded.tokenizer.kind,
            has_chat_template=loaded.chat_template is not None, quantization=precision.quantize,
            cpu_capability=cpu.describe() if device.type == "cpu" else str(device), precision_reason=precision.reason,
        )
        budget = PrefillBudget(cfg.max_prefill_tokens, cfg.max_context)
        self._scheduler = Scheduler(cfg.max_batch, cfg.max_context, cfg.queue_capacity, cfg.queue_retry_seconds,
                                    prefill_token_budget=budget.tokens(1))
        self._loop_thread = DecodeLoop(runner, self._scheduler, FaultInjector(cfg.faults),
                                       _end_tokens(loaded), self._deliver_threadsafe, self._fatal_threadsafe,
                                       PrefixCache(cfg.prefix_cache_tokens), budget,
                                       Speculator(SpeculativeConfig(num_tokens=cfg.speculative_tokens))
                                       if cfg.speculative == "ngram" else None)
        self._loop_thread.start()
        self._stall_watch = asyncio.create_task(self._watch_stalls(cfg.stall_seconds))
        self.ready.set()
        log.info("engine_ready", model=loaded.name, device=str(device), dtype=precision.dtype,
                 quantize=precision.quantize, precision_reason=precision.reason, cpu=cpu.describe(),
                 weight_format=loaded.weight_format, trace_decode=cfg.trace_decode, speculative=cfg.speculative,
                 kv_cache_bytes=runner.cache.bytes_per_token() * cfg.max_batch * cfg.max_context,
                 max_prefill_tokens=cfg.max_prefill_tokens or "auto", prefix_cache_tokens=cfg.prefix_cache_tokens,
                 prefix_cache_bytes=runner.cache.bytes_per_token() * cfg.prefix_cache_tokens,
                 tokenizer=loaded.tokenizer.kind)

    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
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
        if self._scheduler is not None:
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
                    self._started_scheduler().wake()

    def stop(self) -> None:
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        if self._loop_thread is not None:
            self._loop_thread.stop()

    def _started_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("the engine's scheduler was used before Engine.start() finished")
        return self._scheduler

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        if self._event_loop is None:
            raise RuntimeError("the engine's event loop was used before Engine.start()")
        return self._event_loop

    # -- requests --------------------------------------------------------------------------
    async def compile(self, response_format: ResponseFormat, request_id: str) -> Constraint:
        """A request's response_format compiled for this model's tokenizer (InvalidField when the
        compiler refuses it): once per request, when it arrives, before it is queued, on the
        compiler's own thread (a compile takes 1-50 ms, a pathological one seconds)."""
        async with self._constraints_built:
            if self._constraints is None:  # built on first use (0.3-0.6 s): most engines never constrain
                if self.loaded is None:
                    raise RuntimeError("the engine's constraint compiler was used before Engine.start() finished")
                loaded = self.loaded
                self._constraints = await asyncio.to_thread(
                    ConstraintCompiler, loaded.tokenizer, loaded.config.vocab_size, _end_tokens(loaded))
        return await self._constraints.compile_async(response_format, request_id)

    def submit(self, request: Request, trace: dict[str, str] | None = None,
               constraint: Constraint | None = None) -> Handle:
        """Queue a request. Raises EngineUnavailable (after a fatal error), EngineDraining or QueueFull.
        `trace`: the log ids of its span; `constraint`: its compiled response_format."""
        if self._fatal_message is not None:
            raise EngineUnavailable(self._fatal_message)
        if self.draining:
            raise EngineDraining.build(self._grace)
        scheduler = self._started_scheduler()
        text = OutputText(self.loaded.tokenizer.stream_decoder(), request.stop) if self.loaded is not None else None
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
                self._started_scheduler().wake()
        if not self._live:
            self._idle.set()

    def load(self) -> LoadSnapshot:
        return self._scheduler.load if self._scheduler is not None else LoadSnapshot()

    def waiting(self) -> int:
        return self._scheduler.waiting_count() if self._scheduler is not None else 0

    # -- from the decode loop thread -------------------------------------------------------
    def _deliver_threadsafe(self, deltas: list[Delta]) -> None:
        if deltas:
            self._started_loop().call_soon_threadsafe(self._deliver, deltas)

    @staticmethod
    def _deliver(deltas: list[Delta]) -> None:
        for delta in deltas:
            delta.seq.sink.push(delta)  # type: ignore[attr-defined]

    def _fatal_threadsafe(self, exc: BaseException) -> None:
        self._started_loop().call_soon_threadsafe(self._fatal, exc)

    def _fatal(self, exc: BaseException) -> None:
        # New calls get the same UNAVAILABLE as the streams in flight, never ENGINE_DRAINING: this
        # is no drain, and the process exits within seconds.
        self._fatal_message = f"engine stopped on a fatal error ({type(exc).__name__}); retry after restart"
        self.end_all(EngineUnavailable(self._fatal_message))
        for callback in self._fatal_callbacks:
            callback(exc)


def _end_tokens(loaded: LoadedModel) -> frozenset[int]:
    """EOS ids that end generation: the model's own (all of them), else the tokenizer's."""
    ids = set(loaded.config.end_token_ids)
    if not ids and loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)
