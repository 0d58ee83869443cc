"""The grid of the drills' sweeps (crash, replicas, compose, http): its points and its config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    context_tokens: list[int]
    concurrency: list[int]
    max_new_tokens: int
    requests_per_point: int

    @property
    def points(self) -> set[tuple[int, int, int]]:
        return {(c, self.max_new_tokens, x) for c in self.context_tokens for x in self.concurrency}

    def toml(self, target: str) -> str:
        return "\n".join([
            f'target = "{target}"',
            "[workload]",
            f"context_tokens = {self.context_tokens}",
            f"max_new_tokens = [{self.max_new_tokens}]",
            f"concurrency = {self.concurrency}",
            f"requests_per_point = {self.requests_per_point}",
            "warmup_requests = 0",
            'prompt_format = "token_ids"',  # the tiny engine's ids: the drill is about crashes, not text
            "[policy]",
            "health_wait_s = 2.0",  # shorter than a restart: a crash stops the sweep, to be resumed
            "request_timeout_s = 30.0",
        ]) + "\n"
