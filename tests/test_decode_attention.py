"""The decoding rows' attention kernel (engine_service/model/decode_attention.cpp, decode_attention.py):
built with the machine's compiler for AVX2 and FMA, and for AVX-512 BF16 where the CPU has it (each
build tested where it runs), it computes what
scaled_dot_product_attention does with the decode mask, reading each row's first `lengths[r]`
positions of the cache in place and nothing past them, at every length its 64-key blocks split
into; refuses malformed operands by name; is checked at start-up; serves a bfloat16 model's
decode steps, eager, traced and mixed alike (the same bits each way); is chosen only where it can
run; and engine_ready says who computes decode attention and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_service.config import EngineConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import (
    DECODE_ATTENTION_BF16_FLAGS,
    DECODE_ATTENTION_OFF,
    DECODE_ATTENTION_ON,
    find_cpp_compiler,
)
from engine_service.model import decode_attention
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.traced_decode import TracedDecode, TracedMixed
from engine_service.runtime.build import build_runner
from tests.attention_models import eager_and_traced_mixed_steps, small_bfloat16_model
from tests.greedy_steps import Step, greedy_logits
from tools.local_engine import EngineProcess

CPU = torch.device("cpu")
COMPILER = find_cpp_compiler()
needs_kernel = pytest.mark.skipif(COMPILER is None or not {"avx2", "fma"} <= detect().flags,
                                  reason="the decode attention kernel needs a C++ compiler and AVX2 with FMA")


# the AVX-512 BF16 build where this CPU runs it (precision.choose_decode_attention's rule), the AVX2 one everywhere
THIS_BUILD = "avx512_bf16" if DECODE_ATTENTION_BF16_FLAGS <= detect().flags else "avx2"


@pytest.fixture(scope="module", params=[
    "avx2",
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(THIS_BUILD != "avx512_bf16",
                                                         reason="the AVX-512 BF16 build needs avx512f and avx512_bf16")),
])
def kernel(request: pytest.FixtureRequest) -> decode_attention.DecodeAttention:
    assert COMPILER is not None
    # the engine's own compile cache: the library these tests load is the one their engines build, once
    return decode_attention.load(COMPILER, cache_dir(), request.param)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """scaled_dot_product_attention in float64 with the decode mask: row r attends its first lengths[r] positions."""
    b = q.shape[0]
    mask = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
    return F.scaled_dot_product_attention(q.double(), k[:b].double(), v[:b].double(), attn_mask=mask)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "group"), [(64, 3), (64, 1), (128, 4), (64, 16)])
def test_it_computes_attention_over_each_rows_own_positions(kernel, dtype: torch.dtype, dim: int, group: int) -> None:
    generator = torch.Generator().manual_seed(dim + group)
    heads, positions = 2, 200
    # 1 position; a block less one, a block, a block and one (64-key blocks); several blocks; the whole cache
    lengths = torch.tensor([1, 63, 64, 65, 130, positions])
    b = lengths.shape[0]
    k, v = (torch.randn(b + 2, heads, positions, dim, generator=generator).to(dtype) for _ in range(2))
    # the queries as the model hands them: a transposed view, not contiguous
    q = torch.randn(group, b, heads, dim, generator=generator).to(dtype).permute(1, 2, 0, 3)
    out = kernel(q, k, v, lengths, dim ** -0.5)
    assert out.shape == (b, heads, group, dim) and out.dtype == dtype
    ref = reference(q, k, v, lengths)
    error = ((out.double() - ref).abs().amax(dim=(1, 2, 3)) / ref.abs().amax(dim=(1, 2, 3)))
    # float32: the sums' order; bfloat16: the output rounded once (2^-8 of a value), its sums in float32
    assert error.max() < (1e-5 if dtype == torch.float32 else 8e-3), error
    if dtype == torch.bfloat16:  # no worse than torch's own bfloat16 attention on the same values
        mask = torch.arange(positions)[None, None, None, :] < lengths[:, None, None, None]
        theirs = F.scaled_dot_product_attention(q, k[:b], v[:b], attn_mask=mask)
        assert (out.double() - ref).abs().max() <= 1.5 * (theirs.double() - ref).abs().max() + 1e-6


@needs_kernel
def test_it_reads_nothing_past_a_rows_length_nor_other_rows(kernel) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 64, 70])
    k, v = (torch.randn(5, 3, 128, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(3, 3, 3, 64, generator=generator).to(torch.bfloat16)
    clean = kernel(q, k, v, lengths, 0.125)
    for r, n in enumerate(lengths.tolist()):  # what a row may not read: poisoned
        k[r, :, n:] = v[r, :, n:] = float("nan")
    k[3:] = v[3:] = float("nan")
    assert torch.equal(kernel(q, k, v, lengths, 0.125), clean)


@needs_kernel
@pytest.mark.parametrize(("change", "message"), [
    (dict(lengths=torch.tensor([3, 0])), "row 1 attends 0 positions, outside 1..16"),
    (dict(lengths=torch.tensor([17, 2])), "row 0 attends 17 positions, outside 1..16"),
    (dict(lengths=torch.tensor([3, 2], dtype=torch.int32)), "lengths must be (2,) int64"),
    (dict(lengths=torch.tensor([3])), "lengths must be (2,) int64"),
    (dict(q=torch.zeros(2, 2, 3, 32), k=torch.zeros(3, 2, 16, 32), v=torch.zeros(3, 2, 16, 32)),
     "head size 64 or 128, got 32"),
    (dict(q=torch.zeros(2, 2, 17, 64)), "1..16 query heads a KV head, got 17"),
    (dict(q=torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16)), "must share a dtype"),
    (dict(q=torch.zeros(2, 2, 3, 64, dtype=torch.float16), k=torch.zeros(3, 2, 16, 64, dtype=torch.float16),
          v=torch.zeros(3, 2, 16, 64, dtype=torch.float16)), "float32 or bfloat16, got Half"),
    (dict(k=torch.zeros(3, 2, 16, 64).transpose(2, 3).contiguous().transpose(2, 3)), "need contiguous heads"),
    (dict(k=torch.zeros(1, 2, 16, 64), v=torch.zeros(1, 2, 16, 64)), "do not fit q"),
    (dict(q=torch.zeros(2, 2, 64)), "must be 4-D"),
])
def test_malformed_operands_are_refused_by_name(kernel, change: dict[str, torch.Tensor], message: str) -> None:
    args = dict(q=torch.zeros(2, 2, 3, 64), k=torch.zeros(3, 2, 16, 64), v=torch.zeros(3, 2, 16, 64),
                lengths=torch.tensor([3, 2]))
    args.update(change)
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        kernel(args["q"], args["k"], args["v"], args["lengths"], 0.125)


@needs_kernel
def test_the_start_up_probe_passes_the_kernel_and_fails_a_wrong_one(kernel) -> None:
    assert decode_attention.probe_error(kernel) < decode_attention.PROBE_TOLERANCE
    assert decode_attention.probe_error(lambda q, k, v, lengths, scale: torch.zeros_like(q)) > 0.5
    # keys one position short: the last key dropped, the error shows
    assert decode_attention.probe_error(lambda q, k, v, lengths, scale: kernel(q, k, v, (lengths - 1).clamp(min=1),
                                                                              scale)) > decode_attention.PROBE_TOLERANCE


def _small(seed: int = 0) -> LlamaForCausalLM:
    return small_bfloat16_model(seed, CONTEXT)


CONTEXT = 160


def _decode_runs(model: LlamaForCausalLM, cache: KVCache, step: Step, batch: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    lengths = torch.tensor([3, 70, 64, 65, 100][:batch])
    prompts = torch.randint(0, 300, (batch, int(lengths.max())), generator=generator)
    return greedy_logits(model, cache, step, prompts, lengths, 4)


@needs_kernel
def test_a_bfloat16_models_decode_steps_take_it_eager_and_traced_alike(kernel) -> None:
    model = _small()
    cache = KVCache(model.config, 8, CONTEXT, torch.bfloat16, CPU)
    torchs = _decode_runs(model, cache, lambda t, p: model.decode(t, p, cache))
    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].shape)  # type: ignore[union-attr]
        return kernel(*args)

    model.use_decode_attention(counted)
    assert model.decode_attention is not None
    eager = _decode_runs(model, cache, lambda t, p: model.decode(t, p, cache))
    assert calls[0] == (5, 2, 3, 64) and len(calls) == 4 * 2  # 4 steps of 2 layers, every row in one call
    traced = _decode_runs(model, cache, TracedDecode(model, cache, 8))
    assert torch.equal(traced, eager)  # the trace runs the kernel, not torch's attention: the same bits
    assert not torch.equal(eager, torchs)  # another arithmetic than torch's ...
    assert (eager.float() - torchs.float()).abs().max() < 0.05 * torchs.float().abs().max()  # ... to rounding
    model.use_decode_attention(None)
    assert model.decode_attention is None
    assert torch.equal(_decode_runs(model, cache, lambda t, p: model.decode(t, p, cache)), torchs)


@needs_kernel
def test_a_mixed_steps_decoding_rows_take_it_traced_and_eager_alike(kernel) -> None:
    model = _small(1)
    model.use_decode_attention(kernel)
    cache = KVCache(model.config, 8, CONTEXT, torch.bfloat16, CPU)
    traced = TracedMixed(model, cache)
    generator = torch.Generator().manual_seed(2)
    d, chunk = 3, PromptChunk(3, 20, 24)
    prompts = torch.randint(0, 300, (d + 1, 70), generator=generator)
    chunk_tokens = torch.randint(0, 300, (chunk.length,), generator=generator)
    # row 3: the chunk's prompt's first 20
    runs = eager_and_traced_mixed_steps(model, cache, traced, prompts, torch.tensor([30, 64, 65, 20]), chunk,
                                        chunk_tokens)
    assert runs[1][0] is not None and runs[0][0].shape == (d + 1, 300)
    for eager, through_trace in zip(*runs, strict=True):
        assert torch.equal(eager, through_trace)


@needs_kernel
def test_build_runner_serves_a_bfloat16_model_with_it_and_says_so() -> None:
    built = build_runner(EngineConfig(model="small", dtype="bfloat16", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert built.attention_reason == DECODE_ATTENTION_ON[THIS_BUILD]
    assert built.runner.model.decode_attention == decode_attention.KERNELS[THIS_BUILD].op.replace("::", ".")
    built = build_runner(EngineConfig(model="small", dtype="float32", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert built.runner.model.decode_attention is None
    assert built.attention_reason == (f"{DECODE_ATTENTION_OFF}: the engine's kernel serves bfloat16 on a CPU, "
                                      "this is float32 on cpu")


def test_engine_ready_says_who_computes_decode_attention_and_why() -> None:
    # the tiny model's heads hold 16 values: torch's attention serves, and engine_ready says why
    with EngineProcess("--model", "tiny", "--dtype", "bfloat16", "--max-context", "64") as engine:
        [ready] = engine.events_named("engine_ready")
    assert ready["decode_attention"] == (f"{DECODE_ATTENTION_OFF}: the engine's kernel takes heads of 64 or 128 "
                                         "values and 1-16 query heads a KV head, the model has 16 and 2")
