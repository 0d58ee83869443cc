"""The one row every drill returns, the checks that decide it, and the markdown table."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DrillRow:
    drill: str
    done: str  # what the drill did
    expected: str  # what the contract says must happen
    happened: str  # what did happen ("as expected", or the first failed checks)
    lost: int  # requests or results lost: must be 0
    passed: bool
    figures: dict[str, object] = field(default_factory=dict)


class Checks:
    """Collects failed expectations instead of stopping at the first, so a row says all it saw."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, condition: bool, failure: str) -> bool:
        if not condition:
            self.failures.append(failure)
        return condition

    def row(self, drill: str, done: str, expected: str, lost: int, figures: dict[str, object],
            happened: str = "as expected") -> DrillRow:
        if lost:
            self.failures.append(f"{lost} lost")
        if self.failures:
            shown = "; ".join(self.failures[:4])
            more = len(self.failures) - 4
            happened = shown + (f"; and {more} more" if more > 0 else "")
        return DrillRow(drill, done, expected, happened, lost, not self.failures, figures)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _figures(figures: dict[str, object]) -> str:
    return ", ".join(f"{k} {v}" for k, v in figures.items())


def markdown_table(rows: Iterable[DrillRow]) -> str:
    lines = ["| drill | what was done | expected | what happened | lost | result | key figures |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = (r.drill, r.done, r.expected, r.happened, r.lost, "pass" if r.passed else "FAIL", _figures(r.figures))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
