"""The prefill budget's attention parity measured at start-up (engine_service/model/attention_cost.py)
and held near the one the model's FLOPs give (runtime/build.chunk_parity)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.model import attention_cost
from engine_service.model.attention_cost import CHUNK_TOKENS, DECODING_ROWS, measured_parity
from engine_service.model.loader import load_model
from engine_service.runtime import build
from engine_service.scheduling.prefill_budget import attention_parity

CPU = torch.device("cpu")


def tiny() -> torch.nn.Module:
    model = load_model("tiny", CPU, torch.float32).model
    model.pack_projections()
    return model


@pytest.mark.parametrize(("max_context", "start"), [(2048, 1024), (100, 36), (32, 0)])
def test_the_parity_is_the_matmuls_time_a_row_over_the_attentions_a_token_and_position(
        monkeypatch: pytest.MonkeyPatch, max_context: int, start: int) -> None:
    """Timed as the real calls are timed, the first call the matmuls, the second the attention:
    0.072 s over 72 rows against 1 us a token and attended position is a parity of 1,000; the chunk
    starts at 1,024 where the context allows, else as deep as it fits."""
    positions = CHUNK_TOKENS * (start + (CHUNK_TOKENS + 1) / 2)
    timings = iter([0.001 * (DECODING_ROWS + CHUNK_TOKENS), 1e-6 * positions])
    names = []

    def seconds(call: object) -> float:
        names.append(call.__name__)  # type: ignore[attr-defined]
        return next(timings)

    monkeypatch.setattr(attention_cost, "_seconds", seconds)
    assert measured_parity(tiny(), max_context) == pytest.approx(1000.0)
    assert names == ["matmuls", "attention"]


def test_slower_attention_measures_a_smaller_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real layer, timed: a finite positive parity; with every attention call made 1 ms slower,
    a smaller one (a token's attention catches up with its matmuls at fewer positions)."""
    model = tiny()
    plain = measured_parity(model, 256)
    assert 0 < plain < math.inf
    attend = attention_cost.F.scaled_dot_product_attention

    def slow(*args: object, **kwargs: object) -> torch.Tensor:
        ends = attention_cost.time.perf_counter() + 0.001
        while attention_cost.time.perf_counter() < ends:
            pass  # a busy wait: the machine's speed is what is measured
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention_cost.F, "scaled_dot_product_attention", slow)
    assert measured_parity(model, 256) < plain


@pytest.mark.parametrize("measured", [100.0, 1e9, 1e-9])
def test_the_engine_keeps_the_measured_parity_within_its_bounds(monkeypatch: pytest.MonkeyPatch,
                                                               measured: float) -> None:
    """Within 1/8 and 2x of the FLOPs' parity the measurement stands; beyond, the bound. Where the
    device is not the CPU the FLOPs' parity serves, unmeasured."""
    model = tiny()
    flops = attention_parity(model.config)  # the tiny model's: 288
    monkeypatch.setattr(build, "measured_parity", lambda model, context: measured)
    expected = {100.0: 100.0, 1e9: 2 * flops, 1e-9: flops / 8}[measured]
    assert build.chunk_parity(model, EngineConfig(model="tiny")) == pytest.approx(expected)

    def unmeasured(model: object, context: int) -> float:
        raise AssertionError("measured off the CPU")

    monkeypatch.setattr(build, "measured_parity", unmeasured)
    assert build.chunk_parity(model, EngineConfig(model="tiny", device="cuda")) == flops
