"""What a sequence produced since the last look: the one shape a step's output has on its way from
the decode loop, through the request's stream, to the RPC."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs
from shared.errors import EngineError

if TYPE_CHECKING:  # annotations only
    from engine_service.scheduling.sequence import Sequence


@dataclass(frozen=True)
class Delta:
    """`tokens` with the text they release (stop strings hold some back, output_text.py) and their
    log-probabilities (one per token, when asked for); the echoed prompt's on the first; `finish` or
    `error` on the last. The loop makes one per sequence a step (at `at`, monotonic); the request's
    stream joins those its reader has not taken yet into one (runtime/engine.py)."""

    seq: Sequence
    tokens: tuple[int, ...]
    finish: FinishReason | None = None
    error: EngineError | None = None
    at: float = 0.0
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def ends(self) -> bool:
        return self.finish is not None or self.error is not None
