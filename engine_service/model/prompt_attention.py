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
(runtime/build.py). Then it races torch's on the model's heads (`race`) and serves only where it
wins (machine/precision.keep_prompt_attention): torch's CPU kernel runs AMX tiles where the CPU has
them, which the flags alone do not weigh against this kernel. Prompt chunks take it (whole
prompts, chunks beside decoding rows in an eager or traced step, the sliced prefill's parts); the
decoding rows keep theirs (decode_attention.py). It takes no int of where a chunk starts: the
keys and values it is given are the row's through the chunk's last position, and their length less
the chunk's says it, so a TorchScript trace of a step keeps it a size (an int passed to a custom op
would be baked into the trace).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_service.model import native_build
from engine_service.model.config import ModelConfig
from engine_service.model.native_build import Kernel

_FLAGS = ("-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512bf16")
KERNEL = Kernel("prompt_attention", Path(__file__).with_name("prompt_attention.cpp"), _FLAGS,
                "engine_prompt_attention::chunk")
# the start-up product's largest error relative to the largest value (`probe_error`): bfloat16
# inputs, weights and output (2^-8), float32 sums in another order than the reference's
PROBE_TOLERANCE = 0.02

# (q (H, C, D), k (KV, start + C, D): the row's keys through the chunk's last position, v alike,
# scale) -> (C, H * D)
PromptAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

# the start-up race's chunks (`race`): a prompt of RACE_TOKENS from position 0, and a chunk of
# RACE_CHUNK tokens at RACE_DEPTH (or as deep as the context allows), as a step beside decoding rows
# or a sliced prefill's part meets them
RACE_TOKENS, RACE_CHUNK, RACE_DEPTH = 512, 64, 1024
RACE_ROUNDS = 5  # timed rounds of each call, alternating, after one untimed; the medians count


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
    out = op(q, k[:, :start + tokens], v[:, :start + tokens], dim ** -0.5)
    return float((out.float() - ref).abs().max() / ref.abs().max())


def race_shapes(max_context: int) -> tuple[int, int, int]:
    """The race's prompt tokens, chunk tokens and the chunk's first position within `max_context`."""
    chunk = min(RACE_CHUNK, max_context)
    return min(RACE_TOKENS, max_context), chunk, max(0, min(RACE_DEPTH, max_context - chunk))


def race(op: PromptAttention, config: ModelConfig,
         max_context: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(the kernel's, torch's) median microseconds a layer's attention takes, on `config`'s heads in
    bfloat16, for a RACE_TOKENS prompt from position 0 (torch's call causal) and a RACE_CHUNK chunk at
    RACE_DEPTH or as deep as `max_context` allows (torch's call under the chunk's mask), as the
    model calls each: the kernel wins on a CPU that dots bfloat16 pairs faster than torch's kernel
    multiplies (torch's runs AMX tiles where it has them), which only a race on the machine says."""
    generator = torch.Generator().manual_seed(0)
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.dim_per_head
    tokens, chunk, depth = race_shapes(max_context)
    positions = max(tokens, depth + chunk)
    k, v = (torch.randn(kv, positions, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    qs = [torch.randn(heads, n, dim, generator=generator).to(torch.bfloat16) for n in (tokens, chunk)]
    mask = torch.ones(chunk, depth + chunk, dtype=torch.bool).tril(depth)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill_(~mask, float("-inf"))
    scale = dim ** -0.5
    calls = {
        ("ours", 0): lambda: op(qs[0], k[:, :tokens], v[:, :tokens], scale),
        ("ours", 1): lambda: op(qs[1], k[:, :depth + chunk], v[:, :depth + chunk], scale),
        ("torch", 0): lambda: F.scaled_dot_product_attention(qs[0][None], k[None, :, :tokens], v[None, :, :tokens],
                                                             is_causal=True, enable_gqa=True),
        ("torch", 1): lambda: F.scaled_dot_product_attention(qs[1][None], k[None, :, :depth + chunk],
                                                             v[None, :, :depth + chunk], attn_mask=additive,
                                                             enable_gqa=True),
    }
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for round_ in range(RACE_ROUNDS + 1):  # one warm-up round
            for key, call in calls.items():
                started = time.perf_counter()
                call()
                if round_:
                    times[key].append(time.perf_counter() - started)
    us = {key: statistics.median(t) * 1e6 for key, t in times.items()}
    return (us["ours", 0], us["ours", 1]), (us["torch", 0], us["torch", 1])
