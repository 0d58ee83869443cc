"""Weight-only int8 for decode (`--quantize int8`, off by default).

A batch-1 decode step reads every weight once and does little arithmetic with it, so on a CPU it is
bound by memory and by the per-call cost of the matmul kernel, not by FLOPs. Each projection keeps
its weights in the model's dtype and gains a per-output-channel symmetric int8 copy (scale =
max |w| / 127 per row); steps of at most `max_rows` rows (decode of small batches) multiply with
torch's weight-only int8 kernel (`torch._weight_int8pack_mm`: int8 weights, activations and output
in the model's dtype), larger ones (prefill, large decode batches, where the model's dtype and its
matrix units win) with the original weights. Memory: the int8 copy adds half of a bfloat16 model's
projection weights.

Accuracy against the unquantized model is measured in tests/test_quantize.py and README.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine_service.model.llama import LlamaForCausalLM

# Rows up to which the int8 kernel is used; measured on SmolLM2 in bfloat16 (benchmarks/throughput.py):
# int8 took 12.3/14.3/15.7/31.8 ms for 1/2/4/8 rows where bfloat16 took 29.1/27.7/25.8/26.7 ms
# (all 30 layers' matmuls; it has no matrix-unit path, so bfloat16 wins from 8 rows on).
DEFAULT_MAX_ROWS = 4


@dataclass(frozen=True)
class Int8Weight:
    weight: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) in the activations' dtype
    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N), in x's dtype."""
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales)
        return out.view(*x.shape[:-1], out.shape[-1])


def quantize_int8(weight: torch.Tensor, max_rows: int = DEFAULT_MAX_ROWS) -> Int8Weight:
    """Per-output-channel symmetric int8 of a (N, K) weight; an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(weight.dtype).contiguous(), max_rows)


def quantize_int8_model(model: LlamaForCausalLM, max_rows: int = DEFAULT_MAX_ROWS) -> None:
    """Give every projection of `model` (packed: call after `setup_rope`) its int8 copy."""
    with torch.no_grad():
        for packed in model.projections():
            packed.quantized = quantize_int8(packed.weight, max_rows)  # type: ignore[arg-type]
