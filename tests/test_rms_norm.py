"""The norms' operator (engine_service/model/rms_norm.cpp, rms_norm.py): built with the machine's
compiler for AVX2 and FMA, it computes Hugging Face's RMSNorm of bfloat16 rows as torch's composite
does, bit for bit at a decode step's rows and within one rounding at a prompt's; refuses malformed
operands by name; is checked at start-up; serves a bfloat16 model's norms eager and traced alike but
not inside the compiled step, where AOTInductor fuses the composite; and engine_ready says who
computes the norms and why."""

from __future__ import annotations

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import RMS_NORM_OFF, RMS_NORM_ON, find_cpp_compiler
from engine_service.model import rms_norm
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import KVCache
from engine_service.model.llama import LlamaForCausalLM, RMSNorm
from engine_service.model.traced_decode import TracedDecode
from engine_service.runtime.build import build_runner
from tools.local_engine import EngineProcess

CPU = torch.device("cpu")
COMPILER = find_cpp_compiler()
needs_kernel = pytest.mark.skipif(COMPILER is None or not {"avx2", "fma"} <= detect().flags,
                                  reason="the norms' operator needs a C++ compiler and AVX2 with FMA")


@pytest.fixture(scope="module")
def kernel() -> rms_norm.RmsNorm:
    assert COMPILER is not None
    return rms_norm.load(COMPILER, cache_dir())  # the engine's own compile cache, as its engines build it


def _rows(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=generator) * 4).to(torch.bfloat16)
    weight = (torch.rand(n, generator=generator) * 2 - 0.5).to(torch.bfloat16)  # some weights negative
    return x, weight


def _within_one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """`out` is the composite's `ref` but where a row's scale moved by its last float32 bit (the sum
    of squares in another order): a few values rounded to a neighbouring bfloat16, in the normalised
    value and so in its product with the weight (2^-8 to 2^-7 of a value each)."""
    differ = out != ref
    assert differ.float().mean() < 0.01
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -6)[differ].all()


@needs_kernel
@pytest.mark.parametrize(("rows", "n", "eps"), [(1, 576, 1e-5), (8, 576, 1e-5), (32, 576, 1e-6), (3, 100, 1e-5),
                                                (2, 8, 1e-5), (5, 2048, 1e-5), (2000, 576, 1e-6)])
def test_it_computes_the_composites_norm_to_one_rounding(kernel, rows: int, n: int, eps: float) -> None:
    # 100 and 8 values: a partial last vector, a lone one; 2,000 rows: a prompt's, across the threads
    x, weight = _rows(rows, n, rows + n)
    out = kernel(x, weight, eps)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    _within_one_rounding(out, rms_norm.composite(x, weight, eps))
    if rows <= 32 and n == 576:  # SmolLM2's decode rows: the same bits in these draws
        assert torch.equal(out, rms_norm.composite(x, weight, eps))


@needs_kernel
def test_it_takes_any_leading_shape_and_a_view(kernel) -> None:
    x, weight = _rows(12, 64, 2)
    assert torch.equal(kernel(x.view(2, 6, 64), weight, 1e-5), kernel(x, weight, 1e-5).view(2, 6, 64))
    wide = torch.cat([x, x], dim=1)[:, 64:]  # not contiguous
    assert torch.equal(kernel(wide, weight, 1e-5), kernel(x, weight, 1e-5))
    assert kernel(x[:0], weight, 1e-5).shape == (0, 64)


@needs_kernel
@pytest.mark.parametrize(("x", "weight", "eps", "message"), [
    (torch.ones(2, 8), torch.ones(8).bfloat16(), 1e-5, "rms_norm: x and weight must be bfloat16, got Float and BFloat16"),
    (torch.ones(2, 8).bfloat16(), torch.ones(8), 1e-5, "rms_norm: x and weight must be bfloat16, got BFloat16 and Float"),
    (torch.ones(2, 8).bfloat16(), torch.ones(7).bfloat16(), 1e-5, "rms_norm: weight must be (8,) for x [2, 8], got [7]"),
    (torch.ones(2, 8).bfloat16(), torch.ones(8).bfloat16(), -1.0, "rms_norm: eps must be >= 0, got -1"),
])
def test_malformed_operands_are_refused_by_name(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float,
                                                message: str) -> None:
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace(".", r"\.")):
        kernel(x, weight, eps)


