"""A layer's small operators (engine_service/model/layer_ops.cpp, layer_ops.py): built with the
machine's compiler for AVX2 and FMA, `rms_norm` computes Hugging Face's RMSNorm of bfloat16 rows as
torch's operators do, to one rounding (bit for bit at SmolLM2's decode rows), `rope` the rotary
embedding with apply_rope's bits, and `write_kv` writes a step's keys and values where
KVCache.write_decode's index_copy_ does; both refuse malformed operands
by name; the norm is checked at start-up; a bfloat16 model's steps take them eager and traced alike
(the same bits, the cache the same) but not inside the compiled step, where AOTInductor fuses
torch's; and engine_ready says who computes them and why."""

from __future__ import annotations

import re

import pytest
import structlog
import torch

from engine_service.config import EngineConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import LAYER_OPS_OFF, LAYER_OPS_ON, find_cpp_compiler
from engine_service.model import layer_ops
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache import KVCache
from engine_service.model.llama import LlamaForCausalLM, RMSNorm, apply_rope
from engine_service.model.traced_decode import TracedDecode
from engine_service.runtime.build import _load_layer_ops, build_runner
from tests.greedy_steps import Step, greedy_logits
from tools.local_engine import EngineProcess

CPU = torch.device("cpu")
COMPILER = find_cpp_compiler()
needs_kernel = pytest.mark.skipif(COMPILER is None or not {"avx2", "fma"} <= detect().flags,
                                  reason="the layer's operators need a C++ compiler and AVX2 with FMA")


@pytest.fixture(scope="module")
def ops() -> layer_ops.LayerOps:
    assert COMPILER is not None
    return layer_ops.load(COMPILER, cache_dir())  # the engine's own compile cache, as its engines build it


@pytest.fixture(scope="module")
def kernel(ops: layer_ops.LayerOps) -> layer_ops.RmsNorm:
    return ops.rms_norm


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
    _within_one_rounding(out, layer_ops.rms_norm(x, weight, eps))
    if rows <= 32 and n == 576:  # SmolLM2's decode rows: the same bits in these draws
        assert torch.equal(out, layer_ops.rms_norm(x, weight, eps))


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
@pytest.mark.parametrize(("tokens", "dim", "heads"), [(1, 64, 12), (8, 64, 12), (300, 64, 12), (5, 128, 6), (4, 48, 3)])
def test_rope_gives_apply_ropes_bits(ops, tokens: int, dim: int, heads: int) -> None:
    # q and k heads as the model hands them: the first heads of the qkv projection's output, a
    # strided view; 48 values: halves of 24, no whole vectors (the scalar path)
    generator = torch.Generator().manual_seed(tokens + dim)
    qk = torch.randn(1, tokens, heads + 3, dim, generator=generator).to(torch.bfloat16)[:, :, :heads]
    table = torch.randn(2, 400, dim, generator=generator).to(torch.bfloat16)
    positions = torch.randint(0, 400, (tokens,), generator=generator)
    cos, sin = (t[positions].view(1, tokens, 1, dim) for t in table)
    out = ops.rope(qk, cos, sin)
    assert out.is_contiguous() and torch.equal(out, apply_rope(qk, cos, sin))


@needs_kernel
@pytest.mark.parametrize(("change", "message"), [
    ({"x": torch.ones(1, 2, 3, 8)}, "rope: x, cos and signed_sin must be bfloat16, got Float, BFloat16 and BFloat16"),
    ({"x": torch.ones(2, 3, 8).bfloat16()}, "rope: x must be (B, T, H, D) with contiguous heads, got [2, 3, 8]"),
    ({"x": torch.ones(1, 2, 3, 16).bfloat16()[..., ::2]}, "rope: x must be (B, T, H, D) with contiguous heads"),
    ({"x": torch.ones(1, 2, 3, 7).bfloat16()}, "rope: the head size must be even, got 7"),
    ({"cos": torch.ones(1, 3, 1, 8).bfloat16()}, "rope: cos and signed_sin must be (1, 2, 1, 8), got [1, 3, 1, 8] and [1, 2, 1, 8]"),
])
def test_rope_refuses_malformed_operands_by_name(ops, change: dict[str, torch.Tensor], message: str) -> None:
    args = {"x": torch.ones(1, 2, 3, 8).bfloat16(), "cos": torch.ones(1, 2, 1, 8).bfloat16(),
            "sin": torch.ones(1, 2, 1, 8).bfloat16()}
    args.update(change)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.rope(args["x"], args["cos"], args["sin"])


def _with_norm(norm: layer_ops.RmsNorm) -> layer_ops.LayerOps:
    return layer_ops.LayerOps(norm, apply_rope, lambda *args: None)


