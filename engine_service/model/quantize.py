"""Weight-only quantization for decode (`--quantize int8|int4`; `auto`, the default, serves a
quantized GGUF's own: engine_service/machine/precision.py).

A batch-1 decode step reads every weight once and does little arithmetic with it, so on a CPU it is
bound by memory and by the per-call cost of the matmul kernel, not by FLOPs; torch's bfloat16 kernel
is slow there (about 300 us per projection of SmolLM2, 70% of a step). Each projection keeps its
weights in the model's dtype and gains a quantized copy; calls of at most `max_rows` rows (decode
of small batches) multiply with torch's weight-only kernel for it (activations and output stay in
the model's dtype), larger ones (prefill, large decode batches, where the model's dtype and the
CPU's matrix units win) with the original weights.

- int8: per-output-channel symmetric (scale = max |w| / 127 per row), `torch._weight_int8pack_mm`.
  Adds half of a bfloat16 model's projection weights.
- int4: groups of 32 inputs, asymmetric (min and max of each group give scale and offset), the
  layout of GGUF's Q4_1, `torch._weight_int4pack_mm_for_cpu`. Adds a quarter. A Q4_1 file's blocks
  are exactly such groups, so on a Q4_1 model (the packaged SmolLM2) the int4 copy recovers the
  file's own 4-bit values (in float32, the layers' int4 logits matched the unquantized ones on
  every top-1 and within 0.0005); in bfloat16 scale and offset are rounded. The LM head gets int8
  (`quantize_model`). Only with bfloat16 activations are these kernels fast, so a float32 model's
  calls are cast to bfloat16 and back (`kernel_dtype`), and its copy's scales are bfloat16; where
  the float32 int4 kernel is built (q4_matmul.py, on a CPU with AVX2 and FMA: precision.py's
  choose_q4_kernel), a float32 model's int4 layers get `Q4Weight`s instead, the same groups with
  float32 scales and lows, multiplied in float32 with no casts.
- The LM head, on a CPU where fbgemm runs (AVX2 and up: `dynamic_head_bits`, chosen in
  engine_service/machine/precision.py): int8 weights per output channel, as above, and the call's
  activations quantized to 8 bits on the fly (one scale and offset for the call's rows), multiplied
  as integers by fbgemm (`torch.ops.quantized.linear_dynamic`), as llama.cpp multiplies a Q8_0 head
  by Q8 activations. On SmolLM2's head (49,152 x 576, bfloat16 model, 2 threads, Zen 4, ms for
  1/4/8/16/32 rows): dynamic int8 0.87/0.82/1.51/1.93/4.93, int8 weight-only 2.36/3.34/6.24/12.4/
  24.4, bfloat16 4.19/5.28/4.82/6.43/8.16; so it serves up to 32 rows. Its cost in accuracy over
  tests/test_quantize.py's text, decoded one token at a time with int4 layers: top-1 agreement with
  the unquantized model 0.959 (weight-only int8 head 0.979), largest logit error 1.16 (1.12). The
  layers keep int4 weight-only: with dynamic int8 there too, 0.918 and 3.12.
  Without 8-bit dot products that accumulate in 32 bits (VNNI, AMX), fbgemm multiplies unsigned
  8-bit activations by the weights in pairs summed in 16 bits, which saturate past 32,767: with
  8-bit weights SmolLM2's logits came out up to 8.9 off the arithmetic. So there the weights get
  7 bits (|q| <= 63, scale = max |w| / 63; 255 x 63 x 2 < 32,768) and the product is exact. On an
  AMD EPYC of family 25 model 1 (AVX2, float32 model, int4 layers; 194 positions of text, each row
  its own call): top-1 0.979 against the unquantized model, as the weight-only int8 head's, and a
  largest logit error of 1.65 (0.96); 7-bit activations with 8-bit weights instead: 0.959 and
  2.17, 6-bit weights 0.954 and 2.75. Its ms at 1/4/8/16/32 rows (`benchmarks/lm_head.py`, caches
  flushed): 1.94/2.24/2.69/5.91/8.46 against the weight-only head's 3.72/5.73/9.72/22.48/35.73.

Measured over the 30 layers' matmuls of SmolLM2 in bfloat16 (ms for 1/4/8/16 rows): bfloat16
32.0/30.9/26.1/31.1, int8 14.0/17.3/33.6/56.2, int4 7.7/9.8/22.7/42.7; hence the row limits. A
float32 model's int4 copies serve up to 24 rows (`layer_max_rows`): the float32 weights they stand
in for are 420 MB a pass and slow at few rows. Whole traced decode steps with the copies serving 24
rows against 8, in one process (`benchmarks/step_ab.py`, SmolLM2, 2 threads, AMD EPYC of family 25
model 1, 2026-12-04), B / A at 8/12/16/20/24/32 rows: 0.965/0.682/0.667/0.794/0.896/0.988; the 30
layers' 120 matmuls alone, int4 / float32 at 16/24/32/40/48 rows: 0.80-0.98/0.91-1.02/0.89/1.22/1.34
(two runs; a 256 MB buffer written before each pass). A float32 model's weight-only int8 head serves
up to 32 rows (`head_max_rows`): its float32 table is 113 MB a call. SmolLM2's head, 2 threads, AMD EPYC of family 25 model 1 (AVX2, no VNNI: `auto`
chooses float32 there), `python benchmarks/lm_head.py` (caches flushed before each call), ms for
1/4/8/16/24/32 rows: float32 11.1/25.5/22.1/23.3/25.7/29.8, weight-only int8 4.1/6.0/9.8/16.8/24.7/
32.8. 32 rows is the edge (1.10x alone); in whole steps, in one process (`benchmarks/step_ab.py`),
the traced step with the copy took 0.757x at 8 rows and 0.965x at 32.
Accuracy against the unquantized model: tests/test_quantize.py and README.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_service.model import q4_matmul

MAX_ROWS = {"int8": 4, "int4": 8}  # rows up to which the quantized kernel is faster (above)
# rows up to which a float32 model's int4 copies beat its float32 weights (the docstring's figures)
FLOAT32_INT4_MAX_ROWS = 24
# rows up to which a bfloat16 model's int4 copies in the int16 kernel beat its bfloat16 weights
# (SmolLM2's 120 layer projections from memory, 2 threads, Xeon of family 6 model 207 with AMX, ms
# at 8/12/16/24 rows: int16 9.0/14.4/13.1/18.8, oneDNN's bfloat16 21.8/15.4/11.2/14.8)
INT16_KERNEL_INT4_MAX_ROWS = 8
# rows up to which a bfloat16 model's int16 copies serve calls on AMX tiles (q4_amx.cpp), where
# precision.choose_amx_int4 allows it: decode steps of 9 rows and more, short prompts, small mixed
# steps. SmolLM2 in one process, Xeon 207 with AMX, 2 threads, AMX / oneDNN's bfloat16 (or, in a
# traced step, F.linear's): traced decode steps of 9/16/32 rows 0.79/0.79/0.79 (1 and 8 rows, the
# int16 kernel's, 0.98/0.96); a prompt alone at 32/64/128/256 tokens, caches flushed before each,
# 0.72/0.95/1.09/1.12; 8 decoding rows beside a chunk of 16/32/64/96 tokens at position 0
# 0.77/1.08/1.17/1.08, at 1,000 0.91/0.96/1.08/1.08. So up to 32 rows.
AMX_INT4_MAX_ROWS = 32
DYNAMIC_HEAD_MAX_ROWS = 32
INT8_BITS = (8, 7)  # an int8 copy's value bits: 7 for the dynamic head on plain AVX2 (above), else 8
# rows up to which a float32 model's weight-only int8 head beats its float32 weights (the docstring's figures)
FLOAT32_HEAD_MAX_ROWS = 32
INT4_GROUP = q4_matmul.BLOCK  # Q4_1's block of 32 inputs, the group of both int4 kernels


def through_rows(x: torch.Tensor, kernel: torch.dtype, mm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`mm` of (rows, K) in `kernel`'s dtype applied to x (..., K): (..., N) in x's dtype, in as few
    operators as the shapes allow. A traced one-row step makes 120 of these calls, and each operator
    of a trace costs its dispatch, a no-op cast included: the model's (1, M, K) goes as its (M, K)
    block, and casts only where the dtypes differ (the one-row trace: 6,586 nodes -> 4,966 with the
    model's other trims, 0.974x the step's time, Xeon family 6 model 207)."""
    if x.dim() == 3 and x.shape[0] == 1:
        return through_rows(x[0], kernel, mm).unsqueeze(0)
    rows = x.flatten(0, -2) if x.dim() > 2 else x
    out = mm(rows if rows.dtype == kernel else rows.to(kernel))
    out = out if out.dtype == x.dtype else out.to(x.dtype)
    return out.unflatten(0, x.shape[:-1]) if x.dim() > 2 else out


