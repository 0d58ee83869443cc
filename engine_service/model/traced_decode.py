"""The decode step as TorchScript traces (`--trace-decode`, on by default): the same operators in the
same order, run by TorchScript's interpreter instead of Python.

A decode step of SmolLM2 is over a thousand small operator calls, and at one stream with quantized
weights Python's dispatch of them is most of the step (eager 26.8 ms, traced 18.3 ms with int4, in
one run). A trace records the operators once and keeps shapes symbolic, so one trace serves every
batch size and attended length; what it freezes is Python's own control flow. The only such branch
in a step is each projection's choice between its quantized copy and its weights by row count
(`Packed.forward`), and an AMX copy's between its two kernels (`quantize.row_limits`), so there is
one trace per regime of those choices, all made at start-up.
tests/test_traced_decode.py holds traced steps to the eager step's logits bit for bit.
"""

from __future__ import annotations

import time
import warnings

import structlog
import torch

from engine_service.model.kv_cache import KVCache, PromptChunk, chunk_mask, decode_mask, rows_mask
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.quantize import row_limits

log = structlog.get_logger()

MIXED_MIN_ROWS = 17  # TracedMixed: the smallest regime it traces (one row beside a 16-token chunk)


class _Step(torch.nn.Module):
    """The model's `decode_step`, `verify_step` or `mixed_step` (`method`) over `cache`, as a module
    to trace. The weights laid out for oneDNN (llama.Packed.onednn) are registered here as its
    buffers: the tracer reads a tensor that is an attribute of the traced module as that attribute,
    and TorchScript has no constant of their opaque layout."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, method: str = "decode_step") -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.method = method
        for i, packed in enumerate(model.projections()):
            if packed.onednn is not None:
                self.register_buffer(f"onednn_{i}", packed.onednn, persistent=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(*inputs, self.cache)


class TracedDecode:
    """`model.decode` through traces, one per quantization regime up to `max_batch` rows."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, max_batch: int) -> None:
        limits = sorted({limit for p in model.projections() if p.quantized is not None for limit in row_limits(p.quantized)})
        self._limits = [r for r in limits if r < max_batch]
        self._traces: dict[tuple[bool, ...], torch.jit.ScriptModule] = {}
        step = _Step(model, cache)
        started = time.monotonic()
        # one example per regime: the largest batch each regime serves, so no size is traced as 1
        for rows in [*self._limits, max_batch]:
            self._traces[self._regime(rows)] = self._trace(step, rows, cache)
        self.regimes = len(self._traces)
        log.info("decode_traced", traces=self.regimes, seconds=round(time.monotonic() - started, 2))

    def _regime(self, rows: int) -> tuple[bool, ...]:
        return tuple(rows <= limit for limit in self._limits)

    @staticmethod
    def _trace(step: _Step, rows: int, cache: KVCache) -> torch.jit.ScriptModule:
        device = cache.k.device
        length = min(3, cache.max_context)  # attended length 3 (not 1, which a trace could take as fixed)
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        positions = torch.arange(rows, dtype=torch.long, device=device) % length  # mixed lengths
        return _trace(step, (tokens, positions, decode_mask(positions)), cache)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As `LlamaForCausalLM.decode` on the cache given at construction."""
        return self._traces[self._regime(tokens.shape[0])](tokens, positions, decode_mask(positions))


class TracedVerify:
    """Speculative verify steps of one row as traces (`LlamaForCausalLM.verify_step`): one per
    number of tokens fed, the powers of two below `most` and `most` itself (1 + the draft's
    length); a step's last token and draft are padded to the next. The eager step that verifies
    otherwise runs a chunk's Python (SmolLM2, int4 copies, 1 row of 7 tokens, Xeon 207 with AMX:
    20.3 ms eager against a 4.8-ms compiled and a 7.0-ms traced one-row step), which took most of
    what speculation gains at one stream. Each trace is made in its own regime of rows."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, most: int) -> None:
        started = time.monotonic()
        self.sizes = verify_sizes(most)
        self._traces = {n: self._trace(model, cache, n) for n in self.sizes}
        log.info("verify_traced", sizes=self.sizes, seconds=round(time.monotonic() - started, 2))

    @staticmethod
    def _trace(model: LlamaForCausalLM, cache: KVCache, n: int) -> torch.jit.ScriptModule:
        fed = torch.zeros(1, n, dtype=torch.long, device=cache.k.device)
        positions = torch.arange(1, n + 1, device=cache.k.device)[None, :]  # attends n + 1: not a fixed 1
        return _trace(_Step(model, cache, "verify_step"), (fed, positions, rows_mask(positions)), cache)

    def size(self, tokens: int) -> int | None:
        """The tokens a verify of `tokens` is padded to, None past the largest."""
        return next((n for n in self.sizes if n >= tokens), None)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(n, V): the logits of row 0 fed `tokens` at `positions`, both (1, n), n one of `sizes`."""
        return self._traces[tokens.shape[1]](tokens, positions, rows_mask(positions))


class TracedMixed:
    """Mixed steps through traces (`LlamaForCausalLM.mixed_step`): rows 0..b-1 decoding beside one
    prompt chunk in row b, the layout the loop gives a long prompt prefilling beside running streams.
    One trace per regime of the layers' paths at b + C rows (as TracedDecode's, `row_limits`) with
    the LM head's at up to b + 1; a step in a regime with no trace returns None (the eager step
    serves). The eager step runs the chunk's Python: traced / eager 0.70-0.89x (SmolLM2, 8 rows
    beside 16-128 tokens at 0-1,900, Xeon 207 with AMX, docs/decode-speed.md)."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache) -> None:
        started = time.monotonic()
        head = model.projections()[-1]
        self._layer_limits = sorted({limit for p in model.projections()[:-1] if p.quantized is not None
                                     for limit in row_limits(p.quantized)})
        self._head_limits = sorted(set(row_limits(head.quantized)) if head.quantized is not None else ())
        step = _Step(model, cache, "mixed_step")
        self._traces: dict[tuple[bool, ...], torch.jit.ScriptModule] = {}
        # one example per regime: 2 decoding rows beside a chunk that fills the regime's rows (past
        # the largest limit, 32 more), from position 1 so that no size is traced as 1; a regime too
        # small for a row beside a 16-token chunk (the prefill budget's floor: a prompt's last few
        # tokens) is left to the eager step, which spares its trace's 1.5-2 s at start-up
        for total in [*self._layer_limits, (self._layer_limits[-1] if self._layer_limits else 0) + 32]:
            if total >= MIXED_MIN_ROWS and total - 1 < cache.max_context and cache.max_batch > 2:
                self._traces[self._regime(total, 3)] = self._trace(step, total - 2, cache)
        self.regimes = len(self._traces)
        log.info("mixed_traced", traces=self.regimes, seconds=round(time.monotonic() - started, 2))

    def _regime(self, rows: int, head_rows: int) -> tuple[bool, ...]:
        return (*(rows <= limit for limit in self._layer_limits), *(head_rows <= limit for limit in self._head_limits))

    @staticmethod
    def _trace(step: _Step, tokens: int, cache: KVCache) -> torch.jit.ScriptModule:
        device = cache.k.device
        chunk = PromptChunk(2, 1, tokens)
        return _trace(step, mixed_inputs(torch.zeros(2 + tokens, dtype=torch.long, device=device),
                                         torch.tensor([1, 0], device=device), chunk, completes=True), cache)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, chunk_tokens: torch.Tensor, chunk: PromptChunk,
                 completes: bool) -> torch.Tensor | None:
        """As `LlamaForCausalLM.step(tokens, positions, chunk_tokens, [chunk], logits_of=[0] if
        completes else [])` where chunk.row == len(tokens), or None where no trace serves its regime."""
        b = tokens.shape[0]
        traced = self._traces.get(self._regime(b + chunk.length, b + completes))
        if traced is None:
            return None
        return traced(*mixed_inputs(torch.cat([tokens, chunk_tokens]), positions, chunk, completes))