@needs_kernel
def test_the_start_up_probe_passes_the_norm_and_fails_a_wrong_one(ops, kernel) -> None:
    assert layer_ops.probe_error(ops) < layer_ops.PROBE_TOLERANCE
    assert layer_ops.probe_error(_with_norm(lambda x, weight, eps: torch.zeros_like(x))) > 0.5
    # the weight left out: every value off by its weight's factor
    unweighted = _with_norm(lambda x, weight, eps: kernel(x, torch.ones_like(weight), eps))
    assert layer_ops.probe_error(unweighted) > layer_ops.PROBE_TOLERANCE


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_write_kv_writes_where_write_decodes_index_copy_does(ops, rows: int) -> None:
    config = ModelConfig(name="kv", vocab_size=10, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    caches = [KVCache(config, 40, 300, torch.bfloat16, CPU) for _ in range(2)]
    generator = torch.Generator().manual_seed(rows)
    cache_rows = torch.randperm(40, generator=generator)[:rows]
    positions = torch.randint(0, 300, (rows,), generator=generator)
    slots = caches[0].decode_slots(cache_rows, positions)
    # keys and values as Attention.forward hands them: a narrow of (1, KV, M, D), M past the rows
    k, v = (torch.randn(1, 2, rows + 3, 16, generator=generator).to(torch.bfloat16)[0].narrow(1, 0, rows)
            for _ in range(2))
    caches[0].write_decode(1, slots, k, v)
    caches[1].write_decode(1, slots, k, v, ops.write_kv)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)
    assert int((caches[1].k != 0).sum()) == k.numel()  # nothing else written


@needs_kernel
@pytest.mark.parametrize(("change", "message"), [
    ({"slots": torch.tensor([0, 1, 2, 3000])}, "write_kv: slot 3000 is outside the cache's 0..149"),
    ({"slots": torch.tensor([0, -1, 2, 3])}, "write_kv: slot -1 is outside the cache's 0..149"),
    ({"slots": torch.tensor([0, 1, 2])}, "write_kv: slots must be (4,) int64, got [3] Long"),
    ({"slots": torch.tensor([0, 1, 2, 3], dtype=torch.int32)}, "write_kv: slots must be (4,) int64, got [4] Int"),
    ({"k": torch.ones(2, 2, 16).bfloat16()}, "write_kv: k and v must be (KV, d, D) alike, got [2, 2, 16] and [2, 2, 32]"),
    ({"k": torch.ones(2, 2, 32)}, "write_kv: keys, values and caches must share a dtype"),
    ({"k": torch.ones(2, 2, 64).bfloat16()[..., ::2]}, "write_kv: k and v need contiguous heads"),
    ({"k_cache": torch.zeros(5, 2, 240, 16).bfloat16()},
     "write_kv: the caches must be contiguous, alike, with heads of 32 values, got [5, 2, 240, 16] and [5, 2, 15, 32]"),
])
def test_write_kv_refuses_malformed_operands_by_name(ops, change: dict[str, torch.Tensor], message: str) -> None:
    args = {"k_cache": torch.zeros(5, 2, 15, 32).bfloat16(), "v_cache": torch.zeros(5, 2, 15, 32).bfloat16(),
            "slots": torch.tensor([0, 1, 2, 3]), "k": torch.ones(2, 2, 32).bfloat16(), "v": torch.ones(2, 2, 32).bfloat16()}
    args.update(change)
    if "k_cache" in change:
        args["v_cache"] = torch.zeros(5, 2, 15, 32).bfloat16()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.write_kv(args["k_cache"], args["v_cache"], args["slots"], args["k"], args["v"])


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


def _decode(model: LlamaForCausalLM, cache: KVCache, step: Step) -> torch.Tensor:
    prompts = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(3))
    return greedy_logits(model, cache, step, prompts, torch.tensor([20, 11, 5]), 3)


