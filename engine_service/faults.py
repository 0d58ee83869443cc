"""Fault injection, off by default, so tests and drills can prove both halves of the recovery
policy: `sequence-error` (one sequence raises SequenceError) and `crash` (the loop raises an
unexpected RuntimeError)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import SequenceError


@dataclass(frozen=True)
class FaultPlan:
    """Parsed `--fault` flags. Steps count from 1 and only steps that ran a sequence count."""

    sequence_error_steps: frozenset[int] = frozenset()
    sequence_error_rate: float = 0.0
    sequence_error_seed: int = 0
    crash_step: int | None = None

    @classmethod
    def parse(cls, specs: list[str]) -> FaultPlan:
        """Parse `sequence-error:step=N`, `sequence-error:rate=P[,seed=S]` and `crash:step=N`."""
        steps: set[int] = set()
        rate, seed, crash = 0.0, 0, None
        for spec in specs:
            kind, _, args = spec.partition(":")
            values = dict(part.split("=", 1) for part in args.split(",") if "=" in part)
            if kind == "sequence-error" and "step" in values:
                steps.add(_int(spec, values["step"]))
            elif kind == "sequence-error" and "rate" in values:
                rate = float(values["rate"])
                if not 0.0 < rate <= 1.0:
                    raise ValueError(f"--fault {spec!r}: rate must be in (0, 1], got {rate}")
                seed = _int(spec, values.get("seed", "0"), minimum=0)
            elif kind == "crash" and "step" in values:
                crash = _int(spec, values["step"])
            else:
                raise ValueError(
                    f"--fault must be sequence-error:step=N, sequence-error:rate=P[,seed=S] or crash:step=N, got {spec!r}"
                )
        return cls(frozenset(steps), rate, seed, crash)

    def dooms(self, request_id: str) -> bool:
        """Whether `sequence-error:rate=P,seed=S` dooms this request: a pure function of the id,
        so a drill knows in advance exactly which requests must end ABORTED."""
        if not self.sequence_error_rate:
            return False
        digest = zlib.crc32(f"{self.sequence_error_seed}:{request_id}".encode())
        return digest / 2**32 < self.sequence_error_rate


def _int(spec: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--fault {spec!r}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"--fault {spec!r}: must be >= {minimum}, got {value}")
    return value


class FaultInjector:
    """Owned by the decode loop thread."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    def before_forward(self, step: int) -> None:
        if self.plan.crash_step == step:
            raise RuntimeError(f"injected crash at decode step {step} (--fault crash:step={step})")

    def doomed_rows(self, step: int, request_ids: Sequence[str], generated: Sequence[int]) -> set[int]:
        """Rows whose sequence raises SequenceError at this step: row 0 at a configured step, and
        each doomed request (see FaultPlan.dooms) when it has produced exactly one token."""
        rows = {0} if step in self.plan.sequence_error_steps and request_ids else set()
        if self.plan.sequence_error_rate:
            rows |= {row for row, rid in enumerate(request_ids) if generated[row] == 1 and self.plan.dooms(rid)}
        return rows

    @staticmethod
    def fail(request_id: str, generated_tokens: int, step: int) -> SequenceError:
        return SequenceError.build(request_id, generated_tokens, f"injected sequence error at decode step {step}")
