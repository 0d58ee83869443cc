"""One point of the sweep's grid: the key its record is found by, and the tag its prompts are drawn by."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PointSpec:
    context_tokens: int
    max_new_tokens: int
    concurrency: int
    request_rate: float
    prefix_tokens: int = 0  # the shared prefix of each prompt (workload.prefix_tokens)
    prefix_groups: int = 1

    def tag(self) -> str:
        """The point's name in request ids and prompt seeds (context 0 / new tokens 0: the dataset's own)."""
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        prefix = f"-p{self.prefix_tokens}g{self.prefix_groups}" if self.prefix_tokens else ""
        return f"c{self.context_tokens}-n{self.max_new_tokens}-x{self.concurrency}-r{rate}{prefix}"
