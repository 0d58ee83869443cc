"""The AMX int4 kernel (engine_service/model/q4_amx.cpp, q4_matmul.py): built with the machine's
compiler where the CPU has AMX for bfloat16, it multiplies bfloat16 rows by the int16 kernel's
copies as the model's bfloat16 weights would (each group widened with the loader's arithmetic, the
sums in float32, the output rounded to bfloat16), at every row count its 32-row passes and 8-group
spans split into, refuses malformed operands by name, serves the int16 copies' calls of 9 rows and
more where it is chosen, is chosen only where AMX runs, and says so in engine_ready."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import torch

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.machine.cpu import detect
from engine_service.machine.precision import choose_amx_int4, find_cpp_compiler
from engine_service.model import native_build, q4_matmul
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.loader import load_model
from engine_service.model.quantize import (
    AMX_INT4_MAX_ROWS,
    INT16_KERNEL_INT4_MAX_ROWS,
    Q4Int16Weight,
    int4_groups,
    quantize_int8,
    quantize_model,
    quantize_q4_int16,
    row_limits,
)
from engine_service.runtime.model_runner import ModelRunner
from tests.engines import EngineProcess

CPU = torch.device("cpu")
needs_amx = pytest.mark.skipif(
    find_cpp_compiler() is None or not choose_amx_int4("int16", detect()),
    reason="the AMX int4 kernel needs a C++ compiler and a CPU with AMX for bfloat16")


@pytest.fixture(scope="module")
def kernels() -> None:
    # the engine's own compile cache: the libraries these tests load are the ones their engines build, once
    compiler = find_cpp_compiler()
    assert compiler is not None
    q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["int16"])
    q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["int8"])
    q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["amx"])


def widened(weight: torch.Tensor) -> torch.Tensor:
    """The bfloat16 values the kernel widens the copy to: value x scale + low in float32 (float16
    scales and lows), a product then a sum as GGUF's loader computes them, rounded to bfloat16."""
    q, scale, low = int4_groups(weight)
    return (q * scale.half().float()[..., None] + low.half().float()[..., None]).view(weight.shape).to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 9, 16, 31, 32, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (32, 288), (208, 576)])
def test_rows_times_the_copies_are_the_widened_weights_product_rounded_to_bfloat16(
        kernels: None, rows: int, n: int, k: int) -> None:
    # n = 16 and 48: a lone last tile; k = 288: spans of 8 groups and one of 1; rows across 32-row passes
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=generator)
    copy = quantize_q4_int16(weight)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    out = torch.ops.engine_q4_amx.matmul(x, copy.q, copy.scales, copy.lows)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    ref = x.float() @ widened(weight).float().t()
    # products of bfloat16 values are exact in float32; the sums' order differs, and the output rounds
    largest = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3 * max(1.0, largest))


@needs_amx
def test_a_row_is_multiplied_the_same_whatever_rows_share_its_call(kernels: None) -> None:
    # each output row depends on its own row of x only: the padding of a partial pass is zeros
    generator = torch.Generator().manual_seed(5)
    copy = quantize_q4_int16(torch.randn(64, 256, generator=generator))
    x = torch.randn(70, 256, generator=generator).to(torch.bfloat16)
    whole = torch.ops.engine_q4_amx.matmul(x, copy.q, copy.scales, copy.lows)
    for start, stop in ((0, 1), (5, 38), (64, 70)):
        assert torch.equal(torch.ops.engine_q4_amx.matmul(x[start:stop], copy.q, copy.scales, copy.lows),
                           whole[start:stop])


@needs_amx
@pytest.mark.parametrize(("operands", "message"), [
    (lambda c: (torch.zeros(1, 64), c.q, c.scales, c.lows), "x must be (rows, K) bfloat16"),
    (lambda c: (torch.zeros(1, 48, dtype=torch.bfloat16), c.q, c.scales, c.lows), "K must be a multiple of 32, got 48"),
    (lambda c: (torch.zeros(1, 96, dtype=torch.bfloat16), c.q, c.scales, c.lows),
     "weights must be contiguous (N / 16, K / 8, 64) uint8 for K = 96"),
    (lambda c: (torch.zeros(1, 64, dtype=torch.bfloat16), c.q, c.scales, c.lows.float()),
     "scales and lows must be contiguous (N / 16, K / 32, 16) float16"),
])
def test_malformed_operands_are_refused_by_name(kernels: None, operands, message: str) -> None:
    copy = quantize_q4_int16(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="q4_amx_matmul: " + re.escape(message)):
        torch.ops.engine_q4_amx.matmul(*operands(copy))


