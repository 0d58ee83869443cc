"""Extreme but valid sampling settings never crash the decode loop (found by the fuzz drill:
a subnormal temperature overflowed logits / temperature to inf, softmax gave NaN, and
torch.multinomial raised, which the loop rightly treats as fatal)."""

from __future__ import annotations

import struct

import pytest
import torch

from engine_service.generation.sampler import new_generator, sample
from engine_service.requests import SamplingParams

SUBNORMAL = struct.unpack("<f", b")\x00\x00\x00")[0]  # 5.7e-44, as a float32 on the wire


@pytest.mark.parametrize("temperature", [SUBNORMAL, 1e-30, 1e-6])
@pytest.mark.parametrize("top_p", [SUBNORMAL, 1.0])
def test_tiny_temperature_samples_the_argmax(temperature: float, top_p: float) -> None:
    logits = torch.randn(3, 258, generator=torch.Generator().manual_seed(0)) * 10
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=k, seed=1) for k in (0, 5, 255)]
    generators = [new_generator(p, torch.device("cpu")) for p in params]
    assert sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_scaling_keeps_the_distribution() -> None:
    logits = torch.randn(258, generator=torch.Generator().manual_seed(1))
    shifted = (logits - logits.max()) / 0.7
    assert torch.allclose(torch.softmax(shifted, -1), torch.softmax(logits / 0.7, -1), atol=1e-6)