@dataclass(frozen=True)
class Int8Weight:
    weight: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) in the activations' dtype
    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N), in x's dtype (computed in the scales' dtype, see `kernel_dtype`)."""
        return through_rows(x, self.scales.dtype, lambda rows: torch._weight_int8pack_mm(rows, self.weight, self.scales))


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # torch's CPU int4 layout of the (N, K) values 0..15
    scales_and_zeros: torch.Tensor  # (K / 32, N, 2): w = (q - 8) * scale + zero, in the activations' dtype
    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return through_rows(x, self.scales_and_zeros.dtype, lambda rows: torch._weight_int4pack_mm_for_cpu(
            rows, self.packed, INT4_GROUP, self.scales_and_zeros))


@dataclass(frozen=True)
class Q4Weight:
    """A float32 model's int4 copy for the float32 int4 kernel (q4_matmul.py): float32 in and out."""

    q: torch.Tensor  # (N, K / 2) uint8, two 4-bit values a byte in Q4_1's order (q4_matmul.pack)
    scales: torch.Tensor  # (N, K / 32) float32
    lows: torch.Tensor  # (N, K / 32) float32: w = q * scale + low
    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return through_rows(x, torch.float32, lambda rows: torch.ops.engine_q4.matmul(rows, self.q, self.scales, self.lows))


