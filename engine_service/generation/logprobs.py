"""Log-probabilities of chosen tokens and their most likely alternatives (DecodeRequest.top_logprobs
and echo_prompt_logprobs).

They are the model's own: log_softmax of the raw logits, before logit_bias, penalties, the
response_format's mask, temperature and top-k/top-p/min-p (vLLM's default "raw" logprobs), so
that a caller scoring text gets the same numbers whatever it sampled with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """One TokenLogprobs per row of `logits` (N, V), float32, for `tokens` (N) chosen from them,
    with the `top` most likely tokens of each row. Vectorised over rows and vocabulary."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None])[:, 0]
    if top:
        values, ids = torch.topk(logprobs, top, dim=-1)
        tops = [tuple(zip(row_ids, row_values, strict=True)) for row_ids, row_values in
                zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprobs(token, value, alternatives)
            for token, value, alternatives in zip(tokens, chosen.tolist(), tops, strict=True)]
