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

from engine_service.model.kv_cache import KVCache, decode_mask, rows_mask
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.quantize import row_limits

log = structlog.get_logger()


class _Step(torch.nn.Module):
    """The model's `decode_step` or `verify_step` (`method`) over `cache`, as a module to trace."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, method: str = "decode_step") -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.method = method

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(tokens, positions, mask, self.cache)


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
