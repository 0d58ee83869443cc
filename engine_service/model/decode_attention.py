"""Decoding rows' attention in the engine's own kernel (`decode_attention.cpp`), for a bfloat16
model on a CPU (machine/precision.choose_decode_attention decides where): row r's query heads against
its keys and values at positions 0..lengths[r]-1, read in place from the KV cache, what
scaled_dot_product_attention computes with the decode mask, in a third to a half of its time
(torch's flash kernel runs two small matrix products and the softmax's buffers for every row and KV
head; docs/decode-speed.md, "Decode attention in the engine's kernel").

Built at start-up in one of two builds of the one source (`KERNELS`): for AVX2 and FMA, every CPU
class the engine meets; for AVX-512 BF16 where the CPU has it, which dots each key with the queries
in bfloat16 pairs (`vdpbf16ps`) instead of widening it first: 0.61-0.73x the AVX2 build's time a
layer on an AMD EPYC of the Zen 4 class (docs/decode-speed.md, "Decode attention's AVX-512 BF16
build"). Its first product is checked against float32 arithmetic (`probe_error`), and a failed build, load or check
leaves torch's kernel to serve (runtime/build.py). Steps of one token a row take it (decode steps,
the decoding rows of a mixed step, the compiled one-row step); verify steps and prompt chunks keep
scaled_dot_product_attention. The heads it takes (64 or 128 values, 1-16 query heads a KV head:
the .cpp's instantiations and arrays) are precision.choose_decode_attention's to check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_service.model import native_build
from engine_service.model.native_build import Kernel

_SOURCE = Path(__file__).with_name("decode_attention.cpp")
_AVX2 = ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma")
# the two builds of the one source, by the instruction sets they need (precision.choose_decode_attention
# picks): `avx2` for every CPU class, `avx512_bf16` where the CPU dots bfloat16 pairs (vdpbf16ps)
KERNELS = {
    "avx2": Kernel("decode_attention", _SOURCE, _AVX2, "engine_attention::decode"),
    "avx512_bf16": Kernel("decode_attention_avx512_bf16", _SOURCE,
                          (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
                           "-DENGINE_ATTENTION_LIBRARY=engine_attention_bf16"), "engine_attention_bf16::decode"),
}
# the start-up product's largest error relative to the largest value (`probe_error`): bfloat16
# inputs and output (2^-8), float32 sums in another order than the reference's
PROBE_TOLERANCE = 0.02

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def load(compiler: str, cache: Path, build: str = "avx2") -> DecodeAttention:
    """The operator of the kernel's `build` (a key of KERNELS), its library built if `cache` lacks it
    and loaded. Raises RuntimeError (the compiler's failure, or torch's refusal to load) or OSError
    (the cache directory's)."""
    native_build.load(compiler, cache, KERNELS[build], _shape)
    return native_build.operator(KERNELS[build])


def probe_error(op: DecodeAttention) -> float:
    """Run `op` once on random bfloat16 rows (3 rows of 2 KV heads of 3 query heads of 64, at 1,
    70 and 130 positions: a lone position, a partial block, several blocks) read from a larger
    cache, and return its largest error relative to the largest value of float32 attention on the
    same values: a kernel that runs but computes wrongly fails at start-up, not in a step."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, group, dim, positions = 3, 2, 3, 64, 160
    k, v = (torch.randn(rows + 1, heads, positions, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, heads, group, dim, generator=generator).to(torch.bfloat16)
    lengths = torch.tensor([1, 70, 130])
    scale = dim ** -0.5
    out = op(q, k, v, lengths, scale)
    mask = torch.arange(positions)[None, None, None, :] < lengths[:, None, None, None]
    ref = F.scaled_dot_product_attention(q.float(), k[:rows].float(), v[:rows].float(), attn_mask=mask)
    return float((out.float() - ref).abs().max() / ref.abs().max())