@needs_kernel
def test_a_bfloat16_models_steps_take_them_eager_and_traced_alike(ops) -> None:
    model = _small()
    cache = KVCache(model.config, 4, 64, torch.bfloat16, CPU)
    torchs = _decode(model, cache, lambda t, p: model.decode(t, p, cache))
    torchs_cache = cache.k.clone(), cache.v.clone()
    norms: list[torch.Size] = []
    writes: list[torch.Size] = []
    ropes: list[torch.Size] = []

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        norms.append(x.shape)
        return ops.rms_norm(x, weight, eps)

    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        writes.append(k.shape)
        ops.write_kv(k_cache, v_cache, slots, k, v)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ropes.append(x.shape)
        return ops.rope(x, cos, sin)

    model.use_layer_ops(layer_ops.LayerOps(norm, rope, write))
    cache.k.zero_()
    cache.v.zero_()
    eager = _decode(model, cache, lambda t, p: model.decode(t, p, cache))
    # a prefill (2 layers x 2 norms + the final one) and 3 steps of the same; each step's 2 layers write
    # their 3 rows in one call each (the prefill's chunks write their own)
    assert len(norms) == 4 * 5 and norms[-1] == (3, 128)
    assert writes == [(2, 3, 32)] * 3 * 2
    assert len(ropes) == 2 * 4 and ropes[-1] == (1, 3, 6, 32)  # the prefill's layers and 3 steps'
    eager_cache = cache.k.clone(), cache.v.clone()
    assert (eager_cache[0] != 0).sum() == (torchs_cache[0] != 0).sum()  # the same slots written
    cache.k.zero_()
    cache.v.zero_()
    traced = _decode(model, cache, TracedDecode(model, cache, 4))
    assert torch.equal(traced, eager)  # the trace runs the operators: the same bits, the same cache
    assert torch.equal(cache.k, eager_cache[0]) and torch.equal(cache.v, eager_cache[1])
    assert (eager.float() - torchs.float()).abs().max() < 0.02 * torchs.float().abs().max()
    model.use_layer_ops(None)
    norms.clear()
    writes.clear()
    ropes.clear()
    assert torch.equal(_decode(model, cache, lambda t, p: model.decode(t, p, cache)), torchs)
    assert not norms and not writes and not ropes


@needs_kernel
def test_the_compiled_step_keeps_torchs_norm(ops) -> None:
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    norm.ops = ops
    exported = torch.export.export(norm, (torch.ones(1, 64, dtype=torch.bfloat16),))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("engine_layer" in target for target in targets) and any("rsqrt" in t for t in targets)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert torch.equal(exported.module()(x), layer_ops.rms_norm(x, norm.weight, 1e-5))


@needs_kernel
def test_build_runner_serves_a_bfloat16_model_with_them_and_says_so() -> None:
    built = build_runner(EngineConfig(model="small", dtype="bfloat16", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    model = built.runner.model
    assert built.layer_ops_reason == LAYER_OPS_ON
    assert model.model.norm.ops is not None
    assert all(layer.input_layernorm.ops is not None and layer.post_attention_layernorm.ops is not None
               and layer.self_attn.ops is not None for layer in model.model.layers)
    built = build_runner(EngineConfig(model="small", dtype="float32", quantize="none", max_batch=4, max_context=128,
                                      compile_decode="off"), detect())
    assert built.runner.model.model.norm.ops is None
    assert built.layer_ops_reason == (f"{LAYER_OPS_OFF}: the engine's operators serve bfloat16 on a CPU, "
                                      "this is float32 on cpu")


def test_engine_ready_says_who_computes_them_and_why() -> None:
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--max-context", "64") as engine:
        [ready] = engine.events_named("engine_ready")
    assert ready["layer_ops"] == f"{LAYER_OPS_OFF}: the engine's operators serve bfloat16 on a CPU, this is float32 on cpu"


@needs_kernel  # where choose_layer_ops takes the operators, so that their load is tried
@pytest.mark.parametrize(("load", "error", "reason", "logged"), [
    ("raises", 0.0, "the engine's kernel failed (RuntimeError)", "RuntimeError"),
    ("loads", 0.5, "the engine's kernel was 0.5 off", "WrongResult"),
])
def test_operators_that_fail_to_load_or_to_check_leave_torchs_serving_and_say_why(
        monkeypatch: pytest.MonkeyPatch, load: str, error: float, reason: str, logged: str) -> None:
    # runtime/build.py's one path for the engine's own kernels (decode attention's takes it too)
    def failing_load(compiler: str, cache: object) -> layer_ops.LayerOps:
        if load == "raises":
            raise RuntimeError("g++ exited 1 building layer_ops.cpp")
        return layer_ops.LayerOps(layer_ops.rms_norm, apply_rope, lambda *args: None)

    monkeypatch.setattr(layer_ops, "load", failing_load)
    monkeypatch.setattr(layer_ops, "probe_error", lambda ops: error)
    with structlog.testing.capture_logs() as logs:
        ops, why = _load_layer_ops("bfloat16", "cpu", detect())
    assert ops is None and why == f"{LAYER_OPS_OFF}: {reason}"
    [event] = [e for e in logs if e["event"] == "layer_ops_failed"]
    assert event["error_type"] == logged and event["log_level"] == "warning"
