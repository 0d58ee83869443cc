"""A bfloat16 model's RMSNorms in the engine's own operator (`rms_norm.cpp`), on a CPU
(machine/precision.choose_rms_norm decides where): each of a step's 61 norms one call instead of the
seven of torch's operators that compute Hugging Face's arithmetic (llama.RMSNorm). The compiled
one-row step keeps the composite, which AOTInductor fuses with its neighbours; the traces (decode
steps of several rows, mixed and verify steps) and the eager calls (prompts, sliced prefill) take
the operator. A float32 model keeps the composite: its decoding stays bit-identical to transformers'.

What it saves, SmolLM2 (576 values a row), 2 threads, AMD EPYC of the Zen 4 class, us a norm,
the operator / the composite: 1 row 4.3 / 24.1, 8 rows 6.4 / 31.2, 2,000 rows 334 / 3,974
(microbenchmark, one run); whole steps: docs/decode-speed.md, "RMSNorm in one operator".

Built at start-up for AVX2 and FMA (every CPU class the engine meets), like decode attention's
kernel; its first product is checked against the composite (`probe_error`), and a failed build,
load or check leaves the composite to serve (runtime/build.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine_service.model import native_build
from engine_service.model.native_build import Kernel

KERNEL = Kernel("rms_norm", Path(__file__).with_name("rms_norm.cpp"),
                ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma"), "engine_norm::rms_norm")
# the start-up product's largest error relative to its largest value (`probe_error`): a row's scale
# may differ from the composite's in its last float32 bit, so a value may round to the next bfloat16
# (2^-8 relative to itself); a kernel that computes wrongly is far off
PROBE_TOLERANCE = 0.01

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def load(compiler: str, cache: Path) -> RmsNorm:
    """The operator, its library built if `cache` lacks it and loaded. Raises RuntimeError (the
    compiler's failure, or torch's refusal to load) or OSError (the cache directory's)."""
    native_build.load(compiler, cache, KERNEL, _shape)
    return native_build.operator(KERNEL)


def composite(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm in torch's operators: normalised in float32, scaled in x's dtype."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def probe_error(op: RmsNorm) -> float:
    """Run `op` once on random bfloat16 rows (5 rows of 100 values: a partial last vector) and return
    its largest error relative to the largest value of the composite on the same values: a kernel
    that runs but computes wrongly fails at start-up, not in a step."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 100, generator=generator) * 3).to(torch.bfloat16)
    weight = (torch.rand(100, generator=generator) + 0.5).to(torch.bfloat16)
    ref = composite(x, weight, 1e-5).float()
    return float((op(x, weight, 1e-5).float() - ref).abs().max() / ref.abs().max())
