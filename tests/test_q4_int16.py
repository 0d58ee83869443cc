"""The int16 and int8 int4 kernels (engine_service/model/q4_matmul.py, q4_int16.cpp's two builds):
built with the machine's compiler where the CPU has AVX-512 VNNI and BF16, each multiplies bfloat16
rows by Q4_1 groups as the dequantized weights would (the rows quantized to 16 or 8 bits a group,
the output rounded to bfloat16), at every row count its register tiles split into, refuses
malformed operands by name, reads the 4-bit values as they are laid out, serves a bfloat16 model's
steps (the int16 one with the float32 layers' greedy tokens), and is chosen only where it can run."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import torch

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.machine.cpu import detect
from engine_service.machine.precision import INT16_KERNEL_FLAGS, find_cpp_compiler
from engine_service.model import int4_race, native_build, q4_matmul
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.loader import load_model
from engine_service.model.quantize import (
    Int4Weight,
    Int8Weight,
    Q4Int16Weight,
    int4_groups,
    quantize_model,
    quantize_q4_int16,
)
from engine_service.runtime.model_runner import ModelRunner
from tests.compiled_steps import compiled_tiny, greedy_of_both_steps, logits_of_both_steps
from tests.engines import EngineProcess
from tests.test_quantize import AGREEMENT, TEXT, _text_logits

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    find_cpp_compiler() is None or not INT16_KERNEL_FLAGS <= detect().flags or not detect().capability.startswith("AVX512"),
    reason="the int16 int4 kernel needs a C++ compiler and a CPU with AVX-512 VNNI and BF16")


@pytest.fixture(scope="module")
def kernel() -> Path:
    # the engine's own compile cache: the library these tests load is the one their engines build, once
    compiler = find_cpp_compiler()
    assert compiler is not None
    return q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["int16"])


@pytest.fixture(scope="module")
def int8_kernel() -> Path:
    compiler = find_cpp_compiler()
    assert compiler is not None
    return q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["int8"])


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weights the kernel's copy stands for: its 4-bit values times its float16 scales, plus its lows."""
    q, scale, low = int4_groups(weight)
    return (q * scale.half().float()[..., None] + low.half().float()[..., None]).view(weight.shape)


