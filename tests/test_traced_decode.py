"""The decode step through TorchScript traces (`--trace-decode`) gives the eager step's logits bit
for bit, at every batch size and attended length, in each quantization regime; so do the traced
verify and mixed steps; a tracer failure falls back to eager decoding, loudly."""

from __future__ import annotations

import pytest
import structlog
import torch

from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.loader import load_model
from engine_service.model.quantize import quantize_model
from engine_service.model.traced_decode import TracedDecode, TracedMixed, TracedVerify, verify_sizes
from engine_service.requests import Request, SamplingParams
from engine_service.runtime import model_runner
from engine_service.runtime.model_runner import ModelRunner
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import StepPlan
from tests.greedy_steps import greedy_logits

CPU = torch.device("cpu")
MAX_BATCH, CONTEXT, STEPS = 8, 96, 12


def _tiny(dtype: torch.dtype, method: str) -> torch.nn.Module:
    """The tiny model packed, with its rotary tables, and its copies as `method` says: none, int4 or
    int8 (with -dynamic-head: the head's copy fbgemm's, with 7-bit activations), or none-onednn (its
    layers' weights laid out for oneDNN, as the engine lays bfloat16 out)."""
    model = load_model("tiny", CPU, dtype).model
    model.pack_projections()
    model.setup_rope(CONTEXT, CPU)
    if method == "none-onednn":
        for packed in model.projections()[:-1]:
            packed.pack_onednn(64)
    elif method != "none":
        quantize_model(model.projections(), method.removesuffix("-dynamic-head"),
                       dynamic_head_bits=7 if method.endswith("-dynamic-head") else 0)
    return model


@pytest.mark.parametrize(("dtype", "method", "regimes"), [
    (torch.float32, "none", 1), (torch.bfloat16, "none", 1),
    (torch.bfloat16, "int8", 2),  # <= 4 rows quantized, above not
    (torch.bfloat16, "int4", 2),  # <= 4 rows all quantized, 5..8 the layers only (the int8 head stops at 4)
    (torch.bfloat16, "int4-dynamic-head", 1),  # fbgemm's head serves up to 32 rows, the layers 8: one regime
    (torch.float32, "int4-dynamic-head", 1),
    (torch.bfloat16, "none-onednn", 1),  # the layers' weights laid out for oneDNN, read by the trace
])
def test_traced_steps_equal_eager_steps(dtype: torch.dtype, method: str, regimes: int) -> None:
    model = _tiny(dtype, method)
    cache = KVCache(model.config, MAX_BATCH, CONTEXT, dtype, CPU)
    traced = TracedDecode(model, cache, MAX_BATCH)
    assert traced.regimes == regimes
    for batch in (1, 2, 3, 5, MAX_BATCH):
        generator = torch.Generator().manual_seed(batch)
        lengths = torch.randint(3, 20, (batch,), generator=generator)  # different lengths: a real mask
        prompts = torch.randint(0, 256, (batch, int(lengths.max())), generator=generator)
        runs = [greedy_logits(model, cache, step, prompts, lengths, STEPS)
                for step in (lambda t, p: model.decode(t, p, cache), traced)]
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


# what the trace's and the eager step's logits, keys and values may differ by: float32's rounding where
# the CPU's kernels sum in another order; in bfloat16 they agreed bit for bit on every CPU tried
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 0.0}


@pytest.mark.parametrize(("dtype", "method"), [
    (torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "int4"), (torch.bfloat16, "int8"),
])
def test_traced_verify_steps_equal_the_eager_verify_step(dtype: torch.dtype, method: str) -> None:
    """A verify step through its trace gives the eager step's logits for the same tokens, fed as a
    chunk (how the runner verifies without a trace), at every traced size, and writes the same keys
    and values: bit for bit on the Xeon 207; within float rounding where the CPU's attention kernel
    sums the trace's query rows (a KV head's G heads x n tokens) in another order than the eager
    chunk's (n tokens a head): on an AMD EPYC of the Zen 4 class, 2 tokens in float32 differ by 9e-8."""
    model = _tiny(dtype, method)
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
            torch.testing.assert_close(through_trace, eager, rtol=0, atol=ROUNDING[dtype], msg=f"{n} tokens")
        assert torch.equal(runs[0][0].argmax(-1), runs[1][0].argmax(-1)), f"{n} tokens: the same greedy tokens"


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
    assert got is not None and got.shape == expected.shape  # within float rounding: see the test above
    torch.testing.assert_close(got, expected, rtol=0, atol=ROUNDING[torch.float32])
    assert runner._verify_traced_row([9, 10, 11, 12, 13], 3) is None  # 5 tokens: past the largest size
    assert runner._verify_traced_row([9, 10, 11], 29) is None  # padded to 4 from 29: past the 32 positions
    assert runner._verify_traced_row([9, 10, 11], 28) is not None  # positions 28..31


