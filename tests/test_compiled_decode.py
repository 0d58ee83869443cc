"""The one-row decode step compiled by AOTInductor (`--compile-decode auto`): it writes the runner's
own KV cache and follows the traced step's tokens, other row counts and the context's last position
go to the trace, the library is kept and loaded again, and a failure to compile leaves the traced
step serving, loudly.

The tests that compile (about 25-60 s for the tiny model on 2 cores) are marked `compile`: CI runs
them (`pytest -m compile`), `make test` does not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from engine_service.model.compiled_decode import CompiledDecode, library_key
from engine_service.model.kv_cache import KVCache
from engine_service.model.loader import load_model
from engine_service.runtime import model_runner
from engine_service.runtime.model_runner import ModelRunner

CPU = torch.device("cpu")
MAX_BATCH, CONTEXT, STEPS = 4, 64, 12
VERIFY = 7  # speculation's last token and a draft of 6: the largest verify step, compiled too


def _runner(monkeypatch: pytest.MonkeyPatch, directory: Path, context: int = CONTEXT) -> ModelRunner:
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(directory))
    model = load_model("tiny", CPU, torch.bfloat16).model
    return ModelRunner(model, MAX_BATCH, context, CPU, torch.bfloat16, "int4", trace_decode=True,
                       compile_decode=True, verify_tokens=VERIFY)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ModelRunner, Path]]:
    directory = tmp_path_factory.mktemp("compiled")
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _runner(monkeypatch, directory), directory


def _greedy(runner: ModelRunner, step: object, prompt: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """STEPS greedy tokens after `prompt` (prefilled into row 0) through `step`; the tokens, the
    logits, and the row's keys after."""
    cache = runner.cache
    cache.k.zero_()
    cache.v.zero_()
    runner.model.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, 0)
    token, position, tokens, logits = torch.tensor([prompt[-1] + 1]), len(prompt), [], []
    for _ in range(STEPS):
        out = step(token, torch.tensor([position]))  # type: ignore[operator]
        logits.append(out)
        token, position = out.argmax(-1), position + 1
        tokens.append(int(token))
    return tokens, torch.cat(logits), cache.k[:, 0].clone()


@pytest.mark.compile
def test_compiled_one_row_steps_write_the_runners_cache_and_follow_the_trace(
        compiled: tuple[ModelRunner, Path]) -> None:
    runner, _ = compiled
    assert runner.compiled_decode.startswith("on") and isinstance(runner._decode, CompiledDecode)
    prompt = [3, 17, 200, 41, 9, 88, 120]
    traced = _greedy(runner, runner._decode._fallback, prompt)
    ours = _greedy(runner, runner._decode, prompt)
    assert ours[0] == traced[0]
    # fused kernels round in another order: bfloat16's last bits, not the tokens
    assert (ours[1] - traced[1]).abs().max() < 0.05
    written = ours[2][:, :, len(prompt):len(prompt) + STEPS]
    assert written.abs().sum() > 0  # the compiled steps' keys are in the runner's cache, not a copy's
    assert torch.allclose(ours[2], traced[2], atol=0.02, rtol=0.02)


@pytest.mark.compile
def test_other_row_counts_and_the_contexts_last_position_go_to_the_trace(
        compiled: tuple[ModelRunner, Path]) -> None:
    runner, _ = compiled
    decode = runner._decode
    assert isinstance(decode, CompiledDecode)
    for tokens, positions in ((torch.tensor([5, 6]), torch.tensor([4, 9])), (torch.tensor([5]), torch.tensor([CONTEXT - 1]))):
        state = runner.cache.k.clone(), runner.cache.v.clone()
        expected = decode._fallback(tokens, positions)
        runner.cache.k.copy_(state[0])
        runner.cache.v.copy_(state[1])
        assert torch.equal(decode(tokens, positions), expected)


