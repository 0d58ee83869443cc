"""This checkout's decode step against a git ref's, in one process, timed in alternation.

    python benchmarks/step_ab.py --against REF [--model smollm2] [--rows 1,8,32] [--rounds 200]
                                 [--context 160] [--dtype auto] [--quantize auto] [--compile-decode off]

Two engines timed one after the other drift with the machine (steal time, a busy neighbour, the
clock: 10-30% from run to run on these 2-core machines), more than most single changes move a
step. So both steps are built in this one process and timed in turn, A (REF) then B (this
checkout), round after round:

1. REF's tree is extracted with `git archive` into a temporary directory; its packages are imported
   from there and a ModelRunner is built by its own `build_runner` (runtime/build.py), as its
   engine builds one on this machine: precision, int4 kernels raced and probed, prepacked weights,
   traces, and the compiled one-row step with `--compile-decode auto`. Then its modules leave
   sys.modules and this checkout's are imported to build the second. Each keeps its own code: a
   function holds its module's globals. A ref from before build_runner (2026-12-05) is refused.
2. For each row count: one decode step of every row at `--context` positions on each, whether the
   two give the same logits bit for bit, then `--rounds` rounds of one step on A and one on B.

Prints each side's median and 10th percentile, and B / A for both (below 1: this checkout is
faster). Both runners hold their own weights and KV cache (about 2 x 0.5 GB for SmolLM2 in
bfloat16 with int4 copies at 2,048 positions).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine_service", "shared", "engine", "tools")  # what a checkout's engine imports of its own
MAX_BATCH = 32
MAX_CONTEXT = 2048


class StepAbError(RuntimeError):
    """A step of the comparison failed: the ref, its extraction, a build."""


@dataclass(frozen=True)
class Side:
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the runner's decode: tokens, positions (B,) -> logits (B, V)


def extract(ref: str, into: Path) -> Path:
    """REF's tree, from `git archive`, under `into`."""
    archive = into / "ref.tar"
    try:
        with archive.open("wb") as out:
            subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], stdout=out, check=True,
                           stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as e:
        raise StepAbError(f"git archive of --against {ref!r} failed: {e.stderr.decode(errors='replace').strip()}") from e
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def forget_packages() -> None:
    """Drop every module of PACKAGES from sys.modules, so that the next import reads another tree."""
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]


def build(root: Path, name: str, model: str, dtype: str, quantize: str, compile_decode: str) -> Side:
    """A ModelRunner from the checkout at `root`, built as its engine builds one on this machine
    (its runtime/build.py's `build_runner`: precision, int4 kernels, prepacked weights, traces)."""
    forget_packages()
    sys.path.insert(0, str(root))
    try:
        from engine_service.config import EngineConfig
        from engine_service.machine.cpu import detect
        from engine_service.runtime.build import build_runner

        built = build_runner(EngineConfig(model=model, dtype=dtype, quantize=quantize, max_batch=MAX_BATCH,
                                          max_context=MAX_CONTEXT, compile_decode=compile_decode), detect())
    except ImportError as e:
        raise StepAbError(f"{name} ({root}): the engine's build cannot be imported as this script expects "
                          f"(runtime/build.py's build_runner, from 2026-12-05 on): {e}") from e
    finally:
        sys.path.remove(str(root))
    attention = getattr(built, "attention_reason", None)  # a ref from before 2026-12-05's decode attention has none
    print(f"{name}: {built.loaded.name} in {built.precision.dtype}, quantization {built.precision.quantize} "
          f"({built.precision.reason}{f'; decode attention: {attention}' if attention else ''}; {root})", flush=True)
    return Side(name, built.runner._decode)  # the step the loop runs for a step with no prompt chunk


def compare(a: Side, b: Side, rows: int, context: int, rounds: int) -> None:
    tokens = torch.full((rows,), 100, dtype=torch.long)
    positions = torch.full((rows,), context - 1, dtype=torch.long)
    same = torch.equal(a.step(tokens, positions), b.step(tokens, positions))
    times: dict[str, list[float]] = {a.name: [], b.name: []}
    for _ in range(5):
        a.step(tokens, positions)
        b.step(tokens, positions)
    for _ in range(rounds):
        for side in (a, b):
            started = time.perf_counter()
            side.step(tokens, positions)
            times[side.name].append(time.perf_counter() - started)
    tenth = max(rounds // 10, 1)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    p10 = {n: sorted(t)[tenth - 1] * 1e3 for n, t in times.items()}
    print(f"rows {rows:3}: A {med[a.name]:7.3f} ms (p10 {p10[a.name]:7.3f}), B {med[b.name]:7.3f} ms "
          f"(p10 {p10[b.name]:7.3f}); B / A median {med[b.name] / med[a.name]:.3f}, p10 "
          f"{p10[b.name] / p10[a.name]:.3f}; logits {'bit-identical' if same else 'DIFFER'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git ref to compare with (A)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--compile-decode", default="off", choices=("auto", "off"),
                        help="the one-row compiled step (auto: a first compile takes minutes for each side)")
    parser.add_argument("--rows", default="1,8", help="decoding rows, comma-separated (each at most 32)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--context", type=int, default=160, help="positions each row attends (at most 2,048)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not all(0 < r <= MAX_BATCH for r in rows):
        parser.error(f"--rows {args.rows!r}: each count must be 1..{MAX_BATCH}")
    if not 0 < args.context <= MAX_CONTEXT:
        parser.error(f"--context {args.context}: must be 1..{MAX_CONTEXT}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    try:
        with tempfile.TemporaryDirectory(prefix="step-ab-") as tmp:
            a = build(extract(args.against, Path(tmp)), f"A ({args.against})", args.model, args.dtype, args.quantize,
                      args.compile_decode)
            b = build(ROOT, "B (this checkout)", args.model, args.dtype, args.quantize, args.compile_decode)
            for n in rows:
                compare(a, b, n, args.context, args.rounds)
    except StepAbError as e:
        sys.exit(f"step_ab: {e}")


if __name__ == "__main__":
    main()
