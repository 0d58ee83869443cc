"""The start-up race between one of the engine's int4 kernels (q4_matmul.py) and torch's, on this
machine, on the served model's largest layer shape: `--int4-kernel auto` keeps the engine's kernel
only where it wins (machine/precision.py's `keep_q4_kernel` decides from the times).

Why a race and not the CPU's flags alone: the flags say where a kernel can run, not where it is
faster, and torch's int4 kernel differs by class by more than the flags tell. Its 120 calls of a
SmolLM2 one-row step took 26 us each on an AMD EPYC of family 26 model 2, 38 us on an Intel Xeon
of family 6 model 207 and 86 us on one of model 167 (README, "One stream"); the int16 kernel took
25.7 us on the model 207 (torch profiler, compiled step, 2 threads). A kernel tuned on one class
would be the slower choice on the next.

What is timed: the model's gate/up (2 x intermediate by hidden, random weights), the largest call of
a step, at one row and at the copies' largest row count, calls from the cache (the per-call cost the
race is about; a step's weights come from memory at about the same rate for both, the same bytes
give or take the scales), alternating, ROUNDS rounds after two warm-up ones, the median of each
(`keep_q4_kernel` keeps the engine's kernel where the geometric mean of its two ratios to torch's is
below 1). 35-75 ms on 2 cores. On a Xeon of family 6 model
207 (AMX, 2 threads), us a call at one row / the copies' rows: the int16 kernel 42-45 / 124-125 at 8
against torch's 77-79 / 265-276, kept; the float32 kernel (a float32 model's, `--dtype float32`)
135-148 / 1,123-1,269 at 24 against torch's native bfloat16 94-100 / 778-850, not kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine_service.model.config import ModelConfig
from engine_service.model.q4_matmul import TILE
from engine_service.model.quantize import (
    ACTIVATION_BITS,
    INT4_KERNEL_MAX_ROWS,
    MAX_ROWS,
    kernel_dtype,
    quantize_int4,
    quantize_q4,
    quantize_q4_int16,
)

ROUNDS = 15


@dataclass(frozen=True)
class Race:
    kernel: str  # the engine's kernel raced: float32, int16 or int8 (quantize.INT4_KERNELS)
    rows: int  # the larger row count timed: the copies' max_rows
    ours_us: tuple[float, float]  # its median microseconds a call at one row and at `rows`
    torch_us: tuple[float, float]  # torch's int4 kernel's, the same calls


def race(kernel: str, config: ModelConfig, dtype: torch.dtype) -> Race:
    """Time the engine's `kernel` (its library loaded: q4_matmul.load) against torch's int4 kernel
    on `config`'s gate/up shape, with activations in `dtype` (the model's)."""
    generator = torch.Generator().manual_seed(0)
    outputs = max(TILE, 2 * config.intermediate_size // TILE * TILE)  # whole tiles of the int16 kernel's
    weight = torch.randn(outputs, config.hidden_size, generator=generator).to(dtype) * 0.02
    rows = INT4_KERNEL_MAX_ROWS[kernel]
    ours = (quantize_q4(weight, rows) if kernel == "float32"
            else quantize_q4_int16(weight, rows, activation_bits=ACTIVATION_BITS[kernel]))
    copies = {"ours": ours,
              "torch": quantize_int4(weight, max(rows, MAX_ROWS["int4"]), kernel_dtype(dtype))}
    xs = [torch.randn(n, config.hidden_size, generator=generator).to(dtype) for n in (1, rows)]
    times: dict[tuple[str, int], list[float]] = {(name, i): [] for name in copies for i in range(len(xs))}
    with torch.inference_mode():
        for round_ in range(ROUNDS + 2):  # two warm-up rounds
            for name, copy in copies.items():
                for i, x in enumerate(xs):
                    started = time.perf_counter()
                    copy.matmul(x)
                    if round_ >= 2:
                        times[name, i].append(time.perf_counter() - started)
    us = {key: statistics.median(t) * 1e6 for key, t in times.items()}
    return Race(kernel, rows, (us["ours", 0], us["ours", 1]), (us["torch", 0], us["torch", 1]))
