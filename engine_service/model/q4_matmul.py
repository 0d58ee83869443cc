"""The engine's int4 kernels: activations times 4-bit weights in Q4_1's groups, built at run time
with the C++ compiler the compiled step uses, for a model's int4 copies where torch's kernel is slow
(machine/precision.choose_q4_kernel decides where):

- `float32` (`q4_matmul.cpp`, AVX2 and FMA, `quantize.Q4Weight`): a float32 model's. Torch's int4
  kernel (`_weight_int4pack_mm_for_cpu`) computes in bfloat16, so a float32 model's calls are cast
  to bfloat16 and back, and where the CPU has no bfloat16 instructions (the AVX2 class, where
  `auto` serves float32) the kernel emulates them. This one widens the 4-bit values to float32 in
  registers and multiplies there: the file's Q4_1 values exactly, no casts. Measured on an AMD
  EPYC of family 26 model 2 with torch's dispatch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`),
  SmolLM2's 120 layer projections: `docs/decode-speed.md`, "A float32 int4 kernel".
- `amx` (`q4_amx.cpp`, AMX-BF16, the int16 kernel's copies): a bfloat16 model's calls of 9-32
  rows (decode steps of that many streams, short prompts, small mixed steps), where
  machine/precision.choose_amx_int4 allows it. It widens each group of 32 inputs of 16 output rows
  to one bfloat16 AMX tile in cache and multiplies with `tdpbf16ps`: the call reads the 4-bit
  copies, not the full bfloat16 weights. Measured on the Xeon 207 with AMX: `docs/decode-speed.md`,
  "An AMX int4 kernel".
- `int16` (`q4_int16.cpp`, AVX-512 VNNI and BF16, `quantize.Q4Int16Weight`): a bfloat16 model's.
  The call's rows are quantized to 16 bits per group of 32 inputs (far finer than bfloat16's own 8
  bits of precision), and 16-bit integer dot products (`vpdpwssd`) multiply them by the 4-bit
  values, 16 output rows a vector. Torch's kernel widens every value to float32 and is bound by
  that arithmetic at few rows. Measured on an Intel Xeon of family 6 model 207 with AMX (SmolLM2's
  layers, 2 threads): `docs/decode-speed.md`, "A 16-bit integer int4 kernel". Where it beats
  torch's is decided at start-up by a race (int4_race.py), not assumed.
- `int8` (`q4_int16.cpp` built with `-DQ4_ACTIVATION_BITS=8`, the int16 kernel's copies): the
  rows quantized to 8 bits per group of 32 inputs, as llama.cpp multiplies Q4_1 (its Q8_1), and
  8-bit dot products (`vpdpbusd`), half the int16 kernel's instructions for the same values. On an
  AMD EPYC of family 25 model 17 (Zen 4, 2 threads), int8 / int16: the gate/up call from the cache
  0.70x at one row and 0.59x at 8; SmolLM2's 120 layer projections from memory 0.98x and 0.78x.
  SmolLM2 over 97 and 194 positions of English text against its unquantized bfloat16 model, top-1
  agreement 0.959 and 0.974 against 0.969 and 0.985, largest logit error 1.59 and 1.59 against 1.00
  and 1.44. What `auto` multiplies a bfloat16 model's int4 copies in (machine/precision.py).

A library is compiled once (about 10 s) into the compile cache and loaded from there after
(native_build.py); `load` says why when it cannot be, and torch's kernel serves then.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_service.model import native_build
from engine_service.model.native_build import Kernel

BLOCK = 32  # inputs a block (a group): a scale, a low and 16 bytes of 4-bit values
TILE = 16  # output rows the int16 kernel's vectors hold

_VNNI = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16")
KERNELS = {
    "float32": Kernel("float32", Path(__file__).with_name("q4_matmul.cpp"), ("-mavx2", "-mfma"), "engine_q4::matmul"),
    "int16": Kernel("int16", Path(__file__).with_name("q4_int16.cpp"), _VNNI, "engine_q4_int16::matmul"),
    "int8": Kernel("int8", Path(__file__).with_name("q4_int16.cpp"), (*_VNNI, "-DQ4_ACTIVATION_BITS=8"),
                   "engine_q4_int8::matmul"),
    "amx": Kernel("amx", Path(__file__).with_name("q4_amx.cpp"),
                  ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                   "-ffp-contract=off"), "engine_q4_amx::matmul"),  # a product then a sum, not fused: the loader's
}
# a start-up product's largest error relative to its largest value (`probe_error`): the output is
# rounded to bfloat16 (2^-8), the sums run in another order
PROBE_TOLERANCE = 0.02


def load(compiler: str, cache: Path, kernel: Kernel = KERNELS["float32"]) -> Path:
    """Build `kernel`'s library if it is not in `cache`, and load it (once a process; native_build.load):
    then its operator (`torch.ops.engine_q4.matmul`, `torch.ops.engine_q4_int16.matmul`, ...) runs.
    Raises RuntimeError (the compiler's failure, or torch's refusal to load) or OSError (the cache
    directory's)."""
    return native_build.load(compiler, cache, kernel, _matmul_shape if kernel.name == "float32" else _int16_matmul_shape)


def _matmul_shape(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def _int16_matmul_shape(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0] * TILE)


def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) uint8 in Q4_1's order: byte j of a block of 32 holds
    value j in its low nibble and value j + 16 in its high one."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    return (blocks[..., :BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()


