"""Summarise a `mutmut run` (what `make mutate` does): the score per module, and every mutant left
alive checked against docs/mutation-survivors.toml, where each one is explained.

    python tools/mutation_report.py             # the table, then what is unexplained or stale
    python tools/mutation_report.py --markdown  # the table and the survivors, for docs/mutation-testing.md

Score = (killed + timeout) / (mutants - equivalent): a mutant that makes a test hang is caught, and
an equivalent mutant (no test can tell it from the original) is out of the count. A survivor that
is not equivalent counts against the score, explained or not. Exit status 1 when a module scores
under the target, or a survivor is not explained in the file, or an entry there no longer matches.
Run from the repository root after `mutmut run`; it reads mutants/*.meta.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parent.parent
SURVIVORS = ROOT / "docs" / "mutation-survivors.toml"
TARGET = 0.95  # every module (the developers guide; issue 10 asked 90%)
VERDICTS = ("equivalent", "missing")
KILLED = ("killed", "timeout", "caught by type check")


@dataclass(frozen=True)
class Entry:
    """One explained survivor from docs/mutation-survivors.toml."""

    name: str
    change: str
    verdict: str
    reason: str


@dataclass
class ModuleScore:
    path: str
    counts: Counter[str]
    equivalent: int

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def caught(self) -> int:
        return sum(self.counts[s] for s in KILLED)

    @property
    def score(self) -> float:
        counted = self.total - self.equivalent
        return self.caught / counted if counted else 1.0


def modules() -> list[str]:
    """The modules `make mutate` mutates: [tool.mutmut] only_mutate in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return list(config["tool"]["mutmut"]["only_mutate"])


def load_entries(path: Path) -> dict[str, Entry]:
    data = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    entries: dict[str, Entry] = {}
    for raw in data.get("mutant", []):
        entry = Entry(name=raw["name"], change=raw["change"], verdict=raw["verdict"], reason=raw["reason"])
        if entry.verdict not in VERDICTS:
            raise ValueError(f"{path}: verdict of {entry.name} must be one of {VERDICTS}, got {entry.verdict!r}")
        if entry.name in entries:
            raise ValueError(f"{path}: {entry.name} is listed twice")
        entries[entry.name] = entry
    return entries


def change_of(name: str, module: str) -> str:
    """The mutated lines of a mutant, one string: its `+` lines, or its `-` lines when it only deletes."""
    diff = get_diff_for_mutant(name, path=module).splitlines()[2:]  # past the ---/+++ header
    added = [line[1:].strip() for line in diff if line.startswith("+")]
    removed = [line[1:].strip() for line in diff if line.startswith("-")]
    return " / ".join(added) if added else "deleted: " + " / ".join(removed)


def statuses(module: str) -> dict[str, str]:
    meta = ROOT / "mutants" / (module + ".meta")
    if not meta.exists():
        raise FileNotFoundError(f"{meta} does not exist: run `mutmut run` (or `make mutate`) first")
    exit_codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return {name: status_by_exit_code[code] for name, code in exit_codes.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the table and survivors as markdown")
    args = parser.parse_args(argv)

    entries = load_entries(SURVIVORS)
    scores: list[ModuleScore] = []
    survivors: list[tuple[str, str, str, Entry | None]] = []  # module, name, change, entry
    problems: list[str] = []
    seen: set[str] = set()
    for module in modules():
        by_name = statuses(module)
        equivalent = 0
        for name, status in sorted(by_name.items(), key=lambda item: _natural(item[0])):
            entry = entries.get(name)
            if entry is not None:
                seen.add(name)
            if status in KILLED:
                if entry is not None:
                    problems.append(f"stale: {name} is listed in {SURVIVORS.name} but was {status}")
                continue
            change = change_of(name, module)
            if entry is None:
                problems.append(f"unexplained: {name} ({status}): {change}")
            elif entry.change != change:
                problems.append(f"stale: {name} now mutates {change!r}, the entry says {entry.change!r}")
            elif entry.verdict == "equivalent":
                equivalent += 1
            survivors.append((module, name, change, entry))
        scores.append(ModuleScore(module, Counter(by_name.values()), equivalent))
    problems += [f"stale: {name} is listed in {SURVIVORS.name} but no longer exists" for name in entries
                 if name not in seen]
    problems += [f"below target: {s.path} scores {s.score:.1%}, under {TARGET:.0%}" for s in scores
                 if s.score < TARGET]

    if args.markdown:
        print(_markdown(scores, survivors))
    else:
        print(_table(scores))
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def _natural(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("__mutmut_")
    return stem, int(number) if number.isdigit() else 0


def _label(name: str) -> str:
    """`Class.method #7` for mutmut's `module.xǁClassǁmethod__mutmut_7`, `function #7` for `module.x_function__mutmut_7`."""
    stem, _, number = name.rpartition(".")[2].rpartition("__mutmut_")
    stem = stem[2:].replace("ǁ", ".") if stem.startswith("xǁ") else stem.removeprefix("x_")
    return f"{stem} #{number}"


def _columns(s: ModuleScore) -> list[str]:
    c = s.counts
    return [s.path, str(s.total), str(c["killed"] + c["caught by type check"]), str(c["timeout"]),
            str(c["survived"]), str(c["no tests"]), str(c["suspicious"] + c["segfault"] + c["not checked"]),
            str(s.equivalent), f"{s.score:.1%}"]


HEADER = ["module", "mutants", "killed", "timeout", "survived", "no tests", "other", "equivalent", "score"]


def _table(scores: list[ModuleScore]) -> str:
    rows = [HEADER] + [_columns(s) for s in scores]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                   strict=True)))
             for row in rows]
    total_caught = sum(s.caught for s in scores)
    total_counted = sum(s.total - s.equivalent for s in scores)
    lines.append(f"overall: {total_caught} of {total_counted} non-equivalent mutants caught "
                 f"({total_caught / max(total_counted, 1):.1%}); target {TARGET:.0%} per module")
    return "\n".join(lines)


def _markdown(scores: list[ModuleScore], survivors: list[tuple[str, str, str, Entry | None]]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(_columns(s)) + " |" for s in scores]
    for module in dict.fromkeys(m for m, *_ in survivors):
        out += ["", f"### `{module}`", ""]
        for _, name, change, entry in (s for s in survivors if s[0] == module):
            verdict = entry.verdict if entry else "UNEXPLAINED"
            reason = entry.reason if entry else ""
            out.append(f"- `{_label(name)}` `{change}`: **{verdict}**. {reason}".rstrip())
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