@pytest.mark.compile
def test_the_compiled_verify_step_writes_the_runners_cache_and_follows_its_trace(
        compiled: tuple[ModelRunner, Path]) -> None:
    runner, _ = compiled
    decode, traced = runner._decode, runner._verify_traced
    assert isinstance(decode, CompiledDecode) and traced is not None
    assert runner.compiled_decode == f"on, and the verify step of {VERIFY} tokens"
    cache, prompt = runner.cache, [3, 17, 200, 41, 9, 88, 120]
    tokens = torch.tensor([[121, 5, 77, 30, 12, 9, 64]])
    positions = torch.arange(len(prompt), len(prompt) + VERIFY)[None, :]
    out = {}
    for name, step in (("traced", traced), ("compiled", decode.verify)):
        cache.k.zero_()
        cache.v.zero_()
        runner.model.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, 0)
        out[name] = step(tokens, positions), cache.k[:, 0].clone()  # type: ignore[operator]
    assert out["compiled"][0].shape == (VERIFY, runner.model.config.vocab_size)
    assert torch.equal(out["compiled"][0].argmax(-1), out["traced"][0].argmax(-1))
    assert (out["compiled"][0] - out["traced"][0]).abs().max() < 0.05  # fused kernels: the last bits
    assert out["compiled"][1][:, :, len(prompt):len(prompt) + VERIFY].abs().sum() > 0  # into the runner's cache
    assert torch.allclose(out["compiled"][1], out["traced"][1], atol=0.02, rtol=0.02)
    # another size, and a step that would reach the context's last position, go to the traces
    assert decode.verify(tokens[:, :4], positions[:, :4]) is None
    assert decode.verify(tokens, torch.arange(CONTEXT - VERIFY, CONTEXT)[None, :]) is None


@pytest.mark.compile
def test_the_library_is_kept_and_loaded_again_for_the_same_model_and_shape(
        compiled: tuple[ModelRunner, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner, directory = compiled
    with structlog.testing.capture_logs() as logs:
        again = _runner(monkeypatch, directory)
    loaded = [e for e in logs if e["event"] == "decode_compiled"]
    assert [(e["tokens"], e["compiled"]) for e in loaded] == [(1, False), (VERIFY, False)]
    assert isinstance(again._decode, CompiledDecode) and again._decode.package == runner._decode.package
    assert again._decode.verify_package == runner._decode.verify_package != runner._decode.package
    assert not [e for e in logs if e["event"] == "decode_compile_started"]


def test_the_library_key_changes_with_the_weights_the_shape_and_the_quantization() -> None:
    model = load_model("tiny", CPU, torch.bfloat16).model
    cache = KVCache(model.config, MAX_BATCH, CONTEXT, torch.bfloat16, CPU)
    key = library_key(model, cache, {"quantize": "int4"})
    assert library_key(model, cache, {"quantize": "int4"}) == key
    assert library_key(model, cache, {"quantize": "int8"}) != key
    assert library_key(model, KVCache(model.config, MAX_BATCH, CONTEXT * 2, torch.bfloat16, CPU),
                       {"quantize": "int4"}) != key
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert library_key(model, cache, {"quantize": "int4"}) != key


def test_a_compile_failure_leaves_the_traced_step_serving_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("C++ compile error: g++ exited 1")

    monkeypatch.setattr(model_runner, "CompiledDecode", fail)
    model = load_model("tiny", CPU, torch.bfloat16).model
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(model, 2, 32, CPU, torch.bfloat16, "int4", trace_decode=True, compile_decode=True)
    assert runner.compiled_decode == "failed, the traced step serves: RuntimeError"
    assert {"event": "decode_compile_failed", "log_level": "warning", "error_type": "RuntimeError",
            "error": "C++ compile error: g++ exited 1"} in logs
    assert type(runner._decode).__name__ == "TracedDecode"


def test_the_compiled_steps_module_runs_the_models_layers_eagerly_whatever_attention_it_is_given() -> None:
    """What export traces (`_Layers`, the model's `_forward` bound to a module of its own) runs
    eagerly in a fast test, with the engine's prompt attention set on the model: a `_forward` that
    reached for an attribute only `LlamaForCausalLM` has failed every `--quantize auto` start on a
    CPU with AVX-512 BF16 (engine_start_failed, 2026-12-07) while this file's compile tests, CI's
    only, were the one place it ran."""
    from engine_service.model.compiled_decode import _Layers
    from engine_service.model.kv_cache import rows_mask

    model = load_model("tiny", torch.device("cpu"), torch.float32).model
    model.pack_projections()
    model.setup_rope(CONTEXT, torch.device("cpu"))
    cache = KVCache(model.config, 2, CONTEXT, torch.float32, torch.device("cpu"))
    tokens, positions = torch.tensor([5]), torch.tensor([3])
    k, v = [cache.k[layer, :1] for layer in range(2)], [cache.v[layer, :1] for layer in range(2)]
    with torch.inference_mode():
        plain = _Layers(model)(tokens, positions, rows_mask(positions[None, :]), k, v)

    def unused(*args: object) -> torch.Tensor:
        raise AssertionError("a decode step has no prompt chunk")

    model.use_prompt_attention(unused)
    with torch.inference_mode():
        assert torch.equal(_Layers(model)(tokens, positions, rows_mask(positions[None, :]), k, v), plain)