def mixed_inputs(tokens: torch.Tensor, positions: torch.Tensor, chunk: PromptChunk,
                 completes: bool) -> tuple[torch.Tensor, ...]:
    """`mixed_step`'s inputs but the cache: the b decoding rows' `tokens` then the chunk's, (b + C,);
    the decoding rows' `positions` (b,); the chunk in row b."""
    device, b = tokens.device, positions.shape[0]
    chunk_positions = torch.arange(chunk.start, chunk.start + chunk.length, device=device)
    rows = torch.cat([torch.arange(b, device=device), torch.full((chunk.length,), b, device=device)])
    picked = torch.arange(b + 1, device=device)
    picked[b] = b + chunk.length - 1
    return (tokens, torch.cat([positions, chunk_positions]), rows, decode_mask(positions),
            chunk_mask(chunk, device), picked if completes else picked[:b])


def verify_sizes(most: int) -> list[int]:
    """The token counts TracedVerify traces for verify steps of at most `most` tokens (>= 2): the
    powers of two below it, and it."""
    return sorted({*(2**i for i in range(1, most.bit_length()) if 2**i < most), most})


@torch.inference_mode()
def _trace(step: torch.nn.Module, example: tuple[torch.Tensor, ...], cache: KVCache) -> torch.jit.ScriptModule:
    """`step` traced on `example`, its first runs made (the cache zeroed after them)."""
    with warnings.catch_warnings():
        # the tracer warns about every Python int taken from a shape; shapes stay symbolic here
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # torch.jit.trace is deprecated for torch.compile and torch.export; on this CPU
        # torch.compile of the same step was 8x slower than eager (README), so the trace stays
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(step, example, check_trace=False)
    # TorchScript's profiling executor profiles a graph's first two runs and then optimizes it
    # (350-390 ms each for SmolLM2, against 35 ms a step after): run them here, not in the first
    # requests' steps; later batch sizes and lengths cost nothing extra
    for _ in range(2):
        traced(*example)
    cache.k.zero_()  # the example step wrote into the cache; nothing is running yet
    cache.v.zero_()
    return traced