@needs_amx
@pytest.mark.parametrize("bits", [16, 8])  # the int16 kernel's copies, or the int8 one's (the same bytes)
def test_the_int16_copies_send_calls_past_eight_rows_to_the_amx_kernel_where_they_serve_them(
        kernels: None, bits: int) -> None:
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    copy = quantize_q4_int16(weight, AMX_INT4_MAX_ROWS, amx=True, activation_bits=bits)
    plain = quantize_q4_int16(weight, activation_bits=bits)
    int16 = torch.ops.engine_q4_int16.matmul if bits == 16 else torch.ops.engine_q4_int8.matmul
    amx = torch.ops.engine_q4_amx.matmul
    for rows, op, without in ((INT16_KERNEL_INT4_MAX_ROWS, int16, int16), (INT16_KERNEL_INT4_MAX_ROWS + 1, amx, int16),
                              (40, amx, int16)):
        x = torch.randn(1, rows, 64, generator=generator).to(torch.bfloat16)  # a model's (1, M, K)
        assert torch.equal(copy.matmul(x), op(x[0], copy.q, copy.scales, copy.lows).unsqueeze(0))
        assert torch.equal(plain.matmul(x), without(x[0], copy.q, copy.scales, copy.lows).unsqueeze(0))
    assert not torch.equal(amx(x[0], copy.q, copy.scales, copy.lows), int16(x[0], copy.q, copy.scales, copy.lows))


def test_quantize_model_gives_the_int16_copies_the_amx_rows_where_asked() -> None:
    for amx_rows, served in ((0, INT16_KERNEL_INT4_MAX_ROWS), (AMX_INT4_MAX_ROWS, AMX_INT4_MAX_ROWS)):
        model = load_model("tiny", CPU, torch.bfloat16).model
        model.pack_projections()
        quantize_model(model.projections(), "int4", int4_kernel="int16", amx_rows=amx_rows)
        layers = model.projections()[:-1]
        assert all(isinstance(p.quantized, Q4Int16Weight) and p.quantized.max_rows == served
                   and p.quantized.amx == (amx_rows > 0) for p in layers)
    # a smaller amx_rows than the int16 kernel's own never narrows it; other kernels ignore it
    model = load_model("tiny", CPU, torch.bfloat16).model
    model.pack_projections()
    quantize_model(model.projections(), "int4", int4_kernel="int16", amx_rows=4)
    assert {(p.quantized.max_rows, p.quantized.amx) for p in model.projections()[:-1]} == {  # type: ignore[union-attr]
        (INT16_KERNEL_INT4_MAX_ROWS, False)}
    model = load_model("tiny", CPU, torch.bfloat16).model
    model.pack_projections()
    quantize_model(model.projections(), "int4", int4_kernel="torch", amx_rows=AMX_INT4_MAX_ROWS)
    assert {p.quantized.max_rows for p in model.projections()[:-1]} == {8}  # type: ignore[union-attr]


@needs_amx
def test_the_start_up_probe_passes_both_kernels_that_read_the_int16_layout(kernels: None) -> None:
    for name in ("amx", "int16"):
        assert q4_matmul.probe_error(q4_matmul.KERNELS[name]) < q4_matmul.PROBE_TOLERANCE


