"""The float32 int4 kernel (engine_service/model/q4_matmul.py, q4_matmul.cpp): built with the
machine's compiler, it multiplies float32 rows by Q4_1 blocks as the dequantized float32 weights
would, at every row count its register tiles split into, refuses malformed operands by name, keeps
the packaged file's own values, serves a float32 model's traced steps with the unquantized model's
greedy tokens, and is chosen only where it can run."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
import torch.nn.functional as F

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.config import EngineConfig
from engine_service.machine.cpu import detect
from engine_service.machine.precision import choose_dynamic_head, find_cpp_compiler
from engine_service.model import native_build, q4_matmul
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.loader import load_model
from engine_service.model.quantize import Int4Weight, Int8Weight, Q4Weight, int4_groups, quantize_model, quantize_q4
from engine_service.runtime.model_runner import ModelRunner
from tests.checkpoints import engine_greedy
from tests.compiled_steps import compiled_tiny, greedy_of_both_steps
from tests.engines import EngineProcess

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(find_cpp_compiler() is None or not {"avx2", "fma"} <= detect().flags,
                                  reason="the kernel needs a C++ compiler and a CPU with AVX2 and FMA")


@pytest.fixture(scope="module")
def kernel() -> Path:
    # the engine's own compile cache: the library these tests load is the one their engines build, once
    compiler = find_cpp_compiler()
    assert compiler is not None
    return q4_matmul.load(compiler, cache_dir())


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    q, scale, low = int4_groups(weight)
    return (q * scale[..., None] + low[..., None]).view(weight.shape)


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 7, 8, 9, 16, 17, 24])
@pytest.mark.parametrize(("n", "k"), [(5, 32), (33, 96), (200, 576)])
def test_rows_times_q4_blocks_are_the_dequantized_float32_product(kernel: Path, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + n)
    weight, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
    copy = quantize_q4(weight)
    out = copy.matmul(x)
    reference = (x.double() @ dequantized(weight).double().t()).float()
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_model_shaped_call_of_more_dimensions_keeps_its_leading_ones(kernel: Path) -> None:
    weight, x = torch.randn(64, 64), torch.randn(1, 3, 64)
    out = quantize_q4(weight).matmul(x)
    assert out.shape == (1, 3, 64)
    torch.testing.assert_close(out, x @ dequantized(weight).t(), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("operands", "message"), [
    (lambda c: (torch.zeros(1, 64, dtype=torch.bfloat16), c.q, c.scales, c.lows), "x must be (rows, K) float32"),
    (lambda c: (torch.zeros(64), c.q, c.scales, c.lows), "x must be (rows, K) float32"),
    (lambda c: (torch.zeros(1, 48), c.q, c.scales, c.lows), "K must be a multiple of 32, got 48"),
    (lambda c: (torch.zeros(1, 96), c.q, c.scales, c.lows), "weights must be contiguous (N, K / 2) uint8 for K = 96"),
    (lambda c: (torch.zeros(1, 64), c.q.to(torch.int8), c.scales, c.lows), "weights must be contiguous"),
    (lambda c: (torch.zeros(1, 64), c.q, c.scales[:, :1].contiguous(), c.lows), "scales and lows must be"),
    (lambda c: (torch.zeros(1, 64), c.q, c.scales, c.lows.double()), "scales and lows must be"),
])
def test_malformed_operands_are_refused_by_name(kernel: Path, operands, message: str) -> None:
    copy = quantize_q4(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.engine_q4.matmul(*operands(copy))


def test_pack_puts_value_j_low_and_value_j_plus_16_high_as_q4_1_does() -> None:
    q = torch.arange(32).remainder(16).view(1, 32)  # values 0..15, 0..15
    packed = q4_matmul.pack(q)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8
    assert packed[0].tolist() == [j | (j << 4) for j in range(16)]
    q = torch.tensor([[1] * 16 + [2] * 16])
    assert q4_matmul.pack(q)[0].tolist() == [0x21] * 16


@needs_kernel
def test_the_packaged_files_layers_come_back_as_the_files_own_values(kernel: Path) -> None:
    # the packaged SmolLM2 is Q4_1: the float32 model holds the file's dequantized values, and
    # int4_groups recovers each block's scale, low and 4-bit values, so the copy is the same weight
    loaded = load_model("smollm2", CPU, torch.float32)
    loaded.model.pack_projections()
    for packed in loaded.model.projections()[:4]:  # q/k/v, o, gate/up, down
        assert packed.weight is not None
        x = torch.randn(3, packed.weight.shape[1])
        torch.testing.assert_close(quantize_q4(packed.weight).matmul(x), F.linear(x, packed.weight),
                                   rtol=1e-4, atol=1e-4)


def test_quantize_model_gives_a_float32_models_layers_q4_copies_and_leaves_the_head_int8() -> None:
    model = load_model("tiny", CPU, torch.float32).model
    model.pack_projections()
    quantize_model(model.projections(), "int4", int4_kernel="float32")
    *layers, head = model.projections()
    assert all(isinstance(p.quantized, Q4Weight) and p.quantized.max_rows == 24 for p in layers)
    assert isinstance(head.quantized, Int8Weight)
    bf16 = load_model("tiny", CPU, torch.bfloat16).model
    bf16.pack_projections()
    quantize_model(bf16.projections(), "int4", int4_kernel="float32")  # not float32: torch's kernel stays
    assert all(isinstance(p.quantized, Int4Weight) for p in bf16.projections()[:-1])


@needs_kernel
def test_a_float32_models_traced_steps_through_the_kernel_pick_the_float32_layers_tokens(kernel: Path) -> None:
    # the packaged Q4_1 file: its int4 copies are its own values, so against its float32 layers (the
    # same int8 head, eager) only the order of the sums differs
    runs = {}
    for q4 in (True, False):
        loaded = load_model("smollm2", CPU, torch.float32)
        runner = ModelRunner(loaded.model, 2, 64, CPU, torch.float32, "int4", trace_decode=q4, int4_kernel="float32")
        layers = loaded.model.projections()[:-1]
        assert all(isinstance(p.quantized, Q4Weight) for p in layers)
        if not q4:
            for packed in layers:
                packed.quantized = None
        prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
        runner.model.prefill(prompt, torch.tensor([6]), runner.cache, 0)
        token, tokens, logits = torch.tensor([314]), [], []
        for position in range(6, 22):
            out = runner._decode(token, torch.tensor([position]))
            token = out.argmax(-1)
            tokens.append(int(token))
            logits.append(out)
        runs[q4] = tokens, torch.cat(logits)
    assert runs[True][0] == runs[False][0]
    # the int8 head computes in bfloat16 (quantize.kernel_dtype): a last-bit change in its input can
    # move its rounding, 2 ** -8 of a logit near 16; a wrong product would move logits by whole units
    assert float((runs[True][1] - runs[False][1]).abs().max()) < 0.1


@needs_kernel
def test_an_engine_serving_float32_int4_runs_the_kernel_says_so_and_gives_its_tokens(kernel: Path) -> None:
    prompt = [197, 215, 20, 132, 248, 207]
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--quantize", "int4", "--max-context", "64",
                       "--int4-kernel", "engine") as engine, \
            EngineProcess("--model", "tiny", "--dtype", "float32", "--quantize", "int4", "--max-context", "64",
                          "--int4-kernel", "torch") as torch_kernel:
        model = load_model("tiny", CPU, torch.float32).model
        model.pack_projections()
        model.setup_rope(64, CPU)
        quantize_model(model.projections(), "int4", dynamic_head_bits=choose_dynamic_head("int4", "cpu", detect())[0],
                       int4_kernel="float32")
        assert all(isinstance(p.quantized, Q4Weight) for p in model.projections()[:-1])
        expected = engine_greedy(model, [prompt], 24, CPU)[0]
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=24, ignore_eos=True)
            tokens = [i for m in stub.Decode(request, timeout=60) for i in m.token_ids]
        with grpc.insecure_channel(torch_kernel.address) as channel:
            reason = engine_pb2_grpc.EngineServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(),
                                                                              timeout=5).precision_reason
    assert reason.endswith("int4 layers in torch's bfloat16 kernel: --int4-kernel torch")
    assert "int4 layers in the float32 int4 kernel (AVX2, built at start-up): --int4-kernel engine" in info.precision_reason
    assert (info.dtype, info.quantization) == ("float32", "int4")
    assert tokens == expected


@pytest.mark.skipif(not {"avx2", "fma"} <= detect().flags, reason="the kernel is chosen on CPUs with AVX2 and FMA only")
def test_a_kernel_that_fails_to_build_leaves_torchs_serving_and_says_why(tmp_path: Path) -> None:
    # `false` as the compiler: found on the PATH, exits 1 (a library keyed on it cannot be in the cache)
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--quantize", "int4", "--max-context", "64",
                       env={"CXX": "false", "ENGINE_COMPILE_CACHE": str(tmp_path)}) as engine:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=4, ignore_eos=True)
            assert sum(len(m.token_ids) for m in stub.Decode(request, timeout=60)) == 4
        [failed] = engine.events_named("q4_kernel_failed")
    assert info.precision_reason.endswith(
        "int4 layers in torch's bfloat16 kernel: the float32 one failed to build (RuntimeError)")
    assert failed["error_type"] == "RuntimeError" and "exited 1 building q4_matmul.cpp" in failed["error"]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_int4_kernel_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="int4_kernel must be one of auto, engine, int16, torch, got 'fast'"):
        EngineConfig(int4_kernel="fast")


def test_a_compiler_that_fails_raises_with_its_output(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited 1 building q4_matmul.cpp"):
        native_build.compile_library("false", tmp_path / "x.so", q4_matmul.KERNELS["float32"])
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


@needs_kernel
@pytest.mark.compile
def test_the_compiled_one_row_step_calls_the_kernel_and_follows_the_trace(
        kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    runner = compiled_tiny(torch.float32, "float32")
    assert all(isinstance(p.quantized, Q4Weight) for p in runner.model.projections()[:-1])
    picks = greedy_of_both_steps(runner)
    assert picks["compiled"] == picks["traced"]
