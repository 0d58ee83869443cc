"""`--dtype auto` / `--quantize auto`: the CPU as read from /proc/cpuinfo and torch, and the table
that turns it and the file into a precision (engine_service/machine/cpu.py, engine_service/machine/precision.py)."""

from __future__ import annotations

import shutil
import sys

import pytest

from engine_service.config import EngineConfig
from engine_service.machine import precision
from engine_service.machine.cpu import CpuInfo, detect, parse_cpuinfo
from engine_service.machine.precision import (
    choose_amx_int4,
    choose_compiled_decode,
    choose_decode_attention,
    choose_dtype,
    choose_dynamic_head,
    choose_layer_ops,
    choose_onednn_weights,
    choose_prompt_attention,
    choose_q4_kernel,
    choose_quantize,
    find_cpp_compiler,
    keep_prompt_attention,
    keep_q4_kernel,
    onednn_bfloat16,
    onednn_layout_rows,
)
from engine_service.model.gguf_checkpoint import weight_format
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.presets import PACKAGED

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2 sha_ni
processor\t: 1
model name\t: something else
flags\t\t: fpu avx512f avx512_bf16
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 fma avx512f avx512dq avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def cpu(text: str, capability: str, isa: str = "") -> CpuInfo:
    name, flags = parse_cpuinfo(text)
    return CpuInfo(model_name=name, capability=capability, flags=flags, onednn_max_isa=isa)


def test_cpuinfo_is_read_from_the_first_processor() -> None:
    name, flags = parse_cpuinfo(EPYC)
    assert name == "AMD EPYC 7B13"
    assert flags == {"avx2", "fma"}  # the second processor's avx512 flags are not this one's
    assert parse_cpuinfo("") == ("", frozenset())


@pytest.mark.parametrize(("text", "capability", "isa", "kind", "native"), [
    (EPYC, "AVX2", "", "avx2", False),
    (XEON, "AVX512", "", "amx", True),
    (XEON, "AVX2", "", "avx2", False),  # ATEN_CPU_CAPABILITY=avx2 lowers torch's dispatch
    (XEON, "AVX512", "AVX2", "avx512", False),  # ONEDNN_MAX_CPU_ISA=AVX2 lowers oneDNN's
    (XEON, "AVX512", "AVX512_CORE_AMX", "amx", True),
    (XEON.replace(" amx_bf16", ""), "AVX512", "", "avx512_bf16", True),
    (EPYC, "DEFAULT", "", "other", False),
])
def test_the_machine_class(text: str, capability: str, isa: str, kind: str, native: bool) -> None:
    info = cpu(text, capability, isa)
    assert info.kind == kind
    assert info.native_bf16 is native


def test_describe_names_capability_flags_and_model() -> None:
    assert cpu(XEON, "AVX512").describe() == (
        "AVX512 [avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8] (Intel(R) Xeon(R) Processor)")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in cpu(XEON, "AVX512", "AVX2").describe()


def test_this_machine_is_detected() -> None:
    info = detect()
    assert info.capability and info.model_name
    assert info.kind in ("amx", "avx512_bf16", "avx512", "avx2", "other")


@pytest.mark.parametrize(("text", "capability", "device", "dtype"), [
    (XEON, "AVX512", "cpu", "bfloat16"),
    (EPYC, "AVX2", "cpu", "float32"),
    (XEON, "AVX2", "cpu", "float32"),
    (EPYC, "AVX2", "cuda:0", "bfloat16"),
])
def test_auto_dtype_follows_native_bfloat16(text: str, capability: str, device: str, dtype: str) -> None:
    chosen, reason = choose_dtype("auto", device, cpu(text, capability))
    assert chosen == dtype
    assert reason.startswith(f"dtype {dtype}: auto")


def test_an_explicit_dtype_wins() -> None:
    assert choose_dtype("bfloat16", "cpu", cpu(EPYC, "AVX2")) == ("bfloat16", "dtype bfloat16: asked for")
    assert choose_dtype("float32", "cpu", cpu(XEON, "AVX512"))[0] == "float32"


