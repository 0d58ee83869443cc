"""Structured output: a request's `response_format` (a JSON schema, a regex or a Lark grammar)
compiled once at admission into an llguidance matcher, and the per-step token masks it puts on the
logits.

- `ConstraintCompiler(tokenizer, vocab_size, eos_token_ids)`: built once per engine (about 0.3 s
  for a 49k vocabulary: llguidance indexes the tokens). `compile(fmt, request_id=...)` builds the
  grammar and its matcher and computes the first mask, so that everything llguidance can refuse
  (bad JSON, a schema keyword it does not implement, an invalid regex or Lark grammar, an
  unsatisfiable one, one past its lexer limits) is an InvalidField at admission, never a failure
  mid-decode. The work runs on one dedicated thread with a large stack (see `_CompileThread`); the
  caller waits for it (`compile_async` awaits it instead, for an event loop).
- `Constraint`: one request's matcher. `consume(tokens)` advances it by the tokens the engine
  emitted; `done` is true once the grammar is complete (no token can extend it) or EOS was
  consumed: generation must then end with finish STOP (the grammar's last token is kept, no EOS is
  emitted for it).
- `apply_masks(logits, rows, constraints)`: sets every token the grammar forbids to -inf, in place,
  on the listed rows; the other rows are not touched.

EOS: the mask allows the EOS ids exactly when the grammar is accepting (and allows nothing else once
the matcher is stopped), so a sequence can only end where its output is complete. Ids past the
tokenizer's own vocabulary (a model's padding ids) are always masked.

JSON schemas compile with compact separators (", " and ": ", no other whitespace between tokens):
flexible whitespace lets a model emit newlines and spaces without end. A schema may ask otherwise in
llguidance's own key, e.g. `"x-guidance": {"whitespace_flexible": true}`. Keywords llguidance does
not implement (uniqueItems, not, if/then/else, ...) are refused, not ignored.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar, get_args

import llguidance
import numpy as np
import structlog
import torch
from llguidance._util import StopReason

from engine_service.model.byte_tokenizer import ByteTokenizer
from engine_service.model.hf_tokenizer import HFTokenizer
from engine_service.requests import ResponseFormat
from shared.errors import InvalidField, SequenceError

log = structlog.get_logger()

MAX_SOURCE_BYTES = 65_536
MESSAGE_CHARS = 300  # of the compiler's message, in the InvalidField's
# llguidance's grammar format for each ResponseFormat kind
GRAMMAR_FORMATS: dict[str, llguidance.GrammarFormat] = {
    "json_schema": "json_schema", "regex": "regex", "lark_grammar": "lark",
}
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Errors without the parser's state or the grammar in them (they would echo the request at length).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
STOP_REASONS = frozenset(get_args(StopReason))
# The compile thread's stack. llguidance's grammar compiler recurses once per level of a chain of
# rules (a Lark `a: b`, `b: c`, ... or a JSON schema's chain of $refs), some 3 KB a level: a 64 KiB
# source of such a chain needs 16..32 MiB and overflows an 8 MiB stack, killing the process
# (SIGSEGV) instead of raising. Only the pages touched are ever committed.
COMPILE_STACK_BYTES = 256 << 20

T = TypeVar("T")


class _CompileThread:
    """One daemon thread with a COMPILE_STACK_BYTES stack that runs the compilations, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.pid = os.getpid()
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:  # the size applies to threads started from now on: this one alone, then restored
            self._thread = threading.Thread(target=self._run, name="constraint-compiler", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - not a catch: handed to the caller, who re-raises it
                future.set_exception(err)


_compile_thread: _CompileThread | None = None
_compile_thread_lock = threading.Lock()


def _compile_worker() -> _CompileThread:
    """The process's compile thread, started on first use (again in a forked child, which has none)."""
    global _compile_thread
    with _compile_thread_lock:
        if _compile_thread is None or _compile_thread.pid != os.getpid():
            _compile_thread = _CompileThread()
        return _compile_thread


class _ByteVocabulary:
    """ByteTokenizer as llguidance.TokenizerWrapper reads a tokenizer: each id's bytes (a Lark
    grammar names the special ones `<bos>` and `<eos>`), the special ids, and an encoder."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"]
        self.special_token_ids = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None]

    def __call__(self, text: bytes) -> list[int]:
        """The bytes' ids. TokenizerWrapper tries an encoder on bytes first and, since this one
        takes them, passes it the UTF-8 bytes of every string from then on."""
        return list(text)


def _clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    """One line of at most `limit` characters: whitespace runs collapsed, llguidance's marker dropped."""
    text = " ".join(text.replace("<non-verbose/>", " ").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse_nan(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "false", type(None): "null"}
    return names.get(type(value), "a number")


class Constraint:
    """One request's matcher state: advanced by `consume`, read by `apply_masks`. Not thread-safe:
    the engine's loop thread alone uses it after `compile` returns it."""

    def __init__(self, compiler: ConstraintCompiler, matcher: llguidance.LLMatcher, fmt: ResponseFormat,
                 request_id: str) -> None:
        self.compiler = compiler
        self.matcher = matcher
        self.format = fmt
        self.request_id = request_id
        self.consumed = 0  # tokens consumed so far

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance by the tokens the engine emitted (one, or a verified draft's several). A token the
        matcher refuses can only be an engine bug, since the mask allowed only tokens it accepts (or
        a grammar that hit llguidance's per-step limits mid-decode, after which the mask allowed EOS
        alone): the matcher is then broken, so it raises SequenceError, which aborts this sequence
        alone, naming the token and the matcher's message."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise SequenceError.build(
                    self.request_id or "(request id not given to compile)", self.consumed,
                    f"{self.format.field} constraint refused token {token}: {_clip(self.matcher.get_error())}",
                )
            self.consumed += 1

    @property
    def done(self) -> bool:
        """The matcher is stopped: the grammar is complete and nothing can extend it, or EOS was
        consumed. Generation must end with finish STOP; any token after it but EOS is refused.
        A matcher in error (llguidance's per-step limits hit mid-decode) is never done: the
        `consume` after it raises instead, so an incomplete output never ends as STOP."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        """The output so far is complete (it may still be extended): EOS is allowed now."""
        return self.matcher.is_accepting()


class ConstraintCompiler:
    """The engine's tokenizer indexed by llguidance, once; compiles each request's response format.

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's: the extra ids
    are never allowed. `eos_token_ids` are the ids that end a sequence; the grammar allows them
    where its output is complete (empty: the tokenizer's own EOS)."""

    def __init__(self, tokenizer: HFTokenizer | ByteTokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        eos = sorted(eos_token_ids) or None
        if isinstance(tokenizer, HFTokenizer):
            source: str | llguidance.TokenizerWrapper = tokenizer._tokenizer.to_str()
            own = tokenizer._tokenizer.get_vocab_size(with_added_tokens=True)
        elif isinstance(tokenizer, ByteTokenizer):
            source = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
            own = tokenizer.vocab_size
        else:
            raise TypeError(f"structured output needs an HFTokenizer or the ByteTokenizer, got {type(tokenizer).__name__}")
        if vocab_size < own:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {own} tokens")
        if eos is not None and not all(0 <= i < vocab_size for i in eos):
            raise ValueError(f"eos_token_ids must be < vocab_size {vocab_size}, got {eos}")
        self.ll_tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(self.ll_tokenizer.eos_tokens)
        self._executor = llguidance.LLExecutor()
        self._words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._bitmask = self._allocate(8)

    def compile(self, fmt: ResponseFormat, request_id: str = "") -> Constraint:
        """The request's constraint, its first mask computed; InvalidField(fmt.field, ...) when the
        source is empty, longer than MAX_SOURCE_BYTES, or refused by llguidance. Blocks for the
        compilation (typically 1..50 ms; a pathological source, up to seconds); `compile_async`
        awaits it instead."""
        return _compile_worker().submit(lambda: self._compile(fmt, request_id)).result()

    async def compile_async(self, fmt: ResponseFormat, request_id: str = "") -> Constraint:
        """`compile`, awaited: the event loop runs on while the compile thread works."""
        return await asyncio.wrap_future(_compile_worker().submit(lambda: self._compile(fmt, request_id)))

    def _compile(self, fmt: ResponseFormat, request_id: str) -> Constraint:
        field, source = fmt.field, fmt.source
        grammar_format = GRAMMAR_FORMATS.get(fmt.kind)
        if grammar_format is None:
            raise InvalidField("response_format", fmt.kind,
                               f"response_format must be one of {', '.join(GRAMMAR_FORMATS)}, got {fmt.kind!r}")
        if not source:
            raise InvalidField(field, source, f"{field} must not be empty, got ''")
        size = len(source.encode("utf-8"))
        if size > MAX_SOURCE_BYTES:
            raise InvalidField(field, f"{size} bytes",
                               f"{field} must be at most {MAX_SOURCE_BYTES} bytes (UTF-8), got {size} bytes")

        def refused(message: str) -> InvalidField:
            return InvalidField(field, source, f"{field} was refused by the grammar compiler: {_clip(message)}")

        try:
            if fmt.kind == "json_schema":
                try:  # for the error's position: llguidance reports it within its own wrapping
                    schema = json.loads(source, parse_constant=_refuse_nan)
                except (ValueError, RecursionError) as err:
                    raise refused(f"invalid JSON: {err}") from None
                if schema is True:  # any JSON value; llguidance's options apply to an object alone
                    source = "{}"
                elif not isinstance(schema, dict):
                    raise refused(f"a JSON schema must be an object (or true), got {_json_type(schema)}")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)
            else:
                grammar = llguidance.grammar_from(grammar_format, source)
        except ValueError as err:
            raise refused(str(err)) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=LIMITS)
        if not matcher.is_error():
            self._probe(matcher)
        if matcher.is_error():
            message = _clip(matcher.get_error())
            if message in STOP_REASONS:  # stopped before any output, with a reason for a message
                message = f"the grammar allows no output ({message})"
            raise refused(message)
        warnings = matcher.get_grammar_warnings()
        if warnings:
            log.info("grammar_warnings", request_id=request_id, field=field, warnings=[_clip(w) for w in warnings])
        return Constraint(self, matcher, fmt, request_id)

    def _probe(self, matcher: llguidance.LLMatcher) -> None:
        """Errors that llguidance finds only at the first step, found now, into `matcher`: the
        first mask (an unsatisfiable grammar errs here; the mask is kept for the first step), then
        one token it allows consumed by a copy (a regex past the lexer's limits, such as
        `((a{100}){100}){100}`, errs only there)."""
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[: self.vocab_size])
        token = next((int(t) for t in allowed if int(t) not in self.eos_token_ids), None)
        if token is not None and not matcher.is_error():
            probe = matcher.deep_copy()
            if not probe.consume_token(token):
                matcher.consume_token(token)  # the same error, now the matcher's own

    def _allocate(self, rows: int) -> torch.Tensor:
        """Uninitialised: llguidance writes every row `apply_masks` reads (whatever the matcher's
        state: fresh, stopped or in error) before it reads it."""
        pin = torch.cuda.is_available()  # a pinned buffer copies to the GPU faster
        try:
            return torch.empty((rows, self._words), dtype=torch.int32, pin_memory=pin)
        except RuntimeError:  # pinning failed (CUDA present but unusable): a plain buffer
            return torch.empty((rows, self._words), dtype=torch.int32)

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        """The shared bitmask's first `rows` rows (contiguous), grown when needed."""
        if rows > self._bitmask.shape[0]:
            self._bitmask = self._allocate(max(rows, 2 * self._bitmask.shape[0]))
        return self._bitmask[:rows]


def apply_masks(logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[Constraint]) -> torch.Tensor:
    """Set the tokens each constraint forbids to -inf in row `rows[i]` of `logits` (B, V), IN PLACE,
    and return `logits`; rows not listed are untouched. A caller that still needs the raw logits
    (log-probabilities of the unconstrained distribution, say) passes a copy.

    The masks are computed on the CPU into the compiler's one preallocated bitmask (several rows in
    one llguidance call, on its threads), expanded into one boolean row per mask (see `_forbidden`)
    and filled in with `masked_fill_`: no Python loop over the vocabulary. A constraint that is
    already `done` allows EOS alone. Every row keeps at least one allowed token (EOS, at worst),
    unless the caller masks that too (min_new_tokens masking EOS, say). Called from one thread at a
    time per compiler (the engine's loop): the bitmask is shared."""
    if len(rows) != len(constraints):
        raise ValueError(f"rows and constraints must pair up, got {len(rows)} rows and {len(constraints)} constraints")
    if not rows:
        return logits
    compiler = constraints[0].compiler
    if any(c.compiler is not compiler for c in constraints):
        raise ValueError("constraints from different ConstraintCompilers cannot be masked together")
    if logits.dim() != 2 or logits.shape[1] != compiler.vocab_size:
        raise ValueError(f"logits must be (B, {compiler.vocab_size}), got {tuple(logits.shape)}")
    count, first = len(rows), rows[0]
    if len(set(rows)) != count or not all(0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"rows must be distinct rows of the {logits.shape[0]} logits, got {list(rows)}")
    bitmask = compiler._bitmask_rows(count)
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    # llguidance.torch's fill_next_token_bitmask(_par), whose module is not imported: it compiles
    # a kernel with torch.compile at import, which costs seconds (it imports dynamo and inductor)
    if count == 1:
        constraints[0].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
    else:
        compiler._executor.unsafe_compute_mask_ptr(
            [(c.matcher, i) for i, c in enumerate(constraints)], bitmask.data_ptr(), row_bytes, count)
    forbidden = _forbidden(bitmask, compiler.vocab_size, logits.device)
    # On the CPU numpy fills float32 logits on this thread: torch's masked_fill_ splits 8 rows of a
    # 49k vocabulary across its intra-op threads, and on a busy machine waits for a descheduled one
    # (several ms, where the fill itself takes 0.2 ms).
    by_numpy = logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad
    if all(r == first + i for i, r in enumerate(rows)):  # a run of rows: one fill, on a view
        _fill(logits[first: first + count], forbidden, by_numpy)
    else:
        for i, row in enumerate(rows):  # a loop over the rows (a few), never over the vocabulary
            _fill(logits[row], forbidden[i], by_numpy)
    return logits


def _fill(logits: torch.Tensor, forbidden: torch.Tensor, by_numpy: bool) -> None:
    if by_numpy:
        np.copyto(logits.numpy(), -np.inf, where=forbidden.numpy())  # the view's memory: in place
    else:
        logits.masked_fill_(forbidden, -np.inf)


def _forbidden(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(n, vocab_size) bool on `device`, True where llguidance's bitmask (n, W) int32 has a 0 bit:
    bit i of word j is token 32 j + i. On the CPU numpy unpacks the bytes (one pass, no torch
    threads: the little-endian words' byte k holds tokens 32 j + 8 k ...); elsewhere the words
    travel (32 times smaller than the booleans) and the device unpacks them (`_unpack_words`)."""
    if device.type == "cpu":
        inverted = np.invert(bitmask.numpy().astype("<i4", copy=False).view(np.uint8))
        bits = np.unpackbits(inverted, axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    return _unpack_words(bitmask.to(device), vocab_size)


def _unpack_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`_forbidden` in torch ops on the words' own device (any device, the CPU included)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return (((words.unsqueeze(-1) >> shifts) & 1) == 0).view(words.shape[0], -1)[:, :vocab_size]


__all__ = ["MAX_SOURCE_BYTES", "Constraint", "ConstraintCompiler", "apply_masks"]