def _prompt_logits(widen: bool, amx_rows: int) -> torch.Tensor:
    """The tiny model's logits for a prompt of 24 tokens (calls of 24 rows), its bfloat16 weights
    replaced by their int4 groups' values where `widen` (as a Q4_1 file's are), served in int4 with
    the int16 copies serving up to `amx_rows` rows."""
    model = load_model("tiny", CPU, torch.bfloat16).model
    if widen:
        with torch.no_grad():
            for layer in model.model.layers:
                for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    linear.weight.copy_(widened(linear.weight.float()))
    runner = ModelRunner(model, 2, 64, CPU, torch.bfloat16, "int4", int4_kernel="int16", amx_rows=amx_rows)
    return runner.model.prefill(torch.arange(3, 27).unsqueeze(0), torch.tensor([24]), runner.cache, 0).float()


@needs_amx
def test_a_prompt_through_the_amx_kernel_multiplies_the_int4_values_as_the_bfloat16_weights_would(
        kernels: None) -> None:
    # without amx_rows a 24-row call multiplies the bfloat16 weights (oneDNN); with it, the int4
    # copies on AMX tiles: the logits of the weights' own int4 values, not of the random weights
    exact = _prompt_logits(widen=True, amx_rows=0)
    tolerance = {"rtol": 0.02, "atol": 0.02 * float(exact.abs().max())}
    torch.testing.assert_close(_prompt_logits(widen=False, amx_rows=AMX_INT4_MAX_ROWS), exact, **tolerance)
    torch.testing.assert_close(_prompt_logits(widen=True, amx_rows=AMX_INT4_MAX_ROWS), exact, **tolerance)
    with pytest.raises(AssertionError):  # the random weights themselves: another model, so the check above means something
        torch.testing.assert_close(_prompt_logits(widen=False, amx_rows=0), exact, **tolerance)


@needs_amx
def test_an_engine_serving_bfloat16_int4_on_amx_says_so_and_serves_a_long_prompt(kernels: None) -> None:
    with EngineProcess("--model", "tiny", "--dtype", "bfloat16", "--quantize", "int4", "--max-context", "128",
                       "--int4-kernel", "engine") as engine:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=list(range(3, 63))), max_new_tokens=4,
                                       ignore_eos=True)
            assert sum(len(m.token_ids) for m in stub.Decode(request, timeout=60)) == 4
    assert f"calls of 9-{AMX_INT4_MAX_ROWS} rows of the int4 layers on AMX tiles" in info.precision_reason
    assert engine.events_named("amx_kernel_failed") == []


def test_the_kernels_library_is_kept_apart_from_the_others_in_the_cache(tmp_path: Path) -> None:
    paths = {name: native_build.library_path(tmp_path, "g++", kernel) for name, kernel in q4_matmul.KERNELS.items()}
    assert len(set(paths.values())) == 4 and paths["amx"].name.startswith("q4_amx-")


@needs_amx
def test_traced_decode_steps_take_the_int16_kernel_up_to_eight_rows_and_the_amx_kernel_past_them(kernels: None) -> None:
    # a trace bakes in the kernel its example's rows took: traced as 16 rows alone, an 8-row step
    # would run on AMX tiles (a 32-row pass and every group widened) instead of the int16 kernel
    model = load_model("tiny", CPU, torch.bfloat16).model
    runner = ModelRunner(model, 16, 64, CPU, torch.bfloat16, "int4", trace_decode=True, int4_kernel="int16",
                         amx_rows=AMX_INT4_MAX_ROWS)
    assert runner._decode.regimes == 3  # type: ignore[attr-defined]  # <= 4 rows (the int8 head), <= 8, <= 16
    for rows in (3, 8, 9, 16):
        tokens = torch.arange(3, 3 + rows)
        positions = torch.full((rows,), 2)
        traced = runner._decode(tokens, positions)  # type: ignore[operator]
        assert torch.equal(traced, model.decode(tokens, positions, runner.cache)), rows


def test_row_limits_name_where_a_copy_changes_kernel() -> None:
    weight = torch.randn(32, 64).to(torch.bfloat16)
    assert row_limits(quantize_q4_int16(weight)) == (INT16_KERNEL_INT4_MAX_ROWS,)
    assert row_limits(quantize_q4_int16(weight, AMX_INT4_MAX_ROWS, amx=True)) == (INT16_KERNEL_INT4_MAX_ROWS,
                                                                                  AMX_INT4_MAX_ROWS)
    assert row_limits(quantize_int8(weight, 4)) == (4,)