@pytest.mark.parametrize(("dtype", "method"), [
    (torch.float32, "none"), (torch.bfloat16, "none-onednn"), (torch.bfloat16, "int4"),
])
def test_traced_mixed_steps_equal_eager_steps(dtype: torch.dtype, method: str) -> None:
    """Decoding rows beside one prompt chunk in the next row, through TracedMixed: the eager step's
    logits and keys and values, bit for bit, for a chunk from position 0 and from later, ending its
    prompt or not, in each traced regime; a regime it did not trace gives None. With int4 copies
    (the layers' up to 8 rows, the int8 head's up to 4) one regime is traced: over 8 rows with at
    most 4 rows through the head; 8 rows and fewer are too few for a chunk beside a row."""
    model = _tiny(dtype, method)
    cache = KVCache(model.config, MAX_BATCH, CONTEXT, dtype, CPU)
    traced = TracedMixed(model, cache)
    assert traced.regimes == 1
    generator = torch.Generator().manual_seed(5)
    untraced = set() if method != "int4" else {(7, 40), (3, 3)}  # 7 + 1 rows through the head; 6 rows in all
    for b, c, start, completes in [(2, 16, 0, True), (3, 20, 30, False), (1, 30, 60, True), (7, 40, 50, False),
                                   (3, 3, 10, True)]:
        lengths = torch.randint(3, 20, (b,), generator=generator)  # the decoding rows' cached positions
        prompts = torch.randint(0, 256, (b, int(lengths.max())), generator=generator)
        prefix = torch.randint(0, 256, (1, max(start, 1)), generator=generator)
        decoding, chunk_tokens = torch.randint(0, 256, (b,), generator=generator), torch.randint(0, 256, (c,), generator=generator)
        chunk = PromptChunk(b, start, c)
        runs = []
        for run in ("eager", "traced"):
            cache.k.zero_()
            cache.v.zero_()
            model.prefill(prompts, lengths, cache, 0)
            if start:
                model.prefill(prefix, torch.tensor([start]), cache, b)
            if run == "eager":
                logits = model.step(decoding, lengths, chunk_tokens, [chunk], cache, logits_of=[0] if completes else [])
            else:
                logits = traced(decoding, lengths, chunk_tokens, chunk, completes)
            runs.append((logits, cache.k.clone(), cache.v.clone()))
        if (b, c) in untraced:
            assert runs[1][0] is None, (b, c)
            continue
        assert runs[1][0] is not None and runs[0][0].shape == (b + completes, model.config.vocab_size)
        for eager, through_trace in zip(*runs, strict=True):
            assert torch.equal(eager, through_trace), (b, c, start, completes)


def _seq(prompt: list[int], generated: list[int] = (), echo: bool = False) -> Sequence:
    request = Request(request_id=f"r{len(prompt)}", prompt_ids=tuple(prompt), max_new_tokens=10,
                      sampling=SamplingParams(), stop_token_ids=frozenset(), ignore_eos=True, deadline=None,
                      echo_prompt_logprobs=echo)
    out = Sequence(request, sink=None)
    out.generated, out.cache_len = list(generated), len(prompt) + len(generated) - 1 if generated else 0
    return out


def test_the_runner_runs_a_mixed_step_traced_only_in_the_layout_its_trace_takes() -> None:
    """The runner's step of 2 decoding rows beside a chunk in row 2 goes through the trace and gives
    the eager step's logits; a chunk in another row, two chunks, or an echoed prompt (whose every
    token's logits are asked) do not; a tracer failure leaves the eager step, loudly."""
    model = load_model("tiny", CPU, torch.float32).model
    runner = ModelRunner(model, 4, 64, CPU, torch.float32, trace_decode=True)
    a, b = _seq([5, 6, 7], [8]), _seq([9, 10], [11])
    prompt = list(range(20, 40))
    plan = StepPlan.build([a, b], [(_seq(prompt), PromptChunk(2, 0, 20))])
    model.prefill(torch.tensor([[5, 6, 7], [9, 10, 0]]), torch.tensor([3, 2]), runner.cache, 0)
    assert runner._mixed_traced(torch.tensor([8, 11]), torch.tensor([3, 2]), torch.tensor(prompt), plan) is not None
    model.prefill(torch.tensor([[5, 6, 7], [9, 10, 0]]), torch.tensor([3, 2]), runner.cache, 0)
    got = runner.forward(plan).sampled
    model.prefill(torch.tensor([[5, 6, 7], [9, 10, 0]]), torch.tensor([3, 2]), runner.cache, 0)
    expected = model.step(torch.tensor([8, 11]), torch.tensor([3, 2]), torch.tensor(prompt), [PromptChunk(2, 0, 20)],
                          runner.cache, logits_of=[0])
    assert torch.equal(got, expected)
    tokens, positions = torch.tensor([8, 11]), torch.tensor([3, 2])
    for other in (StepPlan.build([a, b], [(_seq(prompt), PromptChunk(3, 0, 20))]),
                  StepPlan.build([a, b], [(_seq(prompt), PromptChunk(2, 0, 20)), (_seq([1, 2]), PromptChunk(3, 0, 2))]),
                  StepPlan.build([a, b], [(_seq(prompt, echo=True), PromptChunk(2, 0, 20))])):
        assert runner._mixed_traced(tokens, positions, torch.tensor(prompt), other) is None

    def fail(*args: object) -> None:
        raise RuntimeError("the tracer could not record this mixed step")

    with pytest.MonkeyPatch.context() as patch, structlog.testing.capture_logs() as logs:
        patch.setattr(model_runner, "TracedMixed", fail)
        runner = ModelRunner(load_model("tiny", CPU, torch.float32).model, 4, 64, CPU, torch.float32, trace_decode=True)
    assert {"event": "mixed_trace_failed", "log_level": "warning", "error_type": "RuntimeError",
            "error": "the tracer could not record this mixed step"} in logs
    assert runner._mixed_traced(tokens, positions, torch.tensor(prompt), plan) is None
