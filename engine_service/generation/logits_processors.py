"""Per-row logits processing before the sampler (engine_service/generation/sampler.py): what a request's
SamplingParams change in its raw logits before temperature, top-k, top-p and min-p.

`process(logits, params, penalties, generated, banned)` takes the batch's raw logits (B, V),
float32, one row per producing sequence, and applies to each row whose `params.processed` is true,
in this order (each step reads the logits the step before it wrote):

1. logit_bias (OpenAI): `logit[id] += bias` for each (id, bias) of the request, the bias first
   rounded to float32;
2. the min_new_tokens mask (transformers' MinNewTokensLengthLogitsProcessor): while the row has
   generated fewer than `min_new_tokens` tokens, `logit[id] = -inf` for every id in `banned[row]`
   (the caller's EOS ids and stop_token_ids); from `generated == min_new_tokens` on, nothing;
3. the repetition penalty (transformers' RepetitionPenaltyLogitsProcessor, over the prompt and
   the output): for each token seen at least once in either, `logit * p` where `logit < 0`,
   else `logit / p`, applied once however often the token was seen;
4. the presence and frequency penalties (OpenAI, over the output only):
   `logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`, with `c[j]` the
   count of token j in the output so far.

Rows whose params are not processed are left as they are and cost nothing but the batch's one
copy: when no row is processed `process` returns `logits` itself; otherwise it returns a new
tensor (the caller's tensor is never written: raw log-probabilities are read from it) in which
only the processed rows were worked on. Each step is tensor operations over the row (or over the
sequence's distinct tokens); the one Python loop is over the processed rows, never over the
vocabulary or the history.

`Penalties` is the per-sequence state steps 3 and 4 read, built once per sequence from its prompt
and advanced with `add` by each step's new output tokens: the output counts (V,) float32, whether
each token was seen in the prompt or the output (V,) bool, and the distinct ids of each as index
tensors (steps 3 and 4 gather and scatter over those, not over all V), never recounted from the
whole history.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine_service.requests import SamplingParams


class Penalties:
    """What the repetition, presence and frequency penalties of one sequence read: `counts` (V,)
    float32, how often each token occurs in the output so far, and `seen` (V,) bool, whether it
    occurs in the prompt or the output; and the same as index lists, which is what `process`
    reads (a sequence sees far fewer distinct tokens than the vocabulary holds): `seen_ids`, the
    distinct tokens of the prompt and the output, and `output_ids`, those of the output, each in
    the order first seen. All four grow by what each step adds; nothing is recounted."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self._seen: set[int] = set()
        self._output: set[int] = set()
        self.seen_ids = torch.zeros(0, dtype=torch.long, device=device)
        self.output_ids = self.seen_ids
        if prompt_ids:
            self.seen[self._ids(prompt_ids, "prompt_ids")] = True
            self.seen_ids = self._grow(self.seen_ids, self._seen, prompt_ids)

    def add(self, tokens: Sequence[int]) -> None:
        """Count this step's new output tokens (any number, repeats included)."""
        if not tokens:
            return
        ids = self._ids(tokens, "tokens")
        self.counts.index_put_((ids,), torch.ones(len(tokens), dtype=torch.float32, device=self.device),
                               accumulate=True)
        self.seen[ids] = True
        self.seen_ids = self._grow(self.seen_ids, self._seen, tokens)
        self.output_ids = self._grow(self.output_ids, self._output, tokens)

    def _ids(self, ids: Sequence[int], name: str) -> torch.Tensor:
        # checked here: an id out of range on an accelerator is a device-side assert, not an IndexError
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name} must be in [0, vocab_size {self.vocab_size}), got {bad}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _grow(self, ids: torch.Tensor, known: set[int], tokens: Sequence[int]) -> torch.Tensor:
        """`ids` with those of `tokens` not in `known` appended (once each), `known` updated."""
        new = [t for t in dict.fromkeys(tokens) if t not in known]
        if not new:
            return ids
        known.update(new)
        return torch.cat([ids, torch.tensor(new, dtype=torch.long, device=self.device)])


def process(logits: torch.Tensor, params: Sequence[SamplingParams], penalties: Sequence[Penalties | None],
            generated: Sequence[int], banned: Sequence[frozenset[int]], in_place: bool = False) -> torch.Tensor:
    """`logits` (B, V) with each processed row's bias, min_new_tokens mask and penalties applied
    (see the module docstring); `logits` itself when no row is processed or `in_place` (its
    processed rows changed), else a new tensor (a caller that still needs the raw rows: copying
    the batch costs about 0.35 ms at 32 x 49,152, which the rows without penalties would pay)."""
    if len(params) != logits.shape[0] or not (len(penalties) == len(generated) == len(banned) == len(params)):
        raise ValueError(f"params, penalties, generated and banned must each have one entry per row of logits "
                         f"({logits.shape[0]}), got {len(params)}, {len(penalties)}, {len(generated)}, {len(banned)}")
    rows = [(i, p) for i, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    out = logits if in_place else logits.clone()
    for i, p in rows:
        row = out[i]
        if p.logit_bias:
            ids, values = _bias(p.logit_bias, out.device, out.dtype)
            row.index_add_(0, ids, values)
        if generated[i] < p.min_new_tokens and banned[i]:
            row.index_fill_(0, _banned_ids(banned[i], out.device), float("-inf"))
        if p.penalized:
            state = penalties[i]
            if state is None:
                raise ValueError(f"row {i} is penalized ({p}) but has no Penalties")
            if p.repetition_penalty != 1.0:
                penalty, ids = p.repetition_penalty, state.seen_ids
                seen = row[ids]
                # A tiny penalty (down to the smallest float32) divides a positive logit to +inf,
                # which no sampler can draw from: the largest float instead (masked -inf stays).
                penalized = torch.where(seen < 0, seen * penalty, seen / penalty)
                row.index_copy_(0, ids, penalized.nan_to_num_(posinf=torch.finfo(row.dtype).max,
                                                              neginf=float("-inf")))
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                # every token of output_ids has a count > 0: its presence term is the whole penalty
                ids = state.output_ids
                penalty = (state.counts[ids] * p.frequency_penalty).add_(p.presence_penalty)
                row.index_copy_(0, ids, row[ids].sub_(penalty))
    return out


@functools.lru_cache(maxsize=1024)
def _bias(logit_bias: tuple[tuple[int, float], ...], device: torch.device,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (ids, values) tensors, built once per distinct bias and device."""
    ids = torch.tensor([token for token, _ in logit_bias], dtype=torch.long, device=device)
    return ids, torch.tensor([bias for _, bias in logit_bias], dtype=dtype, device=device)


@functools.lru_cache(maxsize=1024)
def _banned_ids(tokens: frozenset[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(sorted(tokens), dtype=torch.long, device=device)
