"""What the logits processors (engine_service/generation/logits_processors.py) cost a decode step: the time
of `process` + `sample` for one batch of 32 rows of vocabulary 49,152, float32, with 0, 1, 8 and
32 of its rows penalized, in one run.

    python benchmarks/penalties.py [--rows 32] [--vocab 49152] [--repeats 30] [--sampled-repeats 8] [--threads N] [--device cpu]

A penalized row has repetition_penalty 1.1, presence_penalty 0.5 and frequency_penalty 0.5, a
512-token prompt and 128 tokens of output so far; the other rows have the same sampling but no
penalty. Two batches are measured: every row greedy, and every row sampled (temperature 0.8,
top_p 0.95: the sampler's own sort dominates, so fewer steps, --sampled-repeats). Each figure is
the median over --repeats steps, the configurations taken in turn so
that the machine's drift reaches them alike. Prints, for each batch, the times, then what one
penalized row costs the unpenalized rows: the extra time of the batch with 1 penalized row over
the batch with none (ms and ratio), less that row's own processing (the per-row slope from 1 to
32 penalized rows), which leaves the batch-wide part (the one copy of the logits that `process`
makes so as not to write the caller's tensor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_service.generation.logits_processors import Penalties, process
from engine_service.generation.sampler import new_generator, sample
from engine_service.machine.cpu import detect
from engine_service.requests import SamplingParams

PENALIZED_COUNTS = (0, 1, 8, 32)
PROMPT, OUTPUT = 512, 128
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
BASES = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_p=0.95)}


def batch(base: SamplingParams, penalized: int, rows: int, vocab: int,
          device: torch.device) -> tuple[list[SamplingParams], list[Penalties | None]]:
    """The first `penalized` rows penalized (each with its own prompt and output), the rest plain."""
    params, states = [], []
    for row in range(rows):
        seed = replace(base, seed=row)
        if row < penalized:
            g = torch.Generator().manual_seed(row)
            state = Penalties(torch.randint(0, vocab, (PROMPT,), generator=g).tolist(), vocab, device)
            state.add(torch.randint(0, vocab, (OUTPUT,), generator=g).tolist())
            params.append(replace(seed, **PENALTIES))
            states.append(state)
        else:
            params.append(seed)
            states.append(None)
    return params, states


def timed(step: Callable[[], object], device: torch.device) -> float:
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(base: SamplingParams, repeats: int, args: argparse.Namespace, device: torch.device,
            logits: torch.Tensor) -> dict[int, tuple[float, float]]:
    """{penalized rows: (median process s, median process + sample s)}"""
    setups = {n: batch(base, n, args.rows, args.vocab, device) for n in PENALIZED_COUNTS}
    generated, banned = [OUTPUT] * args.rows, [frozenset({0})] * args.rows
    processed: dict[int, list[float]] = {n: [] for n in PENALIZED_COUNTS}
    total: dict[int, list[float]] = {n: [] for n in PENALIZED_COUNTS}
    for repeat in range(repeats + 2):  # the first two warm up
        for n, (params, states) in setups.items():
            generators = [new_generator(p, device) for p in params]
            out: list[torch.Tensor] = []
            fresh = logits.clone()  # changed in place, as the decode loop does when no row asks for logprobs
            t_process = timed(lambda params=params, states=states, out=out, fresh=fresh: out.append(
                process(fresh, params, states, generated, banned, in_place=True)), device)
            t_sample = timed(lambda params=params, generators=generators, out=out: sample(out[0], params, generators),
                             device)
            if repeat >= 2:
                processed[n].append(t_process)
                total[n].append(t_process + t_sample)
    return {n: (statistics.median(processed[n]), statistics.median(total[n])) for n in PENALIZED_COUNTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=30, help="steps per figure, greedy batch")
    parser.add_argument("--sampled-repeats", type=int, default=8, help="steps per figure, sampled batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"# CPU: {detect().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {device}")
    print(f"# batch {args.rows} x vocab {args.vocab} float32; penalized rows: {PENALTIES}, {PROMPT}-token prompt, "
          f"{OUTPUT} output tokens")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        for name, base in BASES.items():
            repeats = args.repeats if base.greedy else args.sampled_repeats
            times = measure(base, repeats, args, device, logits)
            zero_total = times[0][1]
            print(f"\n{name} rows (temperature {base.temperature}, top_p {base.top_p}), median of {repeats}:")
            print("  penalized   process ms   process+sample ms   vs 0 penalized")
            for n, (t_process, t_total) in times.items():
                print(f"  {n:>9}   {t_process * 1e3:10.3f}   {t_total * 1e3:17.3f}   "
                      f"{(t_total - zero_total) * 1e3:+8.3f} ms  x{t_total / zero_total:.3f}")
            one, full = times[1][1], times[PENALIZED_COUNTS[-1]][1]
            slope = (full - one) / (PENALIZED_COUNTS[-1] - 1)
            extra = one - zero_total
            print(f"  1 penalized row among {args.rows}: +{extra * 1e3:.3f} ms (x{one / zero_total:.3f}); "
                  f"its own processing ~{slope * 1e3:.3f} ms (slope 1->{PENALIZED_COUNTS[-1]}), "
                  f"leaving {(extra - slope) * 1e3:+.3f} ms "
                  f"(x{(zero_total + extra - slope) / zero_total:.3f}) on the {args.rows - 1} unpenalized rows")
    state = Penalties(list(range(PROMPT)), args.vocab, device)
    adds = [timed(lambda: state.add([7]), device) for _ in range(200)]
    print(f"\nPenalties.add(1 token): median {statistics.median(adds) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
