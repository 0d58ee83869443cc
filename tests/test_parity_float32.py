"""float32 parity with transformers on random checkpoints of each architecture: logits within
1e-4, and greedy decoding of a batch of prompts of different lengths equal to `generate`'s ids."""

from __future__ import annotations

import pytest
import torch

from engine_service.model.kv_cache import KVCache
from engine_service.model.loader import LoadedModel, load_model
from tests.checkpoints import (
    ARCHS,
    LLAMA3_ROPE,
    PROMPTS,
    engine_greedy,
    hf_greedy,
    hf_model,
    make_checkpoint,
    pad_batch,
)

CPU = torch.device("cpu")
ATOL = 1e-4
NEW_TOKENS = 32
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}

CASES = [(arch, tied, {}) for arch in ARCHS for tied in (False, True)] + [
    ("llama", False, {"sharded": True, "rope_scaling": LLAMA3_ROPE}),
    ("qwen2", True, {"rope_scaling": LINEAR_ROPE}),
]
IDS = [f"{arch}-{'tied' if tied else 'untied'}" for arch, tied, _ in CASES[:-2]] + [
    "llama-untied-sharded-llama3rope", "qwen2-tied-linearrope"]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    arch, tied, extra = request.param
    directory = make_checkpoint(tmp_path_factory.mktemp("ckpt"), arch, tied, **extra)
    loaded = load_model(str(directory), CPU, torch.float32)
    return loaded, hf_model(directory)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths must differ"
    return prompts


def test_logits_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    loaded, reference = pair
    prompts = _prompts(loaded)
    context = max(len(p) for p in prompts)
    loaded.model.pack_projections()
    loaded.model.setup_rope(context, CPU)
    cache = KVCache(loaded.config, len(prompts), context, torch.float32, CPU)
    tokens, lengths = pad_batch(prompts, CPU)
    ours = loaded.model.prefill(tokens, lengths, cache, first_row=0, all_logits=True)  # (B, T, V)
    worst = 0.0
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0]
        worst = max(worst, (ours[row, :len(prompt)] - theirs).abs().max().item())
    print(f"max |logit difference| over {len(prompts)} prompts: {worst:.2e}")
    assert worst <= ATOL


def test_batched_greedy_decode_equals_generate(pair) -> None:  # type: ignore[no-untyped-def]
    """All prompts decode as one batch here; transformers runs each alone (no padding), so equal
    ids also show that batching does not change results."""
    loaded, reference = pair
    prompts = _prompts(loaded)
    ours = engine_greedy(loaded.model, prompts, NEW_TOKENS, CPU)
    theirs = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    assert ours == theirs