@needs_kernel
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (208, 576)])
def test_rows_times_q4_groups_are_the_dequantized_product_rounded_to_bfloat16(
        kernel: Path, int8_kernel: Path, bits: int, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k).bfloat16()
    x[:, :32] *= 40  # groups of very different ranges: each is quantized with its own scale
    out = quantize_q4_int16(weight, activation_bits=bits).matmul(x)
    w = dequantized(weight).double()
    reference = x.double() @ w.t()
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # what the kernel may differ by: bfloat16's rounding of the output (2 ** -9 of it) and the rows'
    # quantization (half a step, a group's largest |x| / 32767 or / 127, times each weight it meets);
    # one 4-bit value off by one, or one input paired with another's value, moves a sum far more
    step = x.double().abs().view(rows, k // 32, 32).amax(-1).repeat_interleave(32, dim=1) / (2 ** (bits - 1) - 1)
    bound = reference.abs() * 2 ** -8 + (step / 2) @ w.abs().t() + 1e-6
    assert bool(((out.double() - reference).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5])
def test_the_int8_kernel_reads_each_input_against_its_own_value(int8_kernel: Path, rows: int) -> None:
    # one input at a time (a one-hot row, exactly representable at 8 bits): the product is that
    # input's column of the dequantized weights, so an input paired with another's nibble shows
    weight = torch.randn(32, 64) * 0.05
    copy, w = quantize_q4_int16(weight, activation_bits=8), dequantized(weight)
    for i in range(64):
        x = torch.zeros(rows, 64, dtype=torch.bfloat16)
        x[:, i] = 1.0
        # (d = 1 / 127 in float32 times 127 is 1 within 2^-23: the bfloat16 output within one rounding)
        torch.testing.assert_close(copy.matmul(x).float(), w[:, i].expand(rows, -1), rtol=2 ** -8, atol=1e-6)


@needs_kernel
def test_a_model_shaped_call_of_more_dimensions_keeps_its_leading_ones(kernel: Path) -> None:
    weight, x = torch.randn(64, 64), torch.randn(1, 3, 64).bfloat16()
    out = quantize_q4_int16(weight).matmul(x)
    assert out.shape == (1, 3, 64) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (x.float() @ dequantized(weight).t()), rtol=2 ** -7, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize(("operands", "message"), [
    (lambda c: (torch.zeros(1, 64), c.q, c.scales, c.lows), "x must be (rows, K) bfloat16"),
    (lambda c: (torch.zeros(64, dtype=torch.bfloat16), c.q, c.scales, c.lows), "x must be (rows, K) bfloat16"),
    (lambda c: (torch.zeros(1, 48, dtype=torch.bfloat16), c.q, c.scales, c.lows), "K must be a multiple of 32, got 48"),
    (lambda c: (torch.zeros(1, 96, dtype=torch.bfloat16), c.q, c.scales, c.lows),
     "weights must be contiguous (N / 16, K / 8, 64) uint8 for K = 96"),
    (lambda c: (torch.zeros(1, 64, dtype=torch.bfloat16), c.q.to(torch.int8), c.scales, c.lows), "weights must be contiguous"),
    (lambda c: (torch.zeros(1, 64, dtype=torch.bfloat16), c.q, c.scales[:, :1].contiguous(), c.lows),
     "scales and lows must be contiguous (N / 16, K / 32, 16) float16"),
    (lambda c: (torch.zeros(1, 64, dtype=torch.bfloat16), c.q, c.scales, c.lows.float()), "scales and lows must be"),
])
@pytest.mark.parametrize("bits", [16, 8])
def test_malformed_operands_are_refused_by_name(kernel: Path, int8_kernel: Path, operands, message: str,
                                                bits: int) -> None:
    copy = quantize_q4_int16(torch.randn(32, 64))
    op = torch.ops.engine_q4_int16.matmul if bits == 16 else torch.ops.engine_q4_int8.matmul
    with pytest.raises(RuntimeError, match=f"q4_int{bits}_matmul: " + re.escape(message)):
        op(*operands(copy))


def test_pack_int16_puts_a_rows_eight_inputs_in_two_words_of_four_nibbles() -> None:
    # row l's value at input i is 16 * l + i (mod 16, so every nibble is told apart by its row and input)
    n, k = 16, 32
    q = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :]).remainder(16)
    scales, lows = torch.rand(n, k // 32), torch.rand(n, k // 32)
    values, s, lo = q4_matmul.pack_int16(q, scales, lows)
    assert values.shape == (1, k // 8, 64) and values.dtype == torch.uint8
    words = values.view(1, k // 8, 32, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)  # little-endian 16-bit words
    for octet in range(k // 8):
        for row in range(n):
            for p in range(2):
                word = int(words[0, octet, 2 * row + p])
                assert [(word >> (4 * i)) & 0xF for i in range(4)] == \
                    [int(q[row, octet * 8 + 2 * i + p]) for i in range(4)]
    assert s.shape == lo.shape == (1, 1, 16) and s.dtype == lo.dtype == torch.float16
    assert s[0, 0].tolist() == scales[:, 0].half().tolist() and lo[0, 0].tolist() == lows[:, 0].half().tolist()


def test_the_packaged_files_layers_are_kept_exactly_in_float16_scales_and_lows() -> None:
    # GGUF's Q4_1 stores each block's scale and low in float16, so the copy's float16 ones lose nothing
    model = load_model("smollm2", CPU, torch.float32).model
    model.pack_projections()
    for packed in model.projections()[:-1]:
        assert packed.weight is not None
        assert torch.equal(dequantized(packed.weight), packed.weight)


@pytest.mark.parametrize(("n", "k"), [(24, 32), (16, 40)])
def test_pack_int16_refuses_a_shape_its_tiles_cannot_hold_by_name(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"N a multiple of 16 and K of 32, got a {n}x{k} weight"):
        q4_matmul.pack_int16(torch.zeros(n, k, dtype=torch.int64), torch.zeros(n, 1), torch.zeros(n, 1))


@pytest.mark.parametrize(("name", "bits", "rows"), [("int16", 16, 8), ("int8", 8, 32)])
def test_quantize_model_gives_a_bfloat16_models_layers_int16_copies_and_leaves_the_head_int8(
        name: str, bits: int, rows: int) -> None:
    model = load_model("tiny", CPU, torch.bfloat16).model
    model.pack_projections()
    quantize_model(model.projections(), "int4", int4_kernel=name)
    *layers, head = model.projections()
    assert all(isinstance(p.quantized, Q4Int16Weight) and (p.quantized.max_rows, p.quantized.activation_bits,
                                                           p.quantized.amx) == (rows, bits, False) for p in layers)
    assert isinstance(head.quantized, Int8Weight)
    float32 = load_model("tiny", CPU, torch.float32).model
    float32.pack_projections()
    quantize_model(float32.projections(), "int4", int4_kernel="int16")  # not bfloat16: torch's kernel stays
    assert all(isinstance(p.quantized, Int4Weight) for p in float32.projections()[:-1])


def test_an_unknown_int4_kernel_name_is_refused_by_quantize_model() -> None:
    model = load_model("tiny", CPU, torch.bfloat16).model
    model.pack_projections()
    with pytest.raises(ValueError, match="int4_kernel must be one of torch, float32, int16, int8, got 'int4'"):
        quantize_model(model.projections(), "int4", int4_kernel="int4")


@needs_kernel
def test_a_bfloat16_models_traced_steps_through_the_kernel_pick_the_float32_layers_tokens(kernel: Path) -> None:
    # the packaged Q4_1 file: the kernel's copies hold its own values and scales in float32, and the
    # rows' 16-bit quantization is far finer than bfloat16's, so its greedy tokens are the float32
    # model's over this prompt (torch's int4 kernel rounds the scales to bfloat16)
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    tokens = {}
    for dtype, int4_kernel in ((torch.bfloat16, "int16"), (torch.float32, "torch")):
        loaded = load_model("smollm2", CPU, dtype)
        runner = ModelRunner(loaded.model, 2, 64, CPU, dtype, "int4", trace_decode=True, int4_kernel=int4_kernel)
        if dtype == torch.bfloat16:
            assert all(isinstance(p.quantized, Q4Int16Weight) for p in loaded.model.projections()[:-1])
        else:  # the float32 layers themselves
            for packed in loaded.model.projections():
                packed.quantized = None
        runner.model.prefill(prompt, torch.tensor([6]), runner.cache, 0)
        token, picks = torch.tensor([314]), []
        for position in range(6, 22):
            token = runner._decode(token, torch.tensor([position])).argmax(-1)
            picks.append(int(token))
        tokens[int4_kernel] = picks
    assert tokens["int16"] == tokens["torch"]


# SmolLM2 over test_quantize's TEXT (97 positions), against its unquantized bfloat16 model, on an AMD
# EPYC of family 25 model 17: the int16 kernel's layers (with the int8 head) top-1 0.969, largest
# logit error 1.00; the int8 kernel's 0.959 and 1.59 (over the text twice, 194 positions: 0.985 and
# 1.44, 0.974 and 1.59). The bounds are test_quantize's for int4 layers.
@needs_kernel
@pytest.mark.parametrize("name", ["int16", "int8"])
def test_the_kernels_logits_agree_with_the_unquantized_model_on_english_text(
        kernel: Path, int8_kernel: Path, name: str) -> None:
    loaded = load_model("smollm2", CPU, torch.bfloat16)
    ids = loaded.tokenizer.encode(TEXT)
    loaded.model.pack_projections()
    loaded.model.setup_rope(len(ids), CPU)
    reference = _text_logits(loaded.model, ids)
    quantize_model(loaded.model.projections(), "int4", max_rows=len(ids), int4_kernel=name)  # every row in it
    assert all(isinstance(p.quantized, Q4Int16Weight) and p.quantized.activation_bits == int(name[3:])
               for p in loaded.model.projections()[:-1])
    quantized = _text_logits(loaded.model, ids)
    agreement = (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item()
    error = (quantized - reference).abs().max().item()
    least, most = AGREEMENT["int4"]
    assert agreement >= least, f"{name}: top-1 agreement {agreement:.3f}"
    assert error <= most, f"{name}: largest logit error {error:.2f}"


@needs_kernel
def test_an_engine_serving_bfloat16_int4_runs_the_kernel_and_says_so(kernel: Path) -> None:
    common = ("--model", "tiny", "--dtype", "bfloat16", "--quantize", "int4", "--max-context", "64")
    with EngineProcess(*common, "--int4-kernel", "engine") as engine, \
            EngineProcess(*common, "--int4-kernel", "int16") as int16, \
            EngineProcess(*common, "--int4-kernel", "torch") as torch_kernel:
        infos = []
        for running in (engine, int16, torch_kernel):
            with grpc.insecure_channel(running.address) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                infos.append(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5))
                request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=[197, 215, 20]), max_new_tokens=12,
                                           ignore_eos=True)
                assert sum(len(m.token_ids) for m in stub.Decode(request, timeout=60)) == 12
        assert engine.events_named("q4_kernel_raced") == int16.events_named("q4_kernel_raced") == []  # no race
    assert ("int4 layers in the int8 int4 kernel (AVX-512 VNNI, 8-bit activations a group of 32, built at "
            "start-up): --int4-kernel engine" in infos[0].precision_reason)
    assert ("int4 layers in the int16 int4 kernel (AVX-512 VNNI, built at start-up): --int4-kernel int16"
            in infos[1].precision_reason)
    assert infos[2].precision_reason.endswith("int4 layers in torch's int4 kernel: --int4-kernel torch")
    assert all((info.dtype, info.quantization) == ("bfloat16", "int4") for info in infos)


@needs_kernel
def test_auto_races_the_kernel_against_torchs_and_serves_the_winner_with_the_times(kernel: Path) -> None:
    with EngineProcess("--model", "tiny", "--dtype", "bfloat16", "--quantize", "int4", "--max-context", "64") as engine:
        with grpc.insecure_channel(engine.address) as channel:
            reason = engine_pb2_grpc.EngineServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(),
                                                                              timeout=5).precision_reason
        [raced] = engine.events_named("q4_kernel_raced")
        [ready] = engine.events_named("engine_ready")
    assert raced["kernel"] == "int8" and raced["rows"] == 32
    assert len(raced["ours_us"]) == len(raced["torch_us"]) == 2 and min(raced["ours_us"] + raced["torch_us"]) > 0
    figures = (r"(\d+) / (\d+) us against torch's (\d+) / (\d+) for the model's gate/up at 1 / 32 rows, in a "
               r"start-up race")
    if raced["kept"]:
        found = re.search(r"int4 layers in the int8 int4 kernel \(AVX-512 VNNI, 8-bit activations a group of 32, "
                          r"built at start-up\): " + figures, reason)
    else:
        found = re.search(r"int4 layers in torch's int4 kernel: the int8 one took " + figures, reason)
    assert found, reason
    # the reason's whole microseconds are the logged times (to a tenth)
    for said, logged in zip(map(int, found.groups()), raced["ours_us"] + raced["torch_us"], strict=True):
        assert abs(said - logged) <= 0.6
    assert ready["precision_reason"] == reason


@needs_kernel
@pytest.mark.parametrize("name", ["int16", "int8"])
def test_a_race_times_both_kernels_on_the_models_own_shape(kernel: Path, int8_kernel: Path, name: str) -> None:
    config = load_model("tiny", CPU, torch.bfloat16).config
    result = int4_race.race(name, config, torch.bfloat16)
    assert (result.kernel, result.rows) == (name, {"int16": 8, "int8": 32}[name])  # the copies' rows
    assert min(result.ours_us + result.torch_us) > 0


@pytest.mark.skipif(find_cpp_compiler() is None, reason="needs a C++ compiler")
def test_the_two_kernels_libraries_are_kept_apart_in_the_cache(tmp_path: Path) -> None:
    compiler = find_cpp_compiler()
    assert compiler is not None
    paths = {name: native_build.library_path(tmp_path, compiler, kernel) for name, kernel in q4_matmul.KERNELS.items()}
    assert paths["float32"].name.startswith("q4_matmul-") and paths["int16"].name.startswith("q4_int16-")
    assert paths["int8"].name.startswith("q4_int16-")  # the same source, built with its own define
    assert len({paths["float32"], paths["int16"], paths["int8"]}) == 3


@needs_kernel
@pytest.mark.compile
def test_the_compiled_one_row_step_calls_the_int16_kernel_and_follows_the_trace(
        kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    runner = compiled_tiny(torch.bfloat16, "int16")
    assert all(isinstance(p.quantized, Q4Int16Weight) for p in runner.model.projections()[:-1])
    picks = greedy_of_both_steps(runner)
    assert picks["compiled"] == picks["traced"]


@needs_kernel
@pytest.mark.compile
def test_the_compiled_one_row_step_calls_the_int8_kernel_and_follows_the_traces_logits(
        int8_kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the tiny model's random weights leave its top two logits as little as 0.004 apart (in a range
    # of 0.54), and the compiled step's fused code rounds otherwise than the trace's (0.003-0.004 at
    # most, with either kernel): at 8 bits a rounding moved a row's quantization enough to flip a
    # greedy pick at the fifth step, so the two are held to each other's logits on the same tokens
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    runner = compiled_tiny(torch.bfloat16, "int8")
    assert all(isinstance(p.quantized, Q4Int16Weight) and p.quantized.activation_bits == 8
               for p in runner.model.projections()[:-1])
    logits = logits_of_both_steps(runner, [9, 29, 253, 24, 77, 184, 210, 3, 50, 60])
    scale = logits["traced"].abs().max().item()
    assert (logits["compiled"] - logits["traced"]).abs().max().item() <= 0.02 * scale  # 0.7% measured
