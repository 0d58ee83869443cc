"""A decoder layer's small operators in the engine's own C++ (`layer_ops.cpp`), for a bfloat16
model's steps on a CPU (machine/precision.choose_layer_ops decides where): each replaces a run of
torch's operators, each with its own dispatch, of which a traced step of several rows runs hundreds:

- `rms_norm`: a norm in one call instead of the seven that compute Hugging Face's arithmetic
  (llama.RMSNorm); a step has 61;
- `rope`: the rotary embedding of a step's queries and keys in one call instead of four (llama.apply_rope);
- `write_kv`: a step's new keys and values into a layer's cache at their slots (KVCache.write_decode:
  two index_copy_ and the copies that lay the rows out for them).

The compiled one-row step keeps torch's operators, which AOTInductor fuses with their neighbours
(`torch.compiler.is_compiling` under its export); the traces (decode steps of several rows, mixed and
verify steps) and the eager calls (prompts, sliced prefill) take these. A float32 model keeps
torch's: its decoding stays bit-identical to transformers'.

SmolLM2 (576 values a row), 2 threads, AMD EPYC of the Zen 4 class, us a call, the operator /
torch's, microbenchmark, one run: a norm at 1 row 4.3 / 24.1, at 8 rows 6.4 / 31.2, at 2,000 rows
282 / 811; whole steps: docs/decode-speed.md, "A layer's small operators in one call each".

Built at start-up for AVX2 and FMA (every CPU class the engine meets), like decode attention's
kernel; a norm is checked against torch's at start-up (`probe_error`), and a failed build, load or
check leaves torch's operators to serve (runtime/build.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_service.model import native_build
from engine_service.model.kv_cache import WriteKV
from engine_service.model.native_build import Kernel

KERNEL = Kernel("layer_ops", Path(__file__).with_name("layer_ops.cpp"),
                ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma"), "engine_layer::rms_norm")
# the start-up norm's largest error relative to its largest value (`probe_error`): a row's scale may
# differ from torch's in its last float32 bit, so a value may round to a neighbouring bfloat16
# (2^-8 to 2^-7 of itself); an operator that computes wrongly is far off
PROBE_TOLERANCE = 0.01


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> the norm


@dataclass(frozen=True)
class LayerOps:
    """The library's operators (layer_ops.cpp has their contracts)."""

    rms_norm: RmsNorm
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, signed_sin): apply_rope's
    write_kv: WriteKV  # (k_cache, v_cache, slots, k, v): KVCache.write_decode's


def load(compiler: str, cache: Path) -> LayerOps:
    """The operators, their library built if `cache` lacks it and loaded. Raises RuntimeError (the
    compiler's failure, or torch's refusal to load) or OSError (the cache directory's)."""
    native_build.load(compiler, cache, KERNEL, None)  # never in the compiled step: no fake needed
    ops = torch.ops.engine_layer
    return LayerOps(ops.rms_norm, ops.rope, ops.write_kv)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm in torch's operators: normalised in float32, scaled in x's dtype."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def probe_error(ops: LayerOps) -> float:
    """Run the norm once on random bfloat16 rows (5 rows of 100 values: a partial last vector) and
    return its largest error relative to the largest value of torch's on the same values: a library
    that runs but computes wrongly fails at start-up, not in a step."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 100, generator=generator) * 3).to(torch.bfloat16)
    weight = (torch.rand(100, generator=generator) + 0.5).to(torch.bfloat16)
    ref = rms_norm(x, weight, 1e-5).float()
    return float((ops.rms_norm(x, weight, 1e-5).float() - ref).abs().max() / ref.abs().max())