@pytest.mark.parametrize(("fmt", "method"), [
    ("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8"), ("Q5_K", "int8"), ("Q6_K", "int8"),
    ("F32", "none"), ("F16", "none"), ("BF16", "none"), ("safetensors", "none"), ("random", "none"),
])
def test_auto_quantize_serves_the_files_own(fmt: str, method: str) -> None:
    chosen, reason = choose_quantize("auto", "cpu", fmt)
    assert chosen == method
    assert fmt in reason


ZEN4 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16
"""


@pytest.mark.parametrize(("text", "capability", "quantize", "device", "bits"), [
    (ZEN4, "AVX512", "int4", "cpu", 8),
    (XEON, "AVX512", "int8", "cpu", 8),
    (XEON.replace(" avx512_vnni", ""), "AVX512", "int4", "cpu", 8),  # AMX's int8 tiles
    (XEON.replace(" avx512_vnni", "").replace(" amx_int8", ""), "AVX512", "int4", "cpu", 7),
    (EPYC, "AVX2", "int4", "cpu", 7),  # AVX2 alone: 8-bit weights' 16-bit pair sums could saturate
    (EPYC, "DEFAULT", "int4", "cpu", 0),  # below AVX2 fbgemm does not run
    (ZEN4, "AVX512", "none", "cpu", 0),  # nothing quantized, the head stays in the model's dtype
    (ZEN4, "AVX512", "int4", "cuda:0", 0),
])
def test_the_lm_head_multiplies_8_bit_activations_with_weights_whose_pair_sums_cannot_saturate(
        text: str, capability: str, quantize: str, device: str, bits: int) -> None:
    chosen, reason = choose_dynamic_head(quantize, device, cpu(text, capability))
    assert chosen == bits and not isinstance(chosen, bool)
    if quantize == "none" or device != "cpu":
        assert reason == ""
    elif bits == 8:
        assert reason == "LM head int8 x 8-bit activations (fbgemm): the CPU has 8-bit dot products (VNNI/AMX)"
    elif bits == 7:
        assert reason == ("LM head 7-bit weights x 8-bit activations (fbgemm): the CPU has no VNNI/AMX 8-bit dot "
                          "products, and 7-bit weights keep fbgemm's 16-bit pair sums from saturating")
    else:
        assert reason == "LM head int8 weight-only: the CPU's vector capability is DEFAULT, below fbgemm's AVX2"


def test_only_bfloat16_weights_on_a_cpu_whose_onednn_runs_bfloat16_are_prepacked(monkeypatch) -> None:
    assert choose_onednn_weights("bfloat16", "cpu") is onednn_bfloat16()  # this machine's answer
    # and as a CPU whose oneDNN runs bfloat16 answers, whatever this one is (on plain AVX2 the
    # dtype and device tests were never reached: mutants of them survived there)
    monkeypatch.setattr(precision, "onednn_bfloat16", lambda: True)
    assert choose_onednn_weights("bfloat16", "cpu") is True
    assert choose_onednn_weights("bfloat16", "cpu:0") is True
    assert choose_onednn_weights("float32", "cpu") is False
    assert choose_onednn_weights("float16", "cpu") is False
    assert choose_onednn_weights("bfloat16", "cuda:0") is False


def test_auto_quantize_is_none_on_cuda_and_explicit_wins() -> None:
    assert choose_quantize("auto", "cuda", "Q4_1")[0] == "none"
    assert choose_quantize("none", "cpu", "Q4_1") == ("none", "quantize none: asked for")
    assert choose_quantize("int8", "cpu", "F32")[0] == "int8"


@pytest.mark.parametrize(("requested", "device", "quantize", "traced", "compiler", "on", "reason"), [
    ("auto", "cpu", "int4", True, "/usr/bin/g++", True,
     "compile-decode on: auto, one-row steps through AOTInductor's library (/usr/bin/g++)"),
    ("auto", "cpu", "int8", True, "/usr/bin/c++", True,
     "compile-decode on: auto, one-row steps through AOTInductor's library (/usr/bin/c++)"),
    ("off", "cpu", "int4", True, "/usr/bin/g++", False, "compile-decode off: asked for"),
    ("auto", "cuda", "none", True, "/usr/bin/g++", False,
     "compile-decode off: auto on cuda (the compiled step is measured on CPUs only)"),
    ("auto", "cpu", "none", True, "/usr/bin/g++", False,
     "compile-decode off: auto with quantize none (the library would copy every weight)"),
    ("auto", "cpu", "int4", False, "/usr/bin/g++", False,
     "compile-decode off: auto with --no-trace-decode (the eager step was asked for)"),
    ("auto", "cpu", "int4", True, None, False,
     "compile-decode off: auto, no C++ compiler for AOTInductor (g++, or $CXX)"),
])
def test_the_compiled_decode_step_runs_on_a_cpu_for_quantized_models_with_a_compiler(
        requested: str, device: str, quantize: str, traced: bool, compiler: str | None, on: bool, reason: str) -> None:
    assert choose_compiled_decode(requested, device, quantize, traced, compiler) == (on, reason)


def test_the_cpp_compiler_is_cxx_where_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert find_cpp_compiler() is None
    monkeypatch.setenv("CXX", sys.executable)
    assert find_cpp_compiler() == sys.executable
    monkeypatch.delenv("CXX")
    assert find_cpp_compiler() == shutil.which("g++")


def test_an_unknown_compile_decode_is_refused_by_name() -> None:
    assert EngineConfig().compile_decode == "auto"
    with pytest.raises(ValueError, match="compile_decode must be one of auto, off, got 'on'"):
        EngineConfig(compile_decode="on")


def test_the_packaged_files_layers_are_q4_1() -> None:
    assert weight_format(read_gguf(PACKAGED["smollm2"].locate("smollm2"))) == "Q4_1"


def test_auto_is_the_default_and_refusals_name_the_value() -> None:
    assert (EngineConfig().dtype, EngineConfig().quantize) == ("auto", "auto")
    EngineConfig(dtype="float32", quantize="int4")  # float32 activations are cast for the kernel
    with pytest.raises(ValueError, match="quantize int4 needs dtype bfloat16, float32 or auto, got 'float16'"):
        EngineConfig(dtype="float16", quantize="int4")
    with pytest.raises(ValueError, match="quantize int8 runs on the CPU only.*'cuda'"):
        EngineConfig(device="cuda", quantize="int8")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int8, int4, got 'q4'"):
        EngineConfig(quantize="q4")


def test_the_cuda_reasons_are_exact() -> None:
    assert choose_dtype("auto", "cuda:0", cpu(EPYC, "AVX2")) == ("bfloat16", "dtype bfloat16: auto on CUDA")
    assert choose_quantize("auto", "cuda", "Q4_1") == (
        "none", "quantize none: auto on CUDA (the weight-only kernels are CPU ones)")


# --int4-kernel: which of the engine's int4 kernels a model's int4 layers may take, and the race's answer

def avx2(flags: str) -> CpuInfo:
    return CpuInfo(model_name="AMD EPYC", capability="AVX2", flags=frozenset(flags.split()), onednn_max_isa="")


@pytest.mark.parametrize(("requested", "quantize", "dtype", "device", "flags", "compiler", "answer"), [
    ("auto", "int4", "float32", "cpu", "avx2 fma", "/usr/bin/g++",
     ("float32", "int4 layers in the float32 int4 kernel (AVX2, built at start-up)")),
    ("engine", "int4", "float32", "cpu", "avx2 fma", "/usr/bin/g++",
     ("float32", "int4 layers in the float32 int4 kernel (AVX2, built at start-up): --int4-kernel engine")),
    ("torch", "int4", "float32", "cpu", "avx2 fma", "/usr/bin/g++",
     ("torch", "int4 layers in torch's bfloat16 kernel: --int4-kernel torch")),
    ("auto", "int4", "float32", "cpu", "avx2", "/usr/bin/g++",
     ("torch", "int4 layers in torch's bfloat16 kernel: the float32 int4 kernel needs AVX2 and FMA")),
    ("auto", "int4", "float32", "cpu", "avx2 fma", None,
     ("torch", "int4 layers in torch's bfloat16 kernel: no C++ compiler ($CXX, g++) to build the float32 one")),
    ("auto", "int4", "bfloat16", "cpu", "avx2 fma", "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: the int8 int4 kernel needs AVX-512 VNNI and BF16")),
    ("torch", "int4", "bfloat16", "cpu", "avx2 fma", "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: --int4-kernel torch")),
    ("auto", "int4", "float16", "cpu", "avx2 fma", "/usr/bin/g++", ("torch", "")),
    ("auto", "int8", "float32", "cpu", "avx2 fma", "/usr/bin/g++", ("torch", "")),
    ("auto", "none", "float32", "cpu", "avx2 fma", "/usr/bin/g++", ("torch", "")),
    ("auto", "int4", "float32", "cuda", "avx2 fma", "/usr/bin/g++", ("torch", "")),
])
def test_the_kernel_serves_a_float32_models_int4_layers_where_avx2_fma_and_a_compiler_are(
        requested: str, quantize: str, dtype: str, device: str, flags: str, compiler: str | None,
        answer: tuple[str, str]) -> None:
    assert choose_q4_kernel(requested, quantize, dtype, device, avx2(flags), compiler) == answer


def avx512(flags: str, capability: str = "AVX512") -> CpuInfo:
    return CpuInfo(model_name="AMD EPYC", capability=capability, flags=frozenset(flags.split()), onednn_max_isa="")


ZEN4 = "avx2 fma avx512f avx512_vnni avx512_bf16"


INT8_ON = "int4 layers in the int8 int4 kernel (AVX-512 VNNI, 8-bit activations a group of 32, built at start-up)"
INT16_ON = "int4 layers in the int16 int4 kernel (AVX-512 VNNI, built at start-up)"


@pytest.mark.parametrize(("requested", "dtype", "cpu", "compiler", "answer"), [
    ("auto", "bfloat16", avx512(ZEN4), "/usr/bin/g++", ("int8", INT8_ON)),
    ("auto", "bfloat16", avx512(f"{ZEN4} amx_bf16 amx_int8"), "/usr/bin/g++", ("int8", INT8_ON)),
    ("engine", "bfloat16", avx512(ZEN4), "/usr/bin/g++", ("int8", f"{INT8_ON}: --int4-kernel engine")),
    ("int16", "bfloat16", avx512(ZEN4), "/usr/bin/g++", ("int16", f"{INT16_ON}: --int4-kernel int16")),
    ("torch", "bfloat16", avx512(ZEN4), "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: --int4-kernel torch")),
    ("auto", "bfloat16", avx512("avx2 fma avx512f avx512_bf16"), "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: the int8 int4 kernel needs AVX-512 VNNI and BF16")),
    ("auto", "bfloat16", avx512("avx2 fma avx512f avx512_vnni"), "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: the int8 int4 kernel needs AVX-512 VNNI and BF16")),
    ("int16", "bfloat16", avx512("avx2 fma avx512f avx512_vnni"), "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: the int16 int4 kernel needs AVX-512 VNNI and BF16")),
    # the flags, but torch's dispatch held to AVX2 (ATEN_CPU_CAPABILITY): the machine is served as AVX2
    ("auto", "bfloat16", avx512(ZEN4, capability="AVX2"), "/usr/bin/g++",
     ("torch", "int4 layers in torch's int4 kernel: the int8 int4 kernel needs AVX-512 VNNI and BF16")),
    ("auto", "bfloat16", avx512(ZEN4), None,
     ("torch", "int4 layers in torch's int4 kernel: no C++ compiler ($CXX, g++) to build the int8 one")),
    ("int16", "bfloat16", avx512(ZEN4), None,
     ("torch", "int4 layers in torch's int4 kernel: no C++ compiler ($CXX, g++) to build the int16 one")),
    ("auto", "float32", avx512(ZEN4), "/usr/bin/g++",
     ("float32", "int4 layers in the float32 int4 kernel (AVX2, built at start-up)")),
    # a float32 model's layers have the one engine kernel: int16 asks for it without the race, as engine does
    ("int16", "float32", avx512(ZEN4), "/usr/bin/g++",
     ("float32", "int4 layers in the float32 int4 kernel (AVX2, built at start-up): --int4-kernel int16")),
])
def test_the_int8_kernel_serves_a_bfloat16_models_int4_layers_where_vnni_bf16_and_a_compiler_are(
        requested: str, dtype: str, cpu: CpuInfo, compiler: str | None, answer: tuple[str, str]) -> None:
    assert choose_q4_kernel(requested, "int4", dtype, "cpu", cpu, compiler) == answer


def test_the_races_answer_names_the_winner_and_the_times() -> None:
    assert keep_q4_kernel("int16", (24.4, 125.0), (59.3, 265.5), 8) == (
        "int16", "int4 layers in the int16 int4 kernel (AVX-512 VNNI, built at start-up): 24 / 125 us against "
                 "torch's 59 / 266 for the model's gate/up at 1 / 8 rows, in a start-up race")
    assert keep_q4_kernel("float32", (140.0, 1200.0), (97.0, 800.0), 24) == (
        "torch", "int4 layers in torch's bfloat16 kernel: the float32 one took 140 / 1200 us against torch's "
                 "97 / 800 for the model's gate/up at 1 / 24 rows, in a start-up race")


@pytest.mark.parametrize(("ours", "theirs", "faster"), [
    ((10.0, 100.0), (20.0, 100.0), True),  # faster at one row, level at 8
    ((30.0, 40.0), (20.0, 100.0), True),  # 1.5x slower at one row, 2.5x faster at 8: the mean wins
    ((10.0, 300.0), (20.0, 100.0), False),  # 2x faster at one row, 3x slower at 8
    ((20.0, 100.0), (20.0, 100.0), False),  # level: torch's kernel stays
])
def test_the_race_keeps_the_engines_kernel_where_its_ratios_geometric_mean_is_below_one(
        ours: tuple[float, float], theirs: tuple[float, float], faster: bool) -> None:
    assert (keep_q4_kernel("int16", ours, theirs, 8)[0] == "int16") is faster


@pytest.mark.parametrize(("text", "capability", "isa", "rows"), [
    (XEON, "AVX512", "", 64),  # AMX runs the chunks' and prompts' bfloat16 matmuls
    (XEON, "AVX512", "AVX512_CORE_AMX", 64),
    (XEON, "AVX512", "ALL", 64),
    (XEON, "AVX512", "AVX512_CORE_BF16", 1),  # oneDNN held below AMX
    (XEON, "AVX2", "", 1),
    (EPYC, "AVX2", "", 1),
])
def test_the_onednn_copies_are_laid_out_for_64_rows_where_amx_runs_them(text: str, capability: str, isa: str,
                                                                         rows: int) -> None:
    assert onednn_layout_rows(cpu(text, capability, isa)) == rows


@pytest.mark.parametrize(("kernel", "flags", "isa", "chosen"), [
    ("int16", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "", True),
    ("int16", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX", True),
    ("int16", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "ALL", True),
    ("int16", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", False),  # oneDNN held below AMX
    ("int16", {"avx512f", "avx512_vnni", "avx512_bf16"}, "", False),  # no AMX (Zen 4)
    ("int8", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "", True),  # the same copies
    ("int8", {"avx512f", "avx512_vnni", "avx512_bf16"}, "", False),
    ("torch", {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}, "", False),  # the race kept torch's kernel
    ("float32", {"avx2", "fma", "amx_bf16"}, "", False),
])
def test_the_amx_kernel_is_chosen_only_beside_the_int16_or_int8_kernel_where_amx_runs(
        kernel: str, flags: set[str], isa: str, chosen: bool) -> None:
    cpu = CpuInfo(capability="AVX512", flags=frozenset(flags), model_name="test", onednn_max_isa=isa)
    assert choose_amx_int4(kernel, cpu) is chosen


OFF = "torch's scaled_dot_product_attention"
ON = "the engine's kernel (AVX2, built at start-up)"
ON_BF16 = "the engine's kernel (AVX-512 BF16, built at start-up)"


@pytest.mark.parametrize(("dtype", "device", "cpu", "compiler", "dim", "group", "answer"), [
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 64, 3, ("avx512_bf16", ON_BF16)),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 128, 16, ("avx512_bf16", ON_BF16)),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 128, 1, ("avx512_bf16", ON_BF16)),
    ("bfloat16", "cpu:0", avx512(ZEN4), "/usr/bin/g++", 64, 3, ("avx512_bf16", ON_BF16)),
    # AVX-512 without its bfloat16 dot products, or the flag without AVX-512 F: the AVX2 build
    ("bfloat16", "cpu", avx512("avx2 fma avx512f avx512_vnni"), "/usr/bin/g++", 64, 3, ("avx2", ON)),
    ("bfloat16", "cpu", avx512("avx2 fma avx512_bf16"), "/usr/bin/g++", 64, 3, ("avx2", ON)),
    ("bfloat16", "cpu", avx2("avx2 fma"), "/usr/bin/g++", 64, 3, ("avx2", ON)),
    ("bfloat16", "cpu", avx2("avx2"), "/usr/bin/g++", 64, 3, (None, f"{OFF}: the engine's kernel needs AVX2 and FMA")),
    ("bfloat16", "cpu", avx2("fma"), "/usr/bin/g++", 64, 3, (None, f"{OFF}: the engine's kernel needs AVX2 and FMA")),
    ("bfloat16", "cpu", avx512(ZEN4), None, 64, 3,
     (None, f"{OFF}: no C++ compiler ($CXX, g++) to build the engine's kernel")),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 96, 3,
     (None, f"{OFF}: the engine's kernel takes heads of 64 or 128 values and 1-16 query heads a KV head, the model "
             "has 96 and 3")),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 64, 17,
     (None, f"{OFF}: the engine's kernel takes heads of 64 or 128 values and 1-16 query heads a KV head, the model "
             "has 64 and 17")),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 64, 0,
     (None, f"{OFF}: the engine's kernel takes heads of 64 or 128 values and 1-16 query heads a KV head, the model "
             "has 64 and 0")),
    ("float32", "cpu", avx512(ZEN4), "/usr/bin/g++", 64, 3,
     (None, f"{OFF}: the engine's kernel serves bfloat16 on a CPU, this is float32 on cpu")),
    ("bfloat16", "cuda", avx512(ZEN4), "/usr/bin/g++", 64, 3,
     (None, f"{OFF}: the engine's kernel serves bfloat16 on a CPU, this is bfloat16 on cuda")),
])
def test_decode_attention_takes_the_kernels_build_the_cpu_runs_for_bfloat16_where_a_compiler_is(
        dtype: str, device: str, cpu: CpuInfo, compiler: str | None, dim: int, group: int,
        answer: tuple[str | None, str]) -> None:
    assert choose_decode_attention(dtype, device, cpu, compiler, dim, group) == answer


PROMPT_OFF, PROMPT_ON = "torch's scaled_dot_product_attention", "the engine's kernel (AVX-512 BF16, built at start-up)"


@pytest.mark.parametrize(("dtype", "device", "cpu", "compiler", "dim", "answer"), [
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 64, (True, PROMPT_ON)),
    ("bfloat16", "cpu:0", avx512(ZEN4), "/usr/bin/g++", 128, (True, PROMPT_ON)),
    ("bfloat16", "cpu", avx512("avx512f avx512_bf16"), "/usr/bin/g++", 64, (True, PROMPT_ON)),  # those two suffice
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 16,
     (False, f"{PROMPT_OFF}: the engine's kernel takes heads of 64 or 128 values, the model has 16")),
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", 96,
     (False, f"{PROMPT_OFF}: the engine's kernel takes heads of 64 or 128 values, the model has 96")),
    ("bfloat16", "cpu", avx512("avx2 fma avx512f avx512_vnni"), "/usr/bin/g++", 64,
     (False, f"{PROMPT_OFF}: the engine's kernel needs AVX-512 BF16 (bfloat16 dot products)")),
    ("bfloat16", "cpu", avx2("avx2 fma avx512_bf16"), "/usr/bin/g++", 64,
     (False, f"{PROMPT_OFF}: the engine's kernel needs AVX-512 BF16 (bfloat16 dot products)")),
    ("bfloat16", "cpu", avx512(ZEN4), None, 64,
     (False, f"{PROMPT_OFF}: no C++ compiler ($CXX, g++) to build the engine's kernel")),
    ("float32", "cpu", avx512(ZEN4), "/usr/bin/g++", 64,
     (False, f"{PROMPT_OFF}: the engine's kernel serves bfloat16 on a CPU, this is float32 on cpu")),
    ("bfloat16", "cuda", avx512(ZEN4), "/usr/bin/g++", 64,
     (False, f"{PROMPT_OFF}: the engine's kernel serves bfloat16 on a CPU, this is bfloat16 on cuda")),
])
def test_prompt_attention_is_the_engines_for_bfloat16_on_a_cpu_with_avx512_bf16_and_a_compiler(
        dtype: str, device: str, cpu: CpuInfo, compiler: str | None, dim: int, answer: tuple[bool, str]) -> None:
    assert choose_prompt_attention(dtype, device, cpu, compiler, dim) == answer


@pytest.mark.parametrize(("ours", "theirs", "kept"), [
    ((1244.4, 631.7), (4696.2, 1439.1), True),  # measured on a Zen 4: faster at both
    ((100.0, 300.0), (200.0, 100.0), False),  # twice as fast at one, three times as slow at the other
    ((100.0, 140.0), (300.0, 100.0), True),  # a third of the time at one, 1.4x at the other
    ((100.0, 200.0), (200.0, 100.0), False),  # a geometric mean of exactly 1: torch's stays
    ((300.0, 100.0), (200.0, 100.0), False),
])
def test_prompt_attention_is_kept_where_its_ratios_geometric_mean_is_below_one(
        ours: tuple[float, float], theirs: tuple[float, float], kept: bool) -> None:
    figures = (f"{ours[0]:.0f} / {ours[1]:.0f} us against torch's {theirs[0]:.0f} / {theirs[1]:.0f} for a layer's "
               "512 tokens from 0 / 64 at 1024, in a start-up race")
    assert keep_prompt_attention(ours, theirs, 512, 64, 1024) == (
        (True, f"{PROMPT_ON}: {figures}") if kept else (False, f"{PROMPT_OFF}: the engine's kernel took {figures}"))


LAYER_OFF, LAYER_ON = "torch's operators", "the engine's operators (AVX2, built at start-up)"


@pytest.mark.parametrize(("dtype", "device", "cpu", "compiler", "answer"), [
    ("bfloat16", "cpu", avx512(ZEN4), "/usr/bin/g++", (True, LAYER_ON)),
    ("bfloat16", "cpu:0", avx2("avx2 fma"), "/usr/bin/g++", (True, LAYER_ON)),
    ("bfloat16", "cpu", avx2("avx2"), "/usr/bin/g++", (False, f"{LAYER_OFF}: the engine's operators need AVX2 and FMA")),
    ("bfloat16", "cpu", avx2("fma"), "/usr/bin/g++", (False, f"{LAYER_OFF}: the engine's operators need AVX2 and FMA")),
    ("bfloat16", "cpu", avx512(ZEN4), None,
     (False, f"{LAYER_OFF}: no C++ compiler ($CXX, g++) to build the engine's operators")),
    ("float32", "cpu", avx512(ZEN4), "/usr/bin/g++",
     (False, f"{LAYER_OFF}: the engine's operators serve bfloat16 on a CPU, this is float32 on cpu")),
    ("float16", "cpu", avx512(ZEN4), "/usr/bin/g++",
     (False, f"{LAYER_OFF}: the engine's operators serve bfloat16 on a CPU, this is float16 on cpu")),
    ("bfloat16", "cuda", avx512(ZEN4), "/usr/bin/g++",
     (False, f"{LAYER_OFF}: the engine's operators serve bfloat16 on a CPU, this is bfloat16 on cuda")),
])
def test_a_layers_small_operators_are_the_engines_for_bfloat16_on_a_cpu_with_avx2_fma_and_a_compiler(
        dtype: str, device: str, cpu: CpuInfo, compiler: str | None, answer: tuple[bool, str]) -> None:
    assert choose_layer_ops(dtype, device, cpu, compiler) == answer