class DynamicInt8Weight(torch.nn.Module):
    """Weights of `bits` bits (8, or 7 where fbgemm's pair sums would saturate: the docstring
    above) multiplied by 8-bit activations quantized on the fly. A module, unlike the other copies:
    fbgemm's packed weight is a TorchScript object, which a trace (traced_decode.py) reaches only as
    an attribute of a module it was given, so `Packed` registers this one as its submodule when it
    is assigned."""

    def __init__(self, packed: torch.ScriptObject, nbytes: int, max_rows: int, bits: int) -> None:
        super().__init__()
        self.packed = packed  # fbgemm's packed (N, K) int8 weight with its per-row scales
        self.nbytes = nbytes  # the int8 weights and their scales, what a call reads
        self.max_rows = max_rows
        self.bits = bits  # of the weights: |q| <= 2 ** (bits - 1) - 1

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype; the kernel takes and gives float32."""
        return through_rows(x, torch.float32, lambda rows: torch.ops.quantized.linear_dynamic(
            rows, self.packed, False))  # 8-bit activations, not 7


@dataclass(frozen=True)
class Q4Int16Weight:
    """A bfloat16 model's int4 copy for the int16 or int8 int4 kernel (q4_matmul.py, q4_int16.cpp):
    the same groups, laid out for 16-bit dot products (the 8-bit ones read the same bytes), scales
    and lows in float16 (Q4_1's own: a Q4_1 file's come back exactly); bfloat16 in and out, the rows
    quantized to `activation_bits` (16 or 8) a group of 32 inside the call."""

    q: torch.Tensor  # (N / 16, K / 8, 64) uint8 (q4_matmul.pack_int16)
    scales: torch.Tensor  # (N / 16, K / 32, 16) float16
    lows: torch.Tensor  # (N / 16, K / 32, 16) float16: w = q * scale + low
    max_rows: int
    amx: bool = False  # calls of more than INT16_KERNEL_INT4_MAX_ROWS rows on AMX tiles (q4_amx.cpp, loaded)
    activation_bits: int = 16  # 16: the int16 kernel; 8: the int8 one (its library loaded)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """In the int16 kernel, or the int8 one; with `amx`, calls of more than
        INT16_KERNEL_INT4_MAX_ROWS rows on AMX tiles, the copy widened to bfloat16 in cache."""
        return through_rows(x, torch.bfloat16, lambda rows: (
            torch.ops.engine_q4_amx.matmul if self.amx and rows.shape[0] > INT16_KERNEL_INT4_MAX_ROWS
            else torch.ops.engine_q4_int8.matmul if self.activation_bits == 8
            else torch.ops.engine_q4_int16.matmul)(rows, self.q, self.scales, self.lows))


QuantizedWeight = Int8Weight | Int4Weight | Q4Weight | Q4Int16Weight | DynamicInt8Weight


def row_limits(copy: QuantizedWeight) -> tuple[int, ...]:
    """The row counts past which a call to `copy` takes another path: its `max_rows` (past it the
    full weights serve, llama.Packed), and an AMX copy's INT16_KERNEL_INT4_MAX_ROWS (past it the AMX
    kernel). A trace bakes in the path its example's rows took, so traced_decode.TracedDecode
    traces each range between these apart."""
    if isinstance(copy, Q4Int16Weight) and copy.amx:
        return (INT16_KERNEL_INT4_MAX_ROWS, copy.max_rows)
    return (copy.max_rows,)


# rows up to which a bfloat16 model's int4 copies in the int8 kernel beat its bfloat16 weights (SmolLM2's
# 120 layer projections from memory, 2 threads, AMD EPYC of family 25 model 17, ms at 8/12/16/24/32
# rows: int8 4.42/8.43/10.50/14.01/18.60, int16 6.15/12.23/16.59/21.16/26.15, oneDNN's bfloat16,
# prepacked, 13.18/15.81/17.22/21.89/24.78). Where AMX runs, calls past 8 rows go to its kernel as
# the int16 copies' do (Q4Int16Weight.matmul)
INT8_KERNEL_INT4_MAX_ROWS = 32
INT4_KERNELS = ("torch", "float32", "int16", "int8")  # who multiplies the int4 copies: quantize_model
# the row count up to which each of the engine's int4 kernels serves a model's layers
INT4_KERNEL_MAX_ROWS = {"float32": FLOAT32_INT4_MAX_ROWS, "int16": INT16_KERNEL_INT4_MAX_ROWS,
                        "int8": INT8_KERNEL_INT4_MAX_ROWS}
ACTIVATION_BITS = {"int16": 16, "int8": 8}  # the int4 kernels that quantize a call's rows: to how many bits


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype the kernels compute in for a model in `dtype`: its own, except that
    float32 activations are cast to bfloat16 and back (with float32 ones, int8 and int4 took 3.6x
    and 7x as long as float32 weights on one SmolLM2 step), so the copy's scales are bfloat16."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


class Projection(Protocol):
    """What quantization needs of a projection (llama.Packed): its packed (N, K) weight, and the
    slot whose copy serves its calls of at most `max_rows` rows."""

    weight: torch.Tensor | None
    quantized: QuantizedWeight | None


def head_max_rows(dtype: torch.dtype) -> int:
    """The rows up to which the weight-only int8 copy serves the LM head of a model in `dtype`."""
    return FLOAT32_HEAD_MAX_ROWS if dtype == torch.float32 else MAX_ROWS["int8"]


def layer_max_rows(method: str, dtype: torch.dtype) -> int:
    """The rows up to which a layer's `method` copy serves a model in `dtype`: a float32 model's
    int4 copies serve more (FLOAT32_INT4_MAX_ROWS), since the weights they stand in for read four
    bytes a value where bfloat16's read two."""
    return FLOAT32_INT4_MAX_ROWS if method == "int4" and dtype == torch.float32 else MAX_ROWS[method]