def pack_int16(q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) values 0..15 and (N, K / 32) scales and lows -> the int16 kernel's layout (q4_int16.cpp):
    values (N / 16, K / 8, 64) uint8, the 64 bytes for inputs k..k+7 of a tile of 16 rows being 32
    little-endian 16-bit words, word 2 l + p holding row l's values k + 2 n + p in its nibbles
    n = 0..3; scales and lows (N / 16, K / 32, 16) float16, a group's 16 rows side by side. N must be
    a multiple of 16 and K of 32."""
    n, k = q.shape
    if n % TILE or k % BLOCK:
        raise ValueError(f"the int16 int4 kernel needs N a multiple of {TILE} and K of {BLOCK}, got a {n}x{k} weight")
    tiles, groups = n // TILE, k // BLOCK
    nibbles = q.to(torch.int32).view(tiles, TILE, k // 8, 4, 2).permute(0, 2, 1, 4, 3)  # tile, octet, row, p, n
    words = nibbles[..., 0] | (nibbles[..., 1] << 4) | (nibbles[..., 2] << 8) | (nibbles[..., 3] << 12)
    values = torch.stack([words & 0xFF, words >> 8], dim=-1).to(torch.uint8).reshape(tiles, k // 8, 64).contiguous()

    def side_by_side(v: torch.Tensor) -> torch.Tensor:
        return v.half().view(tiles, TILE, groups).transpose(1, 2).contiguous()
    return values, side_by_side(scales), side_by_side(lows)


def probe_error(kernel: Kernel) -> float:
    """Run the loaded `kernel` (int16 or amx: the int16 layout) once on a small weight of three
    tiles (a lone last one) and 40 rows (a partial last pass), and return its largest error relative to
    the largest value of the float32 arithmetic on the same bfloat16 values: a kernel that
    runs but multiplies wrongly (or not at all) fails here, at start-up, not in a step."""
    generator = torch.Generator().manual_seed(0)
    n, k = 3 * TILE, 4 * BLOCK
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = (torch.rand(n, k // BLOCK, generator=generator) * 0.01).half()
    lows = (-torch.rand(n, k // BLOCK, generator=generator) * 0.05).half()
    weight = (q.view(n, k // BLOCK, BLOCK).float() * scales.float()[..., None] + lows.float()[..., None]).view(n, k)
    x = torch.randn(40, k, generator=generator).to(torch.bfloat16)
    out = native_build.operator(kernel)(x, *pack_int16(q, scales.float(), lows.float()))
    ref = x.float() @ weight.to(torch.bfloat16).float().t()
    return float((out.float() - ref).abs().max() / ref.abs().max())