@needs_kernel
def test_the_start_up_probe_passes_the_kernel_and_fails_a_wrong_one(kernel) -> None:
    assert rms_norm.probe_error(kernel) < rms_norm.PROBE_TOLERANCE
    assert rms_norm.probe_error(lambda x, weight, eps: torch.zeros_like(x)) > 0.5
    # the weight left out: every value off by its weight's factor
    assert rms_norm.probe_error(lambda x, weight, eps: kernel(x, torch.ones_like(weight), eps)) > rms_norm.PROBE_TOLERANCE


def _small() -> LlamaForCausalLM:
    config = ModelConfig(name="norm-test", vocab_size=300, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.init_random(0)
    for norm in (model.model.norm, *(n for layer in model.model.layers
                                     for n in (layer.input_layernorm, layer.post_attention_layernorm))):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # not all ones: the weight's product counts
    model.to(torch.bfloat16).eval()
    model.pack_projections()
    model.setup_rope(64, CPU)
    return model


def _decode(model: LlamaForCausalLM, cache: KVCache, step) -> torch.Tensor:  # type: ignore[no-untyped-def]
    prompts = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(3))
    model.prefill(prompts, torch.tensor([20, 11, 5]), cache, 0)
    tokens, positions, logits = torch.tensor([7, 8, 9]), torch.tensor([20, 11, 5]), []
    for _ in range(3):
        out = step(tokens, positions)
        logits.append(out)
        tokens, positions = out.argmax(-1), positions + 1
    return torch.stack(logits)


@needs_kernel
def test_a_bfloat16_models_norms_take_it_eager_and_traced_alike_and_the_same_bits(kernel) -> None:
    model = _small()
    cache = KVCache(model.config, 4, 64, torch.bfloat16, CPU)
    composite = _decode(model, cache, lambda t, p: model.decode(t, p, cache))
    calls: list[torch.Size] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(x.shape)
        return kernel(x, weight, eps)

    model.use_rms_norm(counted)
    eager = _decode(model, cache, lambda t, p: model.decode(t, p, cache))
    # a prefill (2 layers x 2 + the final norm) and 3 steps of the same
    assert len(calls) == 4 * 5 and calls[-1] == (3, 128)
    traced = _decode(model, cache, TracedDecode(model, cache, 4))
    assert torch.equal(traced, eager)  # the trace runs the operator: the same bits
    assert (eager.float() - composite.float()).abs().max() < 0.02 * composite.float().abs().max()
    model.use_rms_norm(None)
    calls.clear()
    assert torch.equal(_decode(model, cache, lambda t, p: model.decode(t, p, cache)), composite) and not calls


@needs_kernel
def test_the_compiled_step_keeps_the_composite(kernel) -> None:
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    norm.kernel = kernel
    exported = torch.export.export(norm, (torch.ones(1, 64, dtype=torch.bfloat16),))
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("engine_norm" in op for op in ops) and any("rsqrt" in op for op in ops)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert torch.equal(exported.module()(x), rms_norm.composite(x, norm.weight, 1e-5))


@needs_kernel
def test_build_runner_serves_a_bfloat16_model_with_it_and_says_so() -> None:
    built = build_runner(EngineConfig(model="small", dtype="bfloat16", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert built.norm_reason == RMS_NORM_ON
    assert built.runner.model.model.norm.kernel is not None
    assert all(layer.input_layernorm.kernel is not None and layer.post_attention_layernorm.kernel is not None
               for layer in built.runner.model.model.layers)
    built = build_runner(EngineConfig(model="small", dtype="float32", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert built.runner.model.model.norm.kernel is None
    assert built.norm_reason == f"{RMS_NORM_OFF}: the engine's operator serves bfloat16 on a CPU, this is float32 on cpu"


def test_engine_ready_says_who_computes_the_norms_and_why() -> None:
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--max-context", "64") as engine:
        [ready] = engine.events_named("engine_ready")
    assert ready["rms_norm"] == f"{RMS_NORM_OFF}: the engine's operator serves bfloat16 on a CPU, this is float32 on cpu"
