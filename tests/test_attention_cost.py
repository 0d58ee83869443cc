"""The prefill budget's attention parity measured at start-up (engine_service/model/attention_cost.py)
and held near the one the model's FLOPs give (runtime/build.chunk_parity)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.model import attention_cost
from engine_service.model.attention_cost import measured_parity
from engine_service.model.kv_cache import PromptChunk, additive_mask, chunk_mask
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
    positions = 64 * (start + 65 / 2)  # a 64-token chunk from `start`: its tokens' attended positions
    timings = iter([0.001 * (8 + 64), 1e-6 * positions])  # beside 8 decoding rows
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


def test_where_the_engines_prompt_attention_serves_it_is_what_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose chunks attend in the engine's kernel (use_prompt_attention) times that kernel,
    called as a step calls it (the chunk's q (H, T, D), its row's keys and values through its last
    position, the scale), not torch's attention; a slower kernel measures a smaller parity."""
    model = tiny()  # 4 heads of 16 values, 2 KV heads
    calls = []
    delay = [0.0]

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), scale))
        ends = attention_cost.time.perf_counter() + delay[0]
        while attention_cost.time.perf_counter() < ends:
            pass  # a busy wait: the machine's speed is what is measured
        return torch.zeros(q.shape[1], q.shape[0] * q.shape[2])

    def torchs(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch's attention timed where the engine's kernel serves")

    model.use_prompt_attention(kernel)
    monkeypatch.setattr(attention_cost.F, "scaled_dot_product_attention", torchs)
    fast = measured_parity(model, 256)  # the chunk as deep as 256 positions allow: from 192
    assert calls[0] == ((4, 64, 16), (2, 256, 16), (2, 256, 16), 0.25)  # k and v through the chunk: from 192
    assert len(calls) == 1 + attention_cost.REPEATS
    delay[0] = 0.001
    assert 0 < measured_parity(model, 256) < fast < math.inf


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


def test_a_timing_is_the_median_of_seven_calls_after_an_untimed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that each call moves by its own duration: the first call (a first run's costs) is
    not counted, the median of the next seven is."""
    clock = [0.0]
    durations = iter([0.050, 0.007, 0.001, 0.006, 0.002, 0.005, 0.003, 0.004])
    calls = []

    def call() -> None:
        calls.append(1)
        clock[0] += next(durations)

    monkeypatch.setattr(attention_cost.time, "perf_counter", lambda: clock[0])
    assert attention_cost._seconds(call) == pytest.approx(0.004)
    assert len(calls) == 8


def test_it_times_the_first_layers_projections_over_72_rows_and_a_chunks_masked_attention_at_depth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What is timed, recorded: layer 0's four projections, each over 72 rows (8 decoding beside a
    64-token chunk) of the model's dtype and width; attention of 64 query tokens of every head over
    start + 64 positions of the KV heads, masked as a mixed step masks a chunk from `start`."""
    model = load_model("tiny", CPU, torch.bfloat16).model
    model.pack_projections()
    config, layer = model.config, model.model.layers[0]
    projections = {id(layer.self_attn.qkv): "qkv", id(layer.self_attn.out): "out", id(layer.mlp.gate_up): "gate_up",
                   id(layer.mlp.down): "down"}
    seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    packed_forward = type(layer.self_attn.qkv).forward

    def record(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append((projections.get(id(self), "another layer's"), tuple(x.shape), x.dtype))
        return packed_forward(self, x)

    attended: list[dict[str, object]] = []
    attend = attention_cost.F.scaled_dot_product_attention

    def record_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        attended.append({"shapes": (tuple(q.shape), tuple(k.shape), tuple(v.shape)), "dtypes": {q.dtype, k.dtype, v.dtype},
                         **kwargs})
        return attend(q, k, v, **kwargs)

    monkeypatch.setattr(type(layer.self_attn.qkv), "forward", record)
    monkeypatch.setattr(attention_cost.F, "scaled_dot_product_attention", record_attention)
    measured_parity(model, 100)  # the chunk from 36: 100 positions in all
    hidden, inner = config.hidden_size, config.intermediate_size
    width, dim = config.num_attention_heads * config.dim_per_head, config.dim_per_head
    assert seen == [("qkv", (1, 72, hidden), torch.bfloat16), ("out", (1, 72, width), torch.bfloat16),
                    ("gate_up", (1, 72, hidden), torch.bfloat16), ("down", (1, 72, inner), torch.bfloat16)] * 8
    assert len(attended) == 8
    expected_mask = additive_mask(chunk_mask(PromptChunk(0, 36, 64), CPU), torch.bfloat16)
    for call in attended:
        assert call["shapes"] == ((1, config.num_attention_heads, 64, dim), (1, config.num_key_value_heads, 100, dim),
                                  (1, config.num_key_value_heads, 100, dim))
        assert call["dtypes"] == {torch.bfloat16}
        assert call["enable_gqa"] is (config.num_attention_heads != config.num_key_value_heads)
        mask = call["attn_mask"]
        assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bfloat16 and torch.equal(mask, expected_mask)