def quantize_int8(weight: torch.Tensor, max_rows: int = MAX_ROWS["int8"],
                  scales_dtype: torch.dtype | None = None, bits: int = 8) -> Int8Weight:
    """Per-output-channel symmetric int8 of a (N, K) weight, its values within `bits` bits
    (|q| <= 127 for 8, 63 for 7); an all-zero row gets scale 1. The scales (and so the kernel's
    activations) are in `scales_dtype`, by default the weight's."""
    if bits not in INT8_BITS:
        raise ValueError(f"int8 weights have 8 or 7 bits, got {bits!r}")
    levels = 2 ** (bits - 1) - 1
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-levels, levels).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(scales_dtype or weight.dtype).contiguous(), max_rows)


def quantize_dynamic_int8(weight: torch.Tensor, max_rows: int = DYNAMIC_HEAD_MAX_ROWS,
                          bits: int = 8) -> DynamicInt8Weight:
    """The per-output-channel int8 of `quantize_int8` in `bits` bits, packed for fbgemm's dynamic kernel."""
    q = quantize_int8(weight.detach().float(), max_rows, bits=bits)
    scales = q.scales.double()
    with warnings.catch_warnings():
        # torch 2.13 warns that quantized tensors will go in a later release; this one only carries
        # the weight into fbgemm's packing (a torch that drops them fails here, loudly, at start-up)
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q.weight, scales, torch.zeros_like(scales, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return DynamicInt8Weight(packed, q.weight.numel() + scales.numel() * 4, max_rows, bits)


def quantize_int4(weight: torch.Tensor, max_rows: int = MAX_ROWS["int4"],
                  scales_dtype: torch.dtype | None = None) -> Int4Weight:
    """Asymmetric 4-bit of a (N, K) weight in groups of 32 along K; a constant group gets scale 0.
    Scales and offsets (and the kernel's activations) in `scales_dtype`, by default the weight's."""
    q, scale, low = int4_groups(weight)
    zero = low + 8 * scale  # (q - 8) * scale + zero == q * scale + low
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(weight.shape).contiguous(), 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(scales_dtype or weight.dtype).contiguous()
    return Int4Weight(packed, scales_and_zeros, max_rows)


def quantize_q4(weight: torch.Tensor, max_rows: int = FLOAT32_INT4_MAX_ROWS) -> Q4Weight:
    """`quantize_int4`'s groups for the float32 int4 kernel (q4_matmul.py), scales and lows in float32."""
    q, scale, low = int4_groups(weight)
    return Q4Weight(q4_matmul.pack(q.view(weight.shape)), scale.contiguous(), low.contiguous(), max_rows)


def quantize_q4_int16(weight: torch.Tensor, max_rows: int = INT16_KERNEL_INT4_MAX_ROWS,
                      amx: bool = False, activation_bits: int = 16) -> Q4Int16Weight:
    """`quantize_int4`'s groups for the int16 int4 kernel (q4_matmul.py), scales and lows in float16,
    multiplied with the rows at `activation_bits` (16, or 8: the int8 kernel); with `amx`, its calls
    of more rows go to the AMX int4 kernel (Q4Int16Weight.matmul)."""
    q, scale, low = int4_groups(weight)
    return Q4Int16Weight(*q4_matmul.pack_int16(q.view(weight.shape), scale, low), max_rows, amx, activation_bits)


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (N, K) weight's asymmetric 4-bit groups of 32 along K: values (N, K / 32, 32) 0..15 and
    float32 scales and lows (N, K / 32), w ~ q * scale + low; a constant group gets scale 0."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"--quantize int4 needs input sizes that are multiples of {INT4_GROUP}, got a {n}x{k} weight")
    w = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = (high - low) / 15
    q = torch.where(scale[..., None] > 0, torch.round((w - low[..., None]) / scale[..., None].clamp(min=1e-30)),
                    torch.zeros_like(w)).clamp_(0, 15)
    return q, scale, low


def _engine_int4_copy(weight: torch.Tensor, kernel: str, max_rows: int | None,
                      amx_rows: int) -> Q4Weight | Q4Int16Weight | None:
    """The int4 copy for one of the engine's kernels (`kernel`: float32, int16 or int8) where it takes this
    weight (a float32 one; a bfloat16 one of whole 16-row tiles), serving up to `max_rows` rows (None:
    the kernel's own limit), an int16 copy up to `amx_rows` where that is more (the AMX kernel's
    calls); None where torch's kernel keeps it."""
    rows = INT4_KERNEL_MAX_ROWS.get(kernel, 0) if max_rows is None else max_rows
    if kernel == "float32" and weight.dtype == torch.float32:
        return quantize_q4(weight, rows)
    if kernel in ACTIVATION_BITS and weight.dtype == torch.bfloat16 and weight.shape[0] % q4_matmul.TILE == 0:
        return quantize_q4_int16(weight, max(rows, amx_rows), amx=amx_rows > INT16_KERNEL_INT4_MAX_ROWS,
                                 activation_bits=ACTIVATION_BITS[kernel])
    return None


def quantize_model(projections: Sequence[Projection], method: str, max_rows: int | None = None,
                   dynamic_head_bits: int = 0, int4_kernel: str = "torch", amx_rows: int = 0) -> None:
    """Give every projection of a model, the LM head last (`LlamaForCausalLM.projections()`, packed:
    call after `pack_projections`), its quantized copy. With int4 the LM head gets int8: embeddings
    are often kept at 8 bits (the packaged SmolLM2's are Q8_0, and 4 bits there moved top-1 on 13%
    of positions of a text against 3% for int8); with `dynamic_head_bits` (8 or 7; 0 for none) it is
    multiplied with 8-bit activations, its weights in that many bits (`DynamicInt8Weight`, where
    fbgemm runs: precision.py). `int4_kernel` (INT4_KERNELS) names who multiplies the int4 layers:
    torch's kernel, or one of the engine's (q4_matmul.py, its library loaded): `float32` gives a
    float32 model's layers `Q4Weight`s, `int16` and `int8` a bfloat16 model's `Q4Int16Weight`s (those whose
    output size is a multiple of 16; any other keeps torch's kernel), which serve up to `amx_rows`
    rows where that is more (the AMX int4 kernel loaded: AMX_INT4_MAX_ROWS; 0 for none)."""
    if method not in MAX_ROWS:
        raise ValueError(f"quantize method must be int8 or int4, got {method!r}")
    if dynamic_head_bits not in (0, *INT8_BITS) or isinstance(dynamic_head_bits, bool):
        raise ValueError(f"dynamic_head_bits must be 0 (weight-only head), 8 or 7, got {dynamic_head_bits!r}")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {int4_kernel!r}")
    *layers, head = projections
    layer_quantizer = quantize_int4 if method == "int4" else quantize_int8
    with torch.no_grad():
        for packed in layers:
            weight = packed.weight
            assert weight is not None  # packed, not yet quantized
            ours = _engine_int4_copy(weight, int4_kernel, max_rows, amx_rows) if method == "int4" else None
            packed.quantized = ours if ours is not None else layer_quantizer(
                weight, layer_max_rows(method, weight.dtype) if max_rows is None else max_rows,
                kernel_dtype(weight.dtype))
        if dynamic_head_bits:
            head.quantized = quantize_dynamic_int8(head.weight, DYNAMIC_HEAD_MAX_ROWS if max_rows is None  # type: ignore[arg-type]
                                                   else max_rows, dynamic_head_bits)
        else:
            head.quantized = quantize_int8(head.weight,  # type: ignore[arg-type]
                                           head_max_rows(head.weight.dtype) if max_rows is None else max_rows,  # type: ignore[union-attr]
                                           kernel_dtype(head.weight.dtype))  # type: ignore[union-attr]
