"""A prompt chunk's attention in the engine's kernel (`prompt_attention.cpp`), for a bfloat16 model
on a CPU that dots bfloat16 pairs (AVX-512 BF16; machine/precision.choose_prompt_attention decides
where): the chunk's tokens, causal at their positions, against its row's keys and values read in
place from the KV cache, what scaled_dot_product_attention computes for a chunk (is_causal from
position 0, the chunk mask past it). torch's CPU flash kernel multiplies bfloat16 at float32's
rate, and past position 0 computes the whole masked block or two merged calls; this one runs both
products in `vdpbf16ps` with the causal skip at any position: 0.45x torch's time for SmolLM2's
heads over 2,000 tokens from position 0, 0.42x for 512 tokens at 1,152 (AMD EPYC of the Zen 4
class; docs/decode-speed.md, "A prompt chunk's attention in the engine's kernel").

A token's result depends on its query and fixed blocks of keys only, so a chunk cut into parts (the
layer-sliced prefill's) gives the whole chunk's bits. Its first product is checked against float32
arithmetic at start-up (`probe_error`); a failed build, load or check leaves torch's kernel to serve
(runtime/build.py). Prompt chunks take it (whole prompts, chunks beside decoding rows in an eager
step, the sliced prefill's parts); the traced mixed step's chunk and the decoding rows keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_service.model import native_build
from engine_service.model.native_build import Kernel

_FLAGS = ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512bf16")
KERNEL = Kernel("prompt_attention", Path(__file__).with_name("prompt_attention.cpp"), _FLAGS,
                "engine_prompt_attention::chunk")
# the start-up product's largest error relative to the largest value (`probe_error`): bfloat16
# inputs, weights and output (2^-8), float32 sums in another order than the reference's
PROBE_TOLERANCE = 0.02

# (q (H, C, D), k (KV, >= start + C, D), v alike, start, scale) -> (C, H * D)
PromptAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def load(compiler: str, cache: Path) -> PromptAttention:
    """The kernel's operator, its library built if `cache` lacks it and loaded. Raises RuntimeError
    (the compiler's failure, or torch's refusal to load) or OSError (the cache directory's)."""
    native_build.load(compiler, cache, KERNEL, None)
    return native_build.operator(KERNEL)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """What `chunk` computes, in float32 by scaled_dot_product_attention with the chunk's mask:
    (C, H * D) from q (H, C, D) and k, v (KV, >= start + C, D)."""
    tokens, end = q.shape[1], start + q.shape[1]
    mask = torch.ones(tokens, end, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(q.float()[None], k[:, :end].float()[None], v[:, :end].float()[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(tokens, -1)


def probe_error(op: PromptAttention) -> float:
    """Run `op` once on random bfloat16 values (a 70-token chunk at position 50 of 2 KV heads of 3
    query heads of 64, read from a larger cache: partial blocks and tasks, masked keys) and return
    its largest error relative to the largest value of float32 attention on the same values: a
    kernel that runs but computes wrongly fails at start-up, not in a step."""
    generator = torch.Generator().manual_seed(0)
    heads, kv, dim, start, tokens, positions = 6, 2, 64, 50, 70, 160
    k, v = (torch.randn(kv, positions, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(heads, tokens, dim, generator=generator).to(torch.bfloat16)
    ref = reference(q, k, v, start)
    out = op(q, k, v, start, dim ** -0.5)
    return float((out.float() - ref).abs().max() / ref.abs().max())
