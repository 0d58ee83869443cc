"""The compiled one-row step and the trace it falls back to, run alike: the int4 kernels' tests hold
the library built over their copies to the trace's greedy tokens, or to its logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from engine_service.model.loader import load_model
from engine_service.runtime.model_runner import ModelRunner


def compiled_tiny(dtype: torch.dtype, int4_kernel: str) -> ModelRunner:
    """The tiny model's runner in `dtype` with int4 copies for `int4_kernel` and its one-row step
    compiled (into $ENGINE_COMPILE_CACHE: a test's own directory)."""
    model = load_model("tiny", torch.device("cpu"), dtype).model
    runner = ModelRunner(model, 2, 64, torch.device("cpu"), dtype, "int4", trace_decode=True, compile_decode=True,
                         int4_kernel=int4_kernel)
    assert runner.compiled_decode == "on"
    return runner


def _both_steps(runner: ModelRunner) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """("compiled", the runner's compiled step), then ("traced", its trace), each yielded after the
    same 4-token prompt is prefilled into a zeroed cache."""
    for name, step in (("compiled", runner._decode), ("traced", runner._decode._fallback)):  # type: ignore[attr-defined]
        runner.cache.k.zero_()
        runner.cache.v.zero_()
        runner.model.prefill(torch.tensor([[5, 6, 7, 8]]), torch.tensor([4]), runner.cache, 0)
        yield name, step


def greedy_of_both_steps(runner: ModelRunner, steps: int = 10) -> dict[str, list[int]]:
    """The greedy tokens of the runner's compiled step and of its trace, each after the same
    4-token prompt prefilled into a zeroed cache, `steps` tokens each."""
    picks = {}
    for name, step in _both_steps(runner):
        token, tokens = torch.tensor([9]), []
        for position in range(4, 4 + steps):
            token = step(token, torch.tensor([position])).argmax(-1)
            tokens.append(int(token))
        picks[name] = tokens
    return picks


def logits_of_both_steps(runner: ModelRunner, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The logits (len(tokens), V) float32 of the runner's compiled step and of its trace, each fed
    `tokens` one a step after the same 4-token prompt prefilled into a zeroed cache (the same inputs
    to both, whatever either would pick)."""
    out = {}
    for name, step in _both_steps(runner):
        out[name] = torch.cat([step(torch.tensor([token]), torch.tensor([4 + i])).float()
                               for i, token in enumerate(tokens)])
    return out
