"""What a prompt token's attention costs against its matmuls on this machine, measured at start-up.

The prefill budget (scheduling/prefill_budget.py) weighs a chunk's token at position p as
1 + p / parity: its matmuls are fixed, its attention reads every cached position before it.
`prefill_budget.attention_parity` derives the parity from the model's shapes, counting FLOPs. But
attention and the matmuls do not run at the same FLOP rate: on a Xeon of family 6 model 207 with
AMX (SmolLM2 in bfloat16, 2 threads), flash attention of a 64-token chunk over 1,064 positions ran
at about 245 GFLOP/s and the matmuls of that step at about 620, so a late chunk cost more than its
weight said and its step overran the budget's target (the learned cost chased it from 1.06 to 1.27
between positions 1,000 and 1,900; fitted, the parity was about 950 positions against 3,072 by
FLOPs). `measured_parity` times one layer's projections over a chunk-sized batch of rows and its
attention for a chunk at depth, the paths a mixed step takes, and returns the position at which a
token's attention takes as long as its matmuls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_service.model.kv_cache import PromptChunk, additive_mask, chunk_mask
from engine_service.model.llama import LlamaForCausalLM

CHUNK_TOKENS = 64  # a chunk as the budget makes them beside 8 decoding rows (about 30-130 tokens)
DECODING_ROWS = 8  # the rows decoding beside it: the projections run over both
DEPTH = 1024  # the chunk's first position, where the context allows it
REPEATS = 7  # timed calls of each, after one untimed; the median counts
CPU = torch.device("cpu")  # where it measures (runtime/build.chunk_parity: elsewhere timing needs the device's sync)


def measured_parity(model: LlamaForCausalLM, max_context: int) -> float:
    """The cached positions at which a prompt token's attention takes as long as its matmuls, from
    one layer of `model` (on the CPU) on this machine: its projections (q/k/v, o, gate/up, down, each through
    whatever path a call of that many rows takes: quantized copy, prepacked or plain weights) over
    DECODING_ROWS + CHUNK_TOKENS rows, against its attention for a CHUNK_TOKENS chunk starting at
    DEPTH (or as deep as `max_context` allows), masked as a mixed step masks it, or in the engine's
    prompt attention where it serves (model/prompt_attention.py): the matmuls' time
    per row over the attention's per token and attended position."""
    config = model.config
    layer = model.model.layers[0]
    dtype = layer.self_attn.qkv.weight.dtype
    rows = DECODING_ROWS + CHUNK_TOKENS
    generator = torch.Generator(device="cpu").manual_seed(0)  # any values: the times do not depend on them

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    hidden = rand(1, rows, config.hidden_size)
    heads_out = rand(1, rows, config.num_attention_heads * config.dim_per_head)
    inner = rand(1, rows, config.intermediate_size)
    attn, mlp = layer.self_attn, layer.mlp

    def matmuls() -> None:
        attn.qkv(hidden)
        attn.out(heads_out)
        mlp.gate_up(hidden)
        mlp.down(inner)

    start = max(0, min(DEPTH, max_context - CHUNK_TOKENS))
    chunk = PromptChunk(0, start, CHUNK_TOKENS)
    length = start + CHUNK_TOKENS
    q = rand(1, config.num_attention_heads, CHUNK_TOKENS, config.dim_per_head)
    k = rand(1, config.num_key_value_heads, length, config.dim_per_head)
    v = rand(1, config.num_key_value_heads, length, config.dim_per_head)
    mask = additive_mask(chunk_mask(chunk, CPU), dtype)
    gqa = config.num_attention_heads != config.num_key_value_heads

    kernel = attn.prompt_kernel  # the engine's prompt attention where it serves (no mask), as a step runs it

    def attention() -> None:
        if kernel is not None:
            kernel(q[0], k[0], v[0], attn.scale)  # k and v through the chunk: it starts at `start`
        else:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    with torch.inference_mode():
        per_token = _seconds(matmuls) / rows
        per_position = _seconds(attention) / (CHUNK_TOKENS * (start + (CHUNK_TOKENS + 1) / 2))
    return per_token / per_position


def _seconds(call: Callable[[], None]) -> float:
    """The median time of REPEATS calls of `call`, after one untimed."""
    call()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
