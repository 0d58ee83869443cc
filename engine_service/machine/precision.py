"""`--dtype auto` and `--quantize auto`: the precision a model is served in, chosen from the machine
and the file, and the reason, which `engine_ready` and ServerInfo carry.

The table, from measurements of SmolLM2-135M with 2 threads (README, "Precision"):

- dtype (weights, activations and KV cache). CUDA: bfloat16. A CPU with native bfloat16
  (`avx512_bf16` or AMX, see cpu.py): bfloat16, whose matmuls run on the matrix units (on a Xeon
  with AMX, prefill 1.4-2.1x float32's tokens/s). Any other CPU: float32, because bfloat16 there is
  emulated (on an EPYC with AVX2 a bfloat16 prefill took 12 ms a token, 4.7x float32's).
- quantize: the file's own quantization served by the matching weight-only kernel, for the decode
  steps of few rows that are bound by reading the weights: Q4_0, Q4_1 and Q4_K weights -> int4
  (groups of 32, Q4_1's layout), Q8_0, Q5_K and Q6_K -> int8 (more than 4 bits: int4 would lose
  what the file kept), F32/F16/BF16 files, Hugging Face checkpoints and random presets -> none.
  On CUDA, none (the kernels are CPU ones). Prefill and large batches keep the unquantized weights
  in `dtype` (quantize.py).

- the LM head of a quantized model: int8 multiplied with 8-bit activations by fbgemm where the CPU
  has 8-bit dot products accumulating in 32 bits (VNNI or AMX: cpu.py `int8_dot`), 2.7x faster
  than int8 weight-only at one row on a Zen 4 (model/quantize.py); on plain AVX2 the same with
  7-bit weights, whose pair sums cannot saturate (1.9x faster at one row, 3.6x at 8, on an AVX2
  EPYC); elsewhere (no AVX2, where fbgemm does not run) int8 weight-only.
- bfloat16 layer weights on a CPU where oneDNN runs bfloat16: a copy prepacked for oneDNN, the bits
  of `F.linear` without its per-call reorder (model/llama.py `Packed.pack_onednn`); float32 weights
  never (their `F.linear` is another library's kernel, and float32 stays bit-identical to
  transformers).

- a bfloat16 model's decoding rows' attention on a CPU with AVX2 and FMA: the engine's kernel
  (model/decode_attention.py), which reads each row's keys in place up to its length instead of
  torch's flash kernel's small matrix products (decode steps 0.67-0.88x on the Xeon 207); float32
  keeps torch's, bit-identical to transformers.

- the decode step of one row compiled by AOTInductor (model/compiled_decode.py) on a CPU, for a
  quantized model (with quantize none the library would hold a copy of every weight), where a C++
  compiler is found; the others keep the traced step.

Every explicit `--dtype` / `--quantize` / `--compile-decode` wins over the table.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

from engine_service.machine.cpu import CpuInfo

AUTO = "auto"
INT4_FORMATS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
INT8_FORMATS = frozenset({"Q8_0", "Q5_K", "Q6_K"})


@dataclass(frozen=True)
class Precision:
    dtype: str  # float32, bfloat16 or float16
    quantize: str  # none, int8 or int4
    reason: str  # why, in words, for engine_ready and ServerInfo


def choose_dtype(requested: str, device: str, cpu: CpuInfo) -> tuple[str, str]:
    """(dtype, reason) for `--dtype requested` on `device`."""
    if requested != AUTO:
        return requested, f"dtype {requested}: asked for"
    if device.startswith("cuda"):
        return "bfloat16", "dtype bfloat16: auto on CUDA"
    if cpu.native_bf16:
        return "bfloat16", f"dtype bfloat16: auto, the CPU ({cpu.kind}) runs bfloat16 matmuls natively"
    return "float32", (f"dtype float32: auto, the CPU ({cpu.kind}) has no avx512_bf16/amx_bf16 (or they are "
                       f"disabled), so bfloat16 arithmetic would be emulated, several times slower")


def choose_quantize(requested: str, device: str, weight_format: str) -> tuple[str, str]:
    """(quantize, reason) for `--quantize requested` of weights stored as `weight_format` (a GGUF
    tensor type such as "Q4_1", or "safetensors", "random")."""
    if requested != AUTO:
        return requested, f"quantize {requested}: asked for"
    if device.startswith("cuda"):
        return "none", "quantize none: auto on CUDA (the weight-only kernels are CPU ones)"
    if weight_format in INT4_FORMATS:
        return "int4", f"quantize int4: auto, the file's {weight_format} weights served by the int4 kernel for decode"
    if weight_format in INT8_FORMATS:
        return "int8", f"quantize int8: auto, the file's {weight_format} weights served by the int8 kernel for decode"
    return "none", f"quantize none: auto, the weights are {weight_format}"


def choose_dynamic_head(quantize: str, device: str, cpu: CpuInfo) -> tuple[int, str]:
    """(the bits of the LM head's int8 weights when it multiplies 8-bit activations, 0 for the
    weight-only head; reason) for a model served with `quantize` on `device`."""
    if quantize == "none" or not device.startswith("cpu"):
        return 0, ""
    if cpu.int8_dot:
        return 8, "LM head int8 x 8-bit activations (fbgemm): the CPU has 8-bit dot products (VNNI/AMX)"
    if cpu.kind != "other":  # AVX2 or AVX-512: fbgemm runs
        return 7, ("LM head 7-bit weights x 8-bit activations (fbgemm): the CPU has no VNNI/AMX 8-bit dot "
                   "products, and 7-bit weights keep fbgemm's 16-bit pair sums from saturating")
    return 0, f"LM head int8 weight-only: the CPU's vector capability is {cpu.capability}, below fbgemm's AVX2"


Q4_KERNEL_ON = "int4 layers in the float32 int4 kernel (AVX2, built at start-up)"  # choose_q4_kernel's float32
# choose_q4_kernel's int16
Q4_INT16_KERNEL_ON = "int4 layers in the int16 int4 kernel (AVX-512 VNNI, built at start-up)"
# choose_q4_kernel's int8
Q4_INT8_KERNEL_ON = "int4 layers in the int8 int4 kernel (AVX-512 VNNI, 8-bit activations a group of 32, built at start-up)"
INT16_KERNEL_FLAGS = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})  # the int8 kernel's too
KERNEL_ON = {"float32": Q4_KERNEL_ON, "int16": Q4_INT16_KERNEL_ON, "int8": Q4_INT8_KERNEL_ON}
# torch's int4 kernel, as a float32 model's calls meet it (cast to bfloat16) and as a bfloat16 model's do
TORCH_INT4 = {"float32": "torch's bfloat16 kernel", "int16": "torch's int4 kernel", "int8": "torch's int4 kernel"}


def choose_q4_kernel(requested: str, quantize: str, dtype: str, device: str, cpu: CpuInfo,
                     compiler: str | None) -> tuple[str, str]:
    """(who multiplies the int4 layers, quantize.INT4_KERNELS: torch, float32, int16 or int8, the
    engine's kernels in model/q4_matmul.py; reason, "" where the question does not arise) for
    `--int4-kernel requested` (auto, engine, int16 or torch) of a model in `dtype` served with
    `quantize`: a float32 model's layers in the float32 kernel on a CPU with AVX2 and FMA, a bfloat16
    model's in the int8 one on a CPU with AVX-512 VNNI and BF16 (torch's own dispatch at AVX-512),
    where a compiler can build them; `int16`: a bfloat16 model's in the int16 one, its rows at 16
    bits rather than 8 (a float32 model's as with engine). With auto, the kernel named still has to
    win the start-up race (`keep_q4_kernel`)."""
    if quantize != "int4" or dtype not in ("float32", "bfloat16") or not device.startswith("cpu"):
        return "torch", ""
    if dtype == "float32":
        kernel, needs, needed = "float32", {"avx2", "fma"}, "AVX2 and FMA"
    else:
        kernel, needs, needed = "int16" if requested == "int16" else "int8", INT16_KERNEL_FLAGS, "AVX-512 VNNI and BF16"
    on, mine, theirs = KERNEL_ON[kernel], f"the {kernel}", TORCH_INT4[kernel]
    if requested == "torch":
        return "torch", f"int4 layers in {theirs}: --int4-kernel torch"
    if not needs <= cpu.flags or (kernel != "float32" and not cpu.capability.startswith("AVX512")):
        return "torch", f"int4 layers in {theirs}: {mine} int4 kernel needs {needed}"
    if compiler is None:
        return "torch", f"int4 layers in {theirs}: no C++ compiler ($CXX, g++) to build {mine} one"
    return kernel, on if requested == "auto" else f"{on}: --int4-kernel {requested}"


def keep_q4_kernel(kernel: str, ours_us: tuple[float, float], torch_us: tuple[float, float],
                   rows: int) -> tuple[str, str]:
    """(who multiplies the int4 layers, reason) after the start-up race (model/int4_race.py) of the
    engine's `kernel` (float32, int16 or int8) against torch's int4 kernel, from their times a call at one
    row and at `rows`: the engine's kernel where the geometric mean of its two ratios to torch's is
    below 1 (one stream and a full batch of its rows weigh alike), with the times."""
    figures = (f"{ours_us[0]:.0f} / {ours_us[1]:.0f} us against torch's {torch_us[0]:.0f} / {torch_us[1]:.0f} "
               f"for the model's gate/up at 1 / {rows} rows, in a start-up race")
    if (ours_us[0] / torch_us[0]) * (ours_us[1] / torch_us[1]) < 1:
        return kernel, f"{KERNEL_ON[kernel]}: {figures}"
    return "torch", f"int4 layers in {TORCH_INT4[kernel]}: the {kernel} one took {figures}"


# choose_amx_int4's answer where it serves
AMX_INT4_ON = "calls of 9-{rows} rows of the int4 layers on AMX tiles (the AMX int4 kernel, built at start-up)"


def choose_amx_int4(kernel: str, cpu: CpuInfo) -> bool:
    """Whether the int16 or int8 kernel's copies (`kernel`, choose_q4_kernel's answer after the race) also
    serve calls of more rows than it takes (decode steps of 9-32 rows, short prompts, small mixed
    steps) through the AMX int4 kernel (model/q4_amx.cpp), instead of the full bfloat16 weights:
    where the CPU runs AMX for bfloat16 (`amx_bf16`, with oneDNN's ISA not held below it). Measured
    on the Xeon 207 with AMX (quantize.AMX_INT4_MAX_ROWS has the figures): traced decode steps of
    9-32 rows 0.79x."""
    return kernel in ("int16", "int8") and amx_bfloat16(cpu)


DECODE_ATTENTION_OFF = "torch's scaled_dot_product_attention"  # choose_decode_attention's refusals begin so
DECODE_ATTENTION_ON = {"avx2": "the engine's kernel (AVX2, built at start-up)",
                       "avx512_bf16": "the engine's kernel (AVX-512 BF16, built at start-up)"}
DECODE_ATTENTION_BF16_FLAGS = frozenset({"avx512f", "avx512_bf16"})


def choose_decode_attention(dtype: str, device: str, cpu: CpuInfo, compiler: str | None, head_dim: int,
                            group: int) -> tuple[str | None, str]:
    """(the build of the engine's decode attention kernel that computes the decoding rows' attention,
    a key of model/decode_attention.KERNELS, or None for torch's scaled_dot_product_attention; the
    reason, which engine_ready's `decode_attention` carries) for a model in `dtype` whose heads have
    `head_dim` values and `group` query heads a KV head: a bfloat16 model on a CPU with AVX2 and FMA,
    where a compiler can build it; the AVX-512 BF16 build where the CPU dots bfloat16 pairs (its keys
    read without widening: 0.61-0.73x the AVX2 build's time a layer on an AMD EPYC of the Zen 4
    class, docs/decode-speed.md). Not float32, whose decoding stays bit-identical to transformers'
    attention arithmetic."""
    if dtype != "bfloat16" or not device.startswith("cpu"):
        return None, f"{DECODE_ATTENTION_OFF}: the engine's kernel serves bfloat16 on a CPU, this is {dtype} on {device}"
    if head_dim not in (64, 128) or not 1 <= group <= 16:  # decode_attention.cpp's instantiations and arrays
        return None, (f"{DECODE_ATTENTION_OFF}: the engine's kernel takes heads of 64 or 128 values and 1-16 "
                      f"query heads a KV head, the model has {head_dim} and {group}")
    if not {"avx2", "fma"} <= cpu.flags:
        return None, f"{DECODE_ATTENTION_OFF}: the engine's kernel needs AVX2 and FMA"
    if compiler is None:
        return None, f"{DECODE_ATTENTION_OFF}: no C++ compiler ($CXX, g++) to build the engine's kernel"
    build = "avx512_bf16" if DECODE_ATTENTION_BF16_FLAGS <= cpu.flags else "avx2"
    return build, DECODE_ATTENTION_ON[build]


PROMPT_ATTENTION_OFF = "torch's scaled_dot_product_attention"  # choose_prompt_attention's refusals begin so
PROMPT_ATTENTION_ON = "the engine's kernel (AVX-512 BF16, built at start-up)"


def choose_prompt_attention(dtype: str, device: str, cpu: CpuInfo, compiler: str | None,
                            head_dim: int) -> tuple[bool, str]:
    """(whether the engine's prompt attention kernel, model/prompt_attention.py, computes prompt
    chunks' attention instead of torch's scaled_dot_product_attention; the reason, which
    engine_ready's `prompt_attention` carries): a bfloat16 model whose heads have 64 or 128 values,
    on a CPU that dots bfloat16 pairs (AVX-512 BF16), where a compiler can build it. torch's CPU
    kernel multiplies bfloat16 at float32's rate: where the CPU has no faster bfloat16 products
    there is nothing for this one to win; where it can, a start-up race decides
    (keep_prompt_attention). Not float32, whose prompts stay bit-identical to transformers'
    attention arithmetic."""
    if dtype != "bfloat16" or not device.startswith("cpu"):
        return False, f"{PROMPT_ATTENTION_OFF}: the engine's kernel serves bfloat16 on a CPU, this is {dtype} on {device}"
    if head_dim not in (64, 128):  # prompt_attention.cpp's instantiations
        return False, f"{PROMPT_ATTENTION_OFF}: the engine's kernel takes heads of 64 or 128 values, the model has {head_dim}"
    if not DECODE_ATTENTION_BF16_FLAGS <= cpu.flags:
        return False, f"{PROMPT_ATTENTION_OFF}: the engine's kernel needs AVX-512 BF16 (bfloat16 dot products)"
    if compiler is None:
        return False, f"{PROMPT_ATTENTION_OFF}: no C++ compiler ($CXX, g++) to build the engine's kernel"
    return True, PROMPT_ATTENTION_ON


def keep_prompt_attention(ours_us: tuple[float, float], torch_us: tuple[float, float], tokens: int, chunk: int,
                          depth: int) -> tuple[bool, str]:
    """(whether the engine's prompt attention kernel serves, reason) after its start-up race
    (model/prompt_attention.race) against torch's scaled_dot_product_attention, from their times
    a layer for a `tokens` prompt from position 0 and a `chunk` chunk at `depth`: the kernel where the
    geometric mean of its two ratios to torch's is below 1, with the times."""
    figures = (f"{ours_us[0]:.0f} / {ours_us[1]:.0f} us against torch's {torch_us[0]:.0f} / {torch_us[1]:.0f} "
               f"for a layer's {tokens} tokens from 0 / {chunk} at {depth}, in a start-up race")
    if (ours_us[0] / torch_us[0]) * (ours_us[1] / torch_us[1]) < 1:
        return True, f"{PROMPT_ATTENTION_ON}: {figures}"
    return False, f"{PROMPT_ATTENTION_OFF}: the engine's kernel took {figures}"


LAYER_OPS_OFF = "torch's operators"  # choose_layer_ops's refusals begin so
LAYER_OPS_ON = "the engine's operators (AVX2, built at start-up)"


def choose_layer_ops(dtype: str, device: str, cpu: CpuInfo, compiler: str | None) -> tuple[bool, str]:
    """(whether the engine's operators for a layer's norms, rotary embeddings and cache writes,
    model/layer_ops.py, serve outside the compiled step, instead of runs of torch's operators; the
    reason, which engine_ready's `layer_ops` carries): a bfloat16 model on a CPU with AVX2 and FMA,
    where a compiler can build them. Not float32, whose decoding stays bit-identical to transformers'."""
    if dtype != "bfloat16" or not device.startswith("cpu"):
        return False, f"{LAYER_OPS_OFF}: the engine's operators serve bfloat16 on a CPU, this is {dtype} on {device}"
    if not {"avx2", "fma"} <= cpu.flags:
        return False, f"{LAYER_OPS_OFF}: the engine's operators need AVX2 and FMA"
    if compiler is None:
        return False, f"{LAYER_OPS_OFF}: no C++ compiler ($CXX, g++) to build the engine's operators"
    return True, LAYER_OPS_ON


def choose_onednn_weights(dtype: str, device: str) -> bool:
    """Whether the layers' weights in `dtype` get a copy prepacked for oneDNN on `device`."""
    return dtype == "bfloat16" and device.startswith("cpu") and onednn_bfloat16()


def onednn_layout_rows(cpu: CpuInfo) -> int:
    """The row count the prepacked copies are laid out for (oneDNN picks a blocked layout by it).
    They serve calls of tens to thousands of rows (chunks, prompts; decode steps run the int4
    copies or a trace). Where AMX runs bfloat16 a layout for 64 rows: one for 1 row ran SmolLM2's
    layers 1.2-1.6x slower at 16 to 2,000 rows, and whole chunk steps 0.86-0.98x (Xeon 207, the
    layouts alternating), and its products at 40-300 rows rounded apart from F.linear's, which the
    64-row layout's equal; elsewhere 1, what Zen 4 was measured with."""
    return 64 if amx_bfloat16(cpu) else 1


def amx_bfloat16(cpu: CpuInfo) -> bool:
    """The CPU multiplies bfloat16 on AMX tiles, and oneDNN's ISA is not held below them."""
    isa = cpu.onednn_max_isa.lower()
    return cpu.amx and (not isa or "amx" in isa or isa == "all")


def onednn_bfloat16() -> bool:
    """oneDNN is built in and runs bfloat16 on this CPU (AVX-512 BW and up)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def choose_compiled_decode(requested: str, device: str, quantize: str, trace_decode: bool,
                           compiler: str | None) -> tuple[bool, str]:
    """(whether one-row decode steps run AOTInductor's library, reason) for `--compile-decode
    requested` (auto or off) of a model served with `quantize` on `device`; `compiler` is the C++
    compiler found (`find_cpp_compiler`), None for none."""
    if requested == "off":
        return False, "compile-decode off: asked for"
    if not device.startswith("cpu"):
        return False, f"compile-decode off: auto on {device} (the compiled step is measured on CPUs only)"
    if quantize == "none":
        return False, "compile-decode off: auto with quantize none (the library would copy every weight)"
    if not trace_decode:
        return False, "compile-decode off: auto with --no-trace-decode (the eager step was asked for)"
    if compiler is None:
        return False, "compile-decode off: auto, no C++ compiler for AOTInductor (g++, or $CXX)"
    return True, f"compile-decode on: auto, one-row steps through AOTInductor's library ({compiler})"


def find_cpp_compiler() -> str | None:
    """The C++ compiler AOTInductor would run ($CXX, else g++), as a path; None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))
