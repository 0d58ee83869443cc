"""`python -m drills [--quick] [NAME ...]`: run the drills, print the markdown table, exit 1 if one failed."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

import grpc

from drills import compose, crash, drain, fuzz, fuzz_front, fuzz_http, http_peer, overload, readers, replicas, seqfaults
from drills.common import note
from drills.row import DrillRow, markdown_table

DRILLS: dict[str, Callable[[bool], DrillRow]] = {
    fuzz.NAME: fuzz.run,
    fuzz_front.NAME: fuzz_front.run,
    fuzz_http.NAME: fuzz_http.run,
    overload.NAME: overload.run,
    readers.NAME: readers.run,
    crash.NAME: crash.run,
    drain.NAME: drain.run,
    seqfaults.NAME: seqfaults.run,
    replicas.NAME: replicas.run,
    http_peer.NAME: http_peer.run,
}
# Run only when named: they need what a plain checkout may not have (a Docker daemon) and are not
# among "all" (nor tests/test_drills.py's parametrization over DRILLS). CI runs them where they can run.
OPT_IN: dict[str, Callable[[bool], DrillRow]] = {
    compose.NAME: compose.run,
}
# A drill's one-sentence outcome, printed last (e.g. `compose: 3 replicas, 2 kills, 480 requests, 0 lost`).
OUTCOMES: dict[str, Callable[[DrillRow], str]] = {compose.NAME: compose.outcome}


def run_one(name: str, quick: bool) -> DrillRow:
    """Run a drill; if its own machinery breaks (an engine that never starts, a port taken), the
    row says so and fails. A bug in a drill is not caught: it stops the run loudly."""
    started = time.monotonic()
    try:
        row = {**DRILLS, **OPT_IN}[name](quick)
    except (RuntimeError, OSError, grpc.RpcError, subprocess.SubprocessError, TimeoutError) as err:
        row = DrillRow(name, "(could not run)", "-", f"drill could not run: {type(err).__name__}: {err}"[:300], 0,
                       False)
    note(name, f"{'pass' if row.passed else 'FAIL'} in {time.monotonic() - started:.1f} s")
    return row


def totals(rows: list[DrillRow]) -> str:
    """The headline figures across the drills that ran (those that did not run are left out). A
    count that several drills report (client kill -9, resumes tested) is summed over them."""
    fig = {k: v for r in rows for k, v in r.figures.items()}
    summed = {k: sum(int(r.figures[k]) for r in rows if k in r.figures)  # type: ignore[call-overload]
              for k in ("client kill -9", "resumes tested") if k in fig}
    fig.update(summed)
    parts = []
    if "cases fuzzed" in fig:
        parts.append(f"cases fuzzed {fig['cases fuzzed']}")
    if "peak callers" in fig:
        parts.append(f"peak load held {fig['peak callers']} callers, {fig['calls/s']} calls/s "
                     f"({fig['completed/s']} completed/s)")
    faults = [f"{fig[k]} {label}" for k, label in (("faults injected", "sequence faults"),
                                                    ("engine crashes survived", "engine crashes"),
                                                    ("client kill -9", "client kill -9"),
                                                    ("llama-server kill -9", "llama-server kill -9"))
              if k in fig]
    if faults:
        parts.append("faults injected and survived: " + " + ".join(faults))
    if "resumes tested" in fig:
        parts.append(f"resumes tested {fig['resumes tested']}")
    parts.append(f"results lost {sum(r.lost for r in rows)}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drills", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the shortened CI version, with the same assertions")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"drills to run (default: all): {', '.join(DRILLS)}; only when named: {', '.join(OPT_IN)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in DRILLS and n not in OPT_IN]
    if unknown:
        parser.error(f"unknown drill {unknown[0]!r}; known: {', '.join([*DRILLS, *OPT_IN])}")
    rows = [run_one(name, args.quick) for name in (args.names or DRILLS)]
    print(markdown_table(rows))
    print(f"\n{totals(rows)}")
    for r in rows:
        if r.drill in OUTCOMES:
            print(OUTCOMES[r.drill](r))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
