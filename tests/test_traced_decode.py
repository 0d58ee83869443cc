"""The decode step through TorchScript traces (`--trace-decode`) gives the eager step's logits bit
for bit, at every batch size and attended length, in each quantization regime; a tracer failure
falls back to eager decoding, loudly."""

from __future__ import annotations

import pytest
import structlog
import torch

from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.loader import load_model
from engine_service.model.quantize import quantize_model
from engine_service.model.traced_decode import TracedDecode, TracedVerify, verify_sizes
from engine_service.runtime import model_runner
from engine_service.runtime.model_runner import ModelRunner

CPU = torch.device("cpu")
MAX_BATCH, CONTEXT, STEPS = 8, 96, 12


@pytest.mark.parametrize(("dtype", "method", "regimes"), [
    (torch.float32, "none", 1), (torch.bfloat16, "none", 1),
    (torch.bfloat16, "int8", 2),  # <= 4 rows quantized, above not
    (torch.bfloat16, "int4", 2),  # <= 4 rows all quantized, 5..8 the layers only (the int8 head stops at 4)
    (torch.bfloat16, "int4-dynamic-head", 1),  # fbgemm's head serves up to 32 rows, the layers 8: one regime
    (torch.float32, "int4-dynamic-head", 1),
])
def test_traced_steps_equal_eager_steps(dtype: torch.dtype, method: str, regimes: int) -> None:
    model = load_model("tiny", CPU, dtype).model
    model.pack_projections()
    model.setup_rope(CONTEXT, CPU)
    if method != "none":
        quantize_model(model.projections(), method.removesuffix("-dynamic-head"),
                       dynamic_head_bits=7 if method.endswith("-dynamic-head") else 0)
    cache = KVCache(model.config, MAX_BATCH, CONTEXT, dtype, CPU)
    traced = TracedDecode(model, cache, MAX_BATCH)
    assert traced.regimes == regimes
    for batch in (1, 2, 3, 5, MAX_BATCH):
        generator = torch.Generator().manual_seed(batch)
        lengths = torch.randint(3, 20, (batch,), generator=generator)  # different lengths: a real mask
        prompts = torch.randint(0, 256, (batch, int(lengths.max())), generator=generator)
        runs = []
        for step in (lambda t, p: model.decode(t, p, cache), traced):
            model.prefill(prompts, lengths, cache, 0)
            tokens, positions, logits = torch.arange(batch) + 7, lengths.clone(), []
            for _ in range(STEPS):
                out = step(tokens, positions)
                logits.append(out)
                tokens, positions = out.argmax(-1), positions + 1
            runs.append(torch.stack(logits))
        assert torch.equal(runs[0], runs[1]), f"batch {batch}"


def test_a_tracer_failure_falls_back_to_eager_decoding_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("the tracer could not record this step")

    monkeypatch.setattr(model_runner, "TracedDecode", fail)
    model = load_model("tiny", CPU, torch.float32).model
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(model, 2, 32, CPU, torch.float32, trace_decode=True)
    assert {"event": "decode_trace_failed", "log_level": "warning", "error_type": "RuntimeError",
            "error": "the tracer could not record this step"} in logs
    model.prefill(torch.tensor([[5, 6, 7]]), torch.tensor([3]), runner.cache, 0)
    expected = model.decode(torch.tensor([9]), torch.tensor([3]), runner.cache)
    assert torch.equal(runner._decode(torch.tensor([9]), torch.tensor([3])), expected)


@pytest.mark.parametrize("most", [2, 3, 4, 7, 8, 9])
def test_verify_sizes_are_the_powers_of_two_below_the_most_and_the_most(most: int) -> None:
    sizes = verify_sizes(most)
    assert sizes == sorted(set(sizes)) and sizes[-1] == most
    assert sizes[:-1] == [n for n in (2, 4, 8) if n < most]


@pytest.mark.parametrize(("dtype", "method"), [
    (torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "int4"), (torch.bfloat16, "int8"),
])
def test_traced_verify_steps_equal_the_eager_verify_step(dtype: torch.dtype, method: str) -> None:
    """A verify step through its trace gives the eager step's logits for the same tokens, fed as a
    chunk (how the runner verifies without a trace), bit for bit, at every traced size, and writes
    the same keys and values."""
    model = load_model("tiny", CPU, dtype).model
    model.pack_projections()
    model.setup_rope(CONTEXT, CPU)
    if method != "none":
        quantize_model(model.projections(), method)
    cache = KVCache(model.config, 2, CONTEXT, dtype, CPU)
    traced = TracedVerify(model, cache, 7)
    assert traced.sizes == [2, 4, 7]
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 19), generator=generator)
    none = prompt[0, :0]
    for n in traced.sizes:
        fed = torch.randint(0, 256, (n,), generator=generator)
        runs = []
        for run in ("eager", "traced"):
            cache.k.zero_()
            cache.v.zero_()
            model.prefill(prompt, torch.tensor([19]), cache, 0)
            if run == "eager":
                logits = model.step(none, none, fed, [PromptChunk(0, 19, n)], cache, logits_of=[0], every_token_of=[0])
            else:
                logits = traced(fed[None, :], torch.arange(19, 19 + n)[None, :])
            runs.append((logits, cache.k[:, 0, :, :19 + n].clone(), cache.v[:, 0, :, :19 + n].clone()))
        for eager, through_trace in zip(*runs, strict=True):
            assert torch.equal(eager, through_trace), f"{n} tokens"


def test_a_verify_trace_failure_falls_back_to_the_eager_verify_step_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("the tracer could not record this verify step")

    monkeypatch.setattr(model_runner, "TracedVerify", fail)
    model = load_model("tiny", CPU, torch.float32).model
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(model, 2, 32, CPU, torch.float32, trace_decode=True, verify_tokens=4)
    assert {"event": "verify_trace_failed", "log_level": "warning", "error_type": "RuntimeError",
            "error": "the tracer could not record this verify step"} in logs
    assert runner._verify_traced_row([5, 6], 3) is None


def test_the_runner_pads_a_short_draft_to_a_traced_size_and_keeps_its_rows() -> None:
    """A verify of 3 tokens runs the 4-token trace and returns 3 rows, those of the eager step; one
    whose padding would pass the context, or longer than the largest size, is left to the eager step."""
    model = load_model("tiny", CPU, torch.float32).model
    runner = ModelRunner(model, 2, 32, CPU, torch.float32, trace_decode=True, verify_tokens=4)
    model.prefill(torch.tensor([[5, 6, 7]]), torch.tensor([3]), runner.cache, 0)
    got = runner._verify_traced_row([9, 10, 11], 3)
    model.prefill(torch.tensor([[5, 6, 7]]), torch.tensor([3]), runner.cache, 0)
    none = torch.zeros(0, dtype=torch.long)
    expected = model.step(none, none, torch.tensor([9, 10, 11]), [PromptChunk(0, 3, 3)], runner.cache,
                          logits_of=[0], every_token_of=[0])
    assert got is not None and torch.equal(got, expected)
    assert runner._verify_traced_row([9, 10, 11, 12, 13], 3) is None  # 5 tokens: past the largest size
    assert runner._verify_traced_row([9, 10, 11], 29) is None  # padded to 4 from 29: past the 32 positions
    assert runner._verify_traced_row([9, 10, 11], 28) is not None  # positions 28..31
