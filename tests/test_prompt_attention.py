"""A prompt chunk's attention kernel (engine_service/model/prompt_attention.cpp, prompt_attention.py),
built with the machine's compiler for AVX-512 BF16 and tested where the CPU has it: it computes what
scaled_dot_product_attention does for a chunk (causal at its positions, from position 0 and past
it), at every length its 32-token tasks and 64-key blocks split into; a chunk cut into parts gives
the whole chunk's bits (the layer-sliced prefill's parts); it reads nothing past the chunk's last
position; refuses malformed operands by name; is checked at start-up; serves a bfloat16 model's
prompts; and build_runner says who computes prompt attention and why (where it is chosen:
test_precision.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from engine_service.config import EngineConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import (
    DECODE_ATTENTION_BF16_FLAGS,
    PROMPT_ATTENTION_OFF,
    PROMPT_ATTENTION_ON,
    find_cpp_compiler,
)
from engine_service.model import prompt_attention
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.traced_decode import TracedMixed
from engine_service.runtime.build import build_runner
from tests.attention_models import eager_and_traced_mixed_steps, small_bfloat16_model

CPU = torch.device("cpu")
COMPILER = find_cpp_compiler()
RUNS_HERE = COMPILER is not None and DECODE_ATTENTION_BF16_FLAGS <= detect().flags
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="the prompt attention kernel needs a C++ compiler and "
                                                        "AVX-512 BF16")


@pytest.fixture(scope="module")
def kernel() -> prompt_attention.PromptAttention:
    assert COMPILER is not None
    # the engine's own compile cache: the library these tests load is the one their engines build, once
    return prompt_attention.load(COMPILER, cache_dir())


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """In float64, with the chunk's mask: token i at position start + i attends keys 0..start+i."""
    tokens, end = q.shape[1], start + q.shape[1]
    mask = torch.ones(tokens, end, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(q.double()[None], k[:, :end].double()[None], v[:, :end].double()[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(tokens, -1)


def _operands(heads: int, kv: int, dim: int, start: int, tokens: int, seed: int = 0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    # the queries as the model hands them: heads of a (tokens, heads + 2 kv, dim) projection, not contiguous
    q = torch.randn(tokens, heads + 2 * kv, dim, generator=generator).to(torch.bfloat16)[:, :heads].transpose(0, 1)
    # keys and values as a cache row holds them: more positions than the chunk reaches
    k, v = (torch.randn(kv, start + tokens + 40, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(("heads", "kv", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize(("start", "tokens"), [
    (0, 1), (0, 37), (0, 300),  # from position 0: one token, a task and a part, several tasks and key blocks
    (1, 1), (100, 5), (17, 333), (1152, 512), (63, 66),  # past it: one token, a few, tasks crossing key blocks
])
def test_it_computes_a_chunks_causal_attention(kernel, heads: int, kv: int, dim: int, start: int,
                                               tokens: int) -> None:
    q, k, v = _operands(heads, kv, dim, start, tokens, seed=start + tokens)
    end = start + tokens  # the row's keys through the chunk: they say where it starts
    out = kernel(q, k[:, :end], v[:, :end], dim ** -0.5)
    assert out.shape == (tokens, heads * dim) and out.dtype == torch.bfloat16
    ref = reference(q, k, v, start)
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2
    # no worse than torch's own bfloat16 attention on the same values (its weights rounded to bfloat16 too)
    mask = torch.ones(tokens, start + tokens, dtype=torch.bool).tril(start)
    theirs = F.scaled_dot_product_attention(q[None], k[None, :, :start + tokens], v[None, :, :start + tokens],
                                            attn_mask=mask, enable_gqa=True)[0].transpose(0, 1).reshape(tokens, -1)
    assert (out.double() - ref).abs().max() <= 1.5 * (theirs.double() - ref).abs().max() + 1e-3


@needs_kernel
def test_a_chunk_cut_into_parts_gives_the_whole_chunks_bits(kernel) -> None:
    q, k, v = _operands(9, 3, 64, 0, 700, seed=3)
    whole = kernel(q, k[:, :700], v[:, :700], 0.125)
    cuts = [0, 128, 129, 450, 512, 700]  # parts within a task, across tasks, across key blocks
    parts = torch.cat([kernel(q[:, a:b], k[:, :b], v[:, :b], 0.125) for a, b in zip(cuts, cuts[1:], strict=False)])
    assert torch.equal(parts, whole)


@needs_kernel
def test_it_reads_nothing_past_the_chunks_last_position(kernel) -> None:
    q, k, v = _operands(6, 2, 64, 70, 30, seed=4)
    clean = kernel(q, k[:, :100], v[:, :100], 0.125)
    k[:, 100:] = v[:, 100:] = float("nan")
    assert torch.equal(kernel(q, k[:, :100], v[:, :100], 0.125), clean)


@needs_kernel
def test_a_key_past_a_tokens_position_weighs_exactly_nothing(kernel) -> None:
    """Keys after a token's own position, within the chunk, hold the largest bfloat16 values: the
    first token, alone with key 0, gives value 0 exactly (a weight of even 1e-38 on them would show)."""
    q, k, v = _operands(6, 2, 64, 0, 40, seed=6)
    k, v = k[:, :40].clone(), v[:, :40].clone()
    k[:, 1:] = v[:, 1:] = 3e38
    out = kernel(q, k, v, 0.125)
    assert torch.equal(out[0].view(6, 64), v[torch.arange(6) // 3, 0])  # each head's KV head's value 0


@needs_kernel
@pytest.mark.parametrize(("change", "message"), [
    (dict(k=torch.zeros(2, 2, 64), v=torch.zeros(2, 2, 64)), "a chunk of 3 tokens against 2 positions of k and v"),
    (dict(q=torch.zeros(2, 0, 64)), "a chunk of 0 tokens against 16 positions"),
    (dict(q=torch.zeros(2, 3, 32), k=torch.zeros(2, 16, 32), v=torch.zeros(2, 16, 32)), "head size 64 or 128, got 32"),
    (dict(q=torch.zeros(3, 3, 64)), "do not fit q"),
    (dict(k=torch.zeros(2, 16, 128), v=torch.zeros(2, 16, 128)), "do not fit q"),
    (dict(q=torch.zeros(2, 3, 64, dtype=torch.float32)), "bfloat16 q, k and v, got Float"),
    (dict(k=torch.zeros(2, 64, 16).transpose(1, 2)), "need contiguous heads"),
    (dict(q=torch.zeros(2, 2, 3, 64)), "must be 3-D"),
])
def test_malformed_operands_are_refused_by_name(kernel, change: dict[str, object], message: str) -> None:
    args: dict[str, object] = dict(q=torch.zeros(2, 3, 64), k=torch.zeros(2, 16, 64), v=torch.zeros(2, 16, 64))
    args.update(change)
    args = {name: value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and "Float" not in message else value
            for name, value in args.items()}
    with pytest.raises(RuntimeError, match=message):
        kernel(args["q"], args["k"], args["v"], 0.125)


@needs_kernel
def test_the_start_up_probe_passes_the_kernel_and_fails_a_wrong_one(kernel) -> None:
    assert prompt_attention.probe_error(kernel) < prompt_attention.PROBE_TOLERANCE
    assert prompt_attention.probe_error(lambda q, k, v, scale: torch.zeros(q.shape[1], q.shape[0] * q.shape[2],
                                                                                   dtype=q.dtype)) > 0.5
    # each token a position short: its own key dropped, the error shows
    assert prompt_attention.probe_error(lambda q, k, v, scale: kernel(q, k[:, :-1], v[:, :-1], scale)) \
        > prompt_attention.PROBE_TOLERANCE


def _small(seed: int = 0) -> LlamaForCausalLM:
    return small_bfloat16_model(seed, 256)


@needs_kernel
def test_a_bfloat16_models_prompts_take_it_whole_and_in_chunks_alike(kernel) -> None:
    model = _small()
    cache = KVCache(model.config, 4, 256, torch.bfloat16, CPU)
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(5))
    none = prompt[:0]

    def last_logits(cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        for a, b in zip(cuts, cuts[1:], strict=False):
            logits = model.step(none, none, prompt[a:b], [PromptChunk(1, a, b - a)], cache, logits_of=[0])
        return logits, cache.k[:, 1, :, :200].clone()

    torchs, torch_keys = last_logits([0, 200])
    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[1].shape[1] - args[0].shape[1])  # where the chunk starts: its keys less its tokens
        return kernel(*args)  # type: ignore[arg-type]

    model.use_prompt_attention(counted)
    assert model.prompt_attention
    whole, keys = last_logits([0, 200])
    assert calls == [0, 0]  # one call a layer, from position 0
    chunked, chunked_keys = last_logits([0, 64, 150, 200])
    assert calls[2:] == [0, 0, 64, 64, 150, 150]
    assert torch.equal(chunked, whole) and torch.equal(chunked_keys, keys)  # the same bits chunked or not
    assert torch.equal(keys[0], torch_keys[0])  # the first layer's keys precede any attention; the rest ...
    assert not torch.equal(keys[1], torch_keys[1])  # ... follow another arithmetic than torch's ...
    assert (whole.float() - torchs.float()).abs().max() < 0.05 * torchs.float().abs().max()  # ... to rounding
    model.use_prompt_attention(None)
    assert not model.prompt_attention
    assert torch.equal(last_logits([0, 200])[0], torchs)


@pytest.mark.parametrize(("max_context", "shapes"), [(2048, (512, 64, 1024)), (1088, (512, 64, 1024)),
                                                   (1000, (512, 64, 936)), (128, (128, 64, 64)), (40, (40, 40, 0))])
def test_the_race_runs_a_prompt_from_0_and_a_chunk_at_depth_within_the_context(max_context: int,
                                                                               shapes: tuple[int, int, int]) -> None:
    assert prompt_attention.race_shapes(max_context) == shapes


@needs_kernel
def test_the_race_times_the_kernel_and_torchs_on_the_models_heads(kernel) -> None:
    config = _small().config
    calls = []

    def slowed(*args: object) -> torch.Tensor:
        calls.append(args[1].shape[1] - args[0].shape[1])  # where the chunk starts: its keys less its tokens
        ends = time.perf_counter() + 0.002
        while time.perf_counter() < ends:
            pass  # a busy wait: the race measures the machine
        return kernel(*args)  # type: ignore[arg-type]

    ours, theirs = prompt_attention.race(slowed, config, 256)  # 256 tokens from 0, 64 at 192
    assert calls == [0, 192] * (1 + prompt_attention.RACE_ROUNDS)
    assert min(ours) > 2000 and 0 < min(theirs) < math.inf  # the op given is what is timed, each call


def test_build_runner_says_who_computes_prompt_attention_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    built = build_runner(EngineConfig(model="small", dtype="bfloat16", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    if RUNS_HERE:
        assert built.prompt_attention_reason.startswith(f"{PROMPT_ATTENTION_ON}: ")
        assert "for a layer's 128 tokens from 0 / 64 at 64, in a start-up race" in built.prompt_attention_reason
        assert built.runner.model.prompt_attention
        # where torch's is faster the race keeps it, and says so with the times
        monkeypatch.setattr(prompt_attention, "race", lambda op, config, context: ((300.0, 200.0), (100.0, 100.0)))
        built = build_runner(EngineConfig(model="small", dtype="bfloat16", quantize="none", max_batch=4,
                                          max_context=128, compile_decode="off"), detect())
        assert not built.runner.model.prompt_attention
        assert built.prompt_attention_reason == (f"{PROMPT_ATTENTION_OFF}: the engine's kernel took 300 / 200 us "
                                                 "against torch's 100 / 100 for a layer's 128 tokens from 0 / 64 at "
                                                 "64, in a start-up race")
    else:
        assert built.prompt_attention_reason.startswith(f"{PROMPT_ATTENTION_OFF}: ")
        assert not built.runner.model.prompt_attention
    built = build_runner(EngineConfig(model="small", dtype="float32", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert not built.runner.model.prompt_attention
    assert built.prompt_attention_reason == (f"{PROMPT_ATTENTION_OFF}: the engine's kernel serves bfloat16 on a CPU, "
                                             "this is float32 on cpu")


@needs_kernel
def test_a_mixed_steps_chunk_takes_it_traced_and_eager_alike(kernel) -> None:
    """The traced mixed step (TracedMixed) serves every chunk size and position from one trace:
    the kernel reads where a chunk starts from its keys' length, so the trace keeps it a size, not
    an int; its logits and cache are the eager step's bit for bit, at positions the trace never saw."""
    model = _small(1)
    model.use_prompt_attention(kernel)
    cache = KVCache(model.config, 8, 256, torch.bfloat16, CPU)
    traced = TracedMixed(model, cache)
    generator = torch.Generator().manual_seed(2)
    d = 3
    prompts = torch.randint(0, 300, (d + 1, 120), generator=generator)
    for chunk in (PromptChunk(3, 20, 24), PromptChunk(3, 0, 40), PromptChunk(3, 100, 17)):
        chunk_tokens = torch.randint(0, 300, (chunk.length,), generator=generator)
        runs = eager_and_traced_mixed_steps(model, cache, traced, prompts,
                                            torch.tensor([30, 64, 65, max(chunk.start, 1)]), chunk, chunk_tokens)
        for eager, through_trace in zip(*runs, strict=True):
            assert torch.equal(eager, through_trace), chunk
