"""The decode step through TorchScript traces (`--trace-decode`) gives the eager step's logits bit
for bit, at every batch size and attended length, in each quantization regime; a tracer failure
falls back to eager decoding, loudly."""

from __future__ import annotations

import pytest
import structlog
import torch

from engine_service.model.kv_cache import KVCache
from engine_service.model.loader import load_model
from engine_service.model.quantize import quantize_model
from engine_service.model.traced_decode import TracedDecode
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
