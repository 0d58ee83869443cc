"""A request's generation controls, as one object the decode loop asks.

`Controls` is built once per request when it is submitted, from its `Request` and what the engine
compiled for it (its streamed text with the stop strings, its response_format's constraint), and
holds every per-request part of generation: the seeded generator and the penalties' state (made
when its prefill starts, `start`), the min_new_tokens mask, the constraint, the stop strings, the
log-probabilities (per token, and the echoed prompt's), and prompt-lookup speculation's n-gram
index with its draft counts. The loop asks it three things: to prepare logits and choose tokens
(`choose`, over a batch of rows), to accept each token (`accept`: its text and whether it ends the
sequence), and to take the step's kept tokens (`advance`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from engine_service.generation.constraint import Constraint, apply_masks
from engine_service.generation.logits_processors import Penalties, process
from engine_service.generation.logprobs import TokenLogprobs, token_logprobs
from engine_service.generation.output_text import OutputText
from engine_service.generation.sampler import new_generator, sample
from engine_service.generation.speculative import NgramIndex, SpeculativeConfig, verify
from engine_service.requests import Request


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


class Controls:
    """Mutable; only the decode loop thread touches it once its request is queued."""

    def __init__(self, request: Request, text: OutputText | None = None, constraint: Constraint | None = None) -> None:
        self.request = request
        self.text = text  # its streamed text and stop strings
        self.constraint = constraint  # its response_format's matcher (compiled when it arrived)
        self.generator: torch.Generator | None = None  # seeded sampling's, from `start`
        self.penalties: Penalties | None = None  # the tokens seen, from `start`, when its sampling penalizes them
        self.ngram: NgramIndex | None = None  # its text's n-grams, once speculation drafts for it
        self.draft_tokens = 0  # speculated tokens verified for it
        self.accepted_tokens = 0  # of those, accepted
        self.prompt_logprobs: list[TokenLogprobs] = []  # echo_prompt_logprobs, chunk by chunk

    def start(self, device: torch.device, vocab_size: Callable[[], int]) -> None:
        """Its prefill begins: the generator of its seed, and, when its sampling penalizes, the
        penalties' state from its prompt (sized by `vocab_size()`, asked only then)."""
        self.generator = new_generator(self.request.sampling, device)
        if self.request.sampling.penalized:
            self.penalties = Penalties(self.request.prompt_ids, vocab_size(), device)

    @property
    def plain(self) -> bool:
        """Its logits are sampled as the model gives them (no bias, penalty, min_new_tokens mask or
        grammar): what speculation's verification needs."""
        return not self.request.sampling.processed and self.constraint is None

    def banned(self, generated: int, end_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens min_new_tokens holds back while fewer than it are `generated`: EOS and the
        stop tokens; a constrained row's EOS stays its grammar's (once complete it allows EOS alone)."""
        if self.request.sampling.min_new_tokens <= generated:
            return frozenset()
        ends = end_token_ids if self.constraint is None else frozenset()
        return ends | self.request.stop_token_ids

    def accept(self, token: int, generated: int, end_token_ids: frozenset[int]) -> tuple[str, FinishReason | None]:
        """`token`, the `generated`-th output token: the text it releases (stop strings hold some
        back; all of it when it ends the sequence), and why the sequence ends with it, or None."""
        text = self.text.push(token) if self.text is not None else ""
        if self.constraint is not None:
            self.constraint.consume((token,))
        finish = self._finish(token, generated, end_token_ids)
        if finish is not None and self.text is not None:
            text += self.text.flush()
        return text, finish

    def _finish(self, token: int, generated: int, end_token_ids: frozenset[int]) -> FinishReason | None:
        request = self.request
        if token in request.stop_token_ids:
            return FinishReason.STOP
        if self.text is not None and self.text.stop_string is not None:
            return FinishReason.STOP
        if self.constraint is not None and self.constraint.done:
            return FinishReason.STOP
        if token in end_token_ids and not request.ignore_eos:
            return FinishReason.EOS
        if generated >= request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def advance(self, kept: Sequence[int]) -> None:
        """This step's kept tokens join what the n-gram index and the penalties have seen."""
        if self.ngram is not None:
            self.ngram.extend(kept)
        if self.penalties is not None:
            self.penalties.add(kept)

    def logprobs(self, logits: torch.Tensor, tokens: Sequence[int]) -> tuple[TokenLogprobs, ...]:
        """The log-probabilities of `tokens`, chosen from the raw rows `logits` (one per token), when
        the request asks for them."""
        top = self.request.top_logprobs
        return tuple(token_logprobs(logits, tokens, top)) if top else ()

    def echo(self, logits: torch.Tensor, targets: Sequence[int]) -> None:
        """Keep the log-probabilities of the prompt tokens `targets` (row j of `logits` predicts
        targets[j]): the echoed prompt's, sent with the first delta."""
        self.prompt_logprobs.extend(token_logprobs(logits, targets, self.request.top_logprobs))

    def draft(self, config: SpeculativeConfig, generated: Sequence[int]) -> list[int]:
        """Speculated tokens to verify after its last one: the n-gram index's proposal, never
        running past max_new_tokens (empty when nothing matches)."""
        if self.ngram is None:
            self.ngram = NgramIndex(config.min_n, config.max_n)
            self.ngram.extend([*self.request.prompt_ids, *generated])
        room = self.request.max_new_tokens - len(generated) - 1  # tokens after this step's first
        return self.ngram.propose(min(config.num_tokens, room)) if room > 0 else []

    def verify(self, draft: Sequence[int], logits: torch.Tensor) -> list[int]:
        """Its tokens this step: `draft` verified against its 1 + len(draft) rows of `logits`."""
        tokens = verify(draft, logits, self.request.sampling, self.generator)
        self.draft_tokens += len(draft)
        self.accepted_tokens += len(tokens) - 1
        return tokens


@torch.inference_mode()  # the model's logits are inference tensors: changed in place only in it
def choose(logits: torch.Tensor, controls: Sequence[Controls], generated: Sequence[int],
           end_token_ids: frozenset[int]) -> list[int]:
    """One token per row of `logits`, row i being the request of `controls[i]` with `generated[i]`
    tokens so far: its logit bias, min_new_tokens mask and penalties (logits_processors.py), its
    response_format's mask (constraint.py), then its sampler. `logits` stays raw when a row asks for
    log-probabilities (they are computed from it)."""
    params = [c.request.sampling for c in controls]
    raw_needed = any(c.request.top_logprobs for c in controls)  # else changed in place: no copy of the batch
    chosen = process(logits, params, [c.penalties for c in controls], generated,
                     [c.banned(n, end_token_ids) for c, n in zip(controls, generated, strict=True)],
                     in_place=not raw_needed)
    constrained = [i for i, c in enumerate(controls) if c.constraint is not None]
    if constrained:
        chosen = apply_masks(chosen.clone() if chosen is logits and raw_needed else chosen, constrained,
                             [controls[i].constraint for i in constrained])
    return sample(chosen, params, [c.generator for c in controls])
