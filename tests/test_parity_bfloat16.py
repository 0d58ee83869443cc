"""bfloat16 agreement with transformers in bfloat16.

Two bfloat16 implementations cannot agree bit for bit: bfloat16 keeps 8 significant bits, so each
matmul rounds differently with a different operation order (our SDPA prefill and hand-written
decode attention against transformers' eager attention), and transformers' own bfloat16 run
already departs from its float32 run by ~0.1 in the logits here. Near-ties then flip the argmax,
and in free-running greedy decoding one flip changes every later token. So the tolerance is set
against transformers' own bfloat16 error, and on measures that do not compound:

1. Teacher-forced logits (prompt + the float32 greedy continuation, all positions): our bfloat16
   error against the float32 reference is at most 1.5x transformers' bfloat16 error (measured
   0.9x-1.05x over all six arch/tied cases), and our top-1 agrees with float32 no less than 3
   points below transformers' bfloat16 (measured 96-99% for both).
2. The decode path, teacher-forced on the tokens transformers' bfloat16 `generate` chose: our
   bfloat16 argmax equals its token at >= 95% of steps (measured 98.8-100%).
3. Free-running batched greedy against bfloat16 `generate`: wherever the two first differ, the
   two tokens are a near-tie in float32 itself: on the shared prefix, their float32 logits differ
   by less than 2x transformers' own bfloat16 logit error (so neither bfloat16 run can be called
   wrong there). Most prompts agree on all their first 8 tokens (measured 2-5 of 5 per case;
   bfloat16 `generate` itself leaves float32 greedy within 4-13 tokens on some prompts).
"""

from __future__ import annotations

import pytest
import torch

from engine_service.model.kv_cache import KVCache
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.loader import load_model
from tests.checkpoints import PROMPTS, engine_greedy, hf_greedy, hf_model, make_checkpoint, pad_batch

CPU = torch.device("cpu")
NEW_TOKENS = 32
ERROR_RATIO = 1.5
TOP1_SLACK = 0.03
DECODE_AGREEMENT = 0.95
FREE_RUN_TOKENS, FREE_RUN_PROMPTS = 8, 2
NEAR_TIE = 2.0


def _forced_decode(model: LlamaForCausalLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Our argmax at each step while feeding `continuations` through prefill + decode as one batch."""
    context = max(len(p) for p in prompts) + NEW_TOKENS
    model.pack_projections()
    model.setup_rope(context, CPU)
    cache = KVCache(model.config, len(prompts), context, model.model.embed_tokens.weight.dtype, CPU)
    tokens, lengths = pad_batch(prompts, CPU)
    chosen = [model.prefill(tokens, lengths, cache, first_row=0).argmax(-1)]
    positions = lengths.clone()
    for step in range(NEW_TOKENS - 1):
        fed = torch.tensor([c[step] for c in continuations])
        chosen.append(model.decode(fed, positions, cache).argmax(-1))
        positions += 1
    return torch.stack(chosen, dim=1).tolist()


# One case per architecture, tied and untied both covered (bfloat16 `generate` is slow on CPU).
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("mistral", True), ("qwen2", False)])
def test_bfloat16_agrees_with_transformers_bfloat16(tmp_path, arch: str, tied: bool) -> None:  # type: ignore[no-untyped-def]
    directory = make_checkpoint(tmp_path, arch, tied)
    ours = load_model(str(directory), CPU, torch.bfloat16)
    ref32, ref16 = hf_model(directory, torch.float32), hf_model(directory, torch.bfloat16)
    prompts = [ours.tokenizer.encode(text) for text in PROMPTS]

    # 1. teacher-forced logits against the float32 reference
    sequences = [p + hf_greedy(ref32, p, NEW_TOKENS) for p in prompts]
    context = max(len(s) for s in sequences)
    ours.model.pack_projections()
    ours.model.setup_rope(context, CPU)
    cache = KVCache(ours.config, len(sequences), context, torch.bfloat16, CPU)
    tokens, lengths = pad_batch(sequences, CPU)
    our_logits = ours.model.prefill(tokens, lengths, cache, first_row=0, all_logits=True)
    our_error = hf_error = 0.0
    our_top1 = hf_top1 = positions = 0
    for row, sequence in enumerate(sequences):
        with torch.no_grad():
            exact = ref32(torch.tensor([sequence])).logits[0]
            theirs = ref16(torch.tensor([sequence])).logits[0].float()
        mine = our_logits[row, :len(sequence)]
        our_error = max(our_error, (mine - exact).abs().max().item())
        hf_error = max(hf_error, (theirs - exact).abs().max().item())
        our_top1 += int((mine.argmax(-1) == exact.argmax(-1)).sum())
        hf_top1 += int((theirs.argmax(-1) == exact.argmax(-1)).sum())
        positions += len(sequence)

    # 2. the decode path, teacher-forced on transformers' bfloat16 choices
    theirs16 = [hf_greedy(ref16, p, NEW_TOKENS) for p in prompts]
    forced = _forced_decode(ours.model, prompts, theirs16)
    decode_agreement = sum(a == b for x, y in zip(forced, theirs16, strict=True)
                           for a, b in zip(x, y, strict=True)) / (NEW_TOKENS * len(prompts))

    # 3. free-running batched greedy: every first disagreement is a float32 near-tie
    free = engine_greedy(ours.model, prompts, NEW_TOKENS, CPU)
    same_start = sum(x[:FREE_RUN_TOKENS] == y[:FREE_RUN_TOKENS] for x, y in zip(free, theirs16, strict=True))
    worst_gap = 0.0
    for prompt, mine_tokens, their_tokens in zip(prompts, free, theirs16, strict=True):
        differ = next((i for i, (a, b) in enumerate(zip(mine_tokens, their_tokens, strict=True)) if a != b), None)
        if differ is None:
            continue
        with torch.no_grad():
            exact = ref32(torch.tensor([prompt + mine_tokens[:differ]])).logits[0, -1]
        worst_gap = max(worst_gap, (exact[mine_tokens[differ]] - exact[their_tokens[differ]]).abs().item())

    print(f"{arch} tied={tied}: max|err| ours {our_error:.3f} vs transformers-bf16 {hf_error:.3f}; "
          f"top-1 vs fp32 ours {our_top1 / positions:.3f} transformers-bf16 {hf_top1 / positions:.3f}; "
          f"forced decode agreement {decode_agreement:.3f}; "
          f"free-run first {FREE_RUN_TOKENS} equal {same_start}/{len(prompts)}, "
          f"worst float32 gap at a first disagreement {worst_gap:.3f}")
    assert our_error <= ERROR_RATIO * hf_error
    assert our_top1 / positions >= hf_top1 / positions - TOP1_SLACK
    assert decode_agreement >= DECODE_AGREEMENT
    assert worst_gap < NEAR_TIE * hf_error
    assert same_start >= FREE_RUN_PROMPTS
