"""Chunked prefill: do running streams keep flowing while a long prompt prefills, and what does the
long prompt pay for it?

    python benchmarks/chunked_prefill.py [--model smollm2] [--dtype auto] [--quantize auto] [--budgets auto,96,2048]
                                         [--rounds 3] [--steps DIR]

For each per-step prefill budget (`--max-prefill-tokens`; the first is the engine's default), one
engine, a warm-up prompt, then `--rounds` rounds (3 by default), each measuring two things back to
back, in the order alone, with streams on odd rounds and the reverse on even ones (ABBA: this
machine class's speed moves 1.5-2x within minutes, and one measurement of each put that drift into
the ratio, 1.45x to 4.0x over three runs of one setting):
1. alone: a 2,000-token prompt (max 2 new tokens) with nothing else running; its TTFT, measured
   by the client from the call to the first token (distinct tokens each time so that the prefix
   cache never helps);
2. with 8 steady streams: 8 requests (64-token prompts, decoding long) run until each has 24
   tokens; their inter-token gaps over the next 2 s give the median TPOT before; then another
   2,000-token prompt arrives. Its TTFT, and the largest gap of any steady stream from its
   arrival to its first token (plus 0.5 s), are recorded; the streams are cancelled, and the
   round waits until the engine runs none of them (so an "alone" prompt after it is alone).

Prints, per budget and round, both ratios: largest gap / median TPOT before (target <= 4) and TTFT
with the streams / TTFT alone in the same round (target <= 1.6); then their medians over the rounds,
and the budget's median TTFT alone over the first budget's (what chunking costs a prompt on an idle
engine).

With `--steps`, where the long prompt beside the streams was layer-sliced, each round's TTFT with
the streams is also taken apart, in units of that round's TTFT alone, from the engine's steps
(`sliced_prompts`): the sliced work (the steps' time beyond their decoding rows' part), the
decoding parts, and the time between the steps; and S, a step's time in decoding parts (medians).
They explain the ratio: about work x S / (S - 1) + between, with S held near 3 by the gap bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_client.prompts import make_prompt
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.machine.cpu import detect
from shared.heap import frozen_heap
from tools.local_engine import EngineProcess

VOCAB, SPECIAL = 40003, (0, 1, 2)  # SmolLM2's ids 3..40002: no special token
LONG = 2000
STEADY = 8
STEADY_PROMPT = 64


@dataclass(frozen=True)
class SlicedPrompt:
    """One layer-sliced prompt's steps, as the engine logged them (seconds)."""

    steps: int
    work: float  # the steps' time beyond their decoding rows' part: the prompt's sublayers
    decoding: float  # the decoding rows' parts
    between: float  # from the first step's start to the last one's end, less the steps' time
    factor: float  # S: the median step over the median decoding part


def sliced_prompts(events: Sequence[dict]) -> list[SlicedPrompt]:
    """The layer-sliced prompts in `events` (the engine's `sliced_prefill_step` events, others
    ignored, in the order logged), a prompt's steps from one whose span starts at sublayer 0, row 0
    to the next such. A prompt with a step whose decoding part was not timed is left out
    (`decode_part_ms` null: its rows had all left, or the engine runs off a CPU, where it times
    none). An event is logged as its step ends, so a prompt's wall time runs from its first event's
    time less that step's to its last event's."""
    prompts: list[list[dict]] = []
    for e in events:
        if e["event"] != "sliced_prefill_step":
            continue
        if not prompts or (e["sublayers"][0], e["rows"][0]) == (0, 0):
            prompts.append([])
        prompts[-1].append(e)
    out = []
    for group in prompts:
        if any(e["decode_part_ms"] is None for e in group):
            continue
        ms = [e["ms"] for e in group]
        decoding = [e["decode_part_ms"] for e in group]
        wall = (_seconds(group[-1]["timestamp"]) - _seconds(group[0]["timestamp"])) * 1e3 + ms[0]
        out.append(SlicedPrompt(steps=len(group), work=(sum(ms) - sum(decoding)) / 1e3, decoding=sum(decoding) / 1e3,
                                between=(wall - sum(ms)) / 1e3,
                                factor=statistics.median(ms) / statistics.median(decoding)))
    return out


def _seconds(timestamp: str) -> float:
    """An event's ISO 8601 time (structlog's, UTC with a Z, which Python 3.11 reads) as seconds since the epoch."""
    return datetime.fromisoformat(timestamp).timestamp()


def prompt(seed: int, length: int) -> list[int]:
    """Reproducible ids of one vocabulary range, distinct for each seed (the prefix cache never helps)."""
    return list(make_prompt(seed=seed, length=length, index=0, vocab_size=VOCAB, avoid=SPECIAL))


async def ttft(stub: engine_pb2_grpc.EngineServiceStub, ids: list[int]) -> float:
    started = time.perf_counter()
    async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=2,
                                                  ignore_eos=True)):
        if msg.token_ids:
            return time.perf_counter() - started
    raise RuntimeError("the long prompt produced no token")


async def with_streams(stub: engine_pb2_grpc.EngineServiceStub, seed: int) -> tuple[float, float, float]:
    """(median TPOT before, largest gap after the arrival, the long prompt's TTFT) in seconds."""
    stamps: list[list[float]] = [[] for _ in range(STEADY)]
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        call = stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt(seed + 1 + i, STEADY_PROMPT)),
                                            max_new_tokens=1500, ignore_eos=True))
        async for msg in call:
            stamps[i].extend([time.perf_counter()] * len(msg.token_ids))
            if stop.is_set():
                call.cancel()
                return

    tasks = [asyncio.create_task(stream(i)) for i in range(STEADY)]
    while min(len(s) for s in stamps) < 24:
        await asyncio.sleep(0.05)
    steady_from = time.perf_counter()
    await asyncio.sleep(2.0)
    arrival = time.perf_counter()
    before = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if a >= steady_from and b <= arrival]
    long_ttft = await ttft(stub, prompt(seed, LONG))
    await asyncio.sleep(0.5)
    until = arrival + long_ttft + 0.5
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if b > arrival and a < until]
    stop.set()
    await asyncio.gather(*tasks)  # each stream cancelled its call and returned; an error here is real
    await idle(stub)
    return statistics.median(before), max(gaps), long_ttft


async def idle(stub: engine_pb2_grpc.EngineServiceStub) -> None:
    """Wait until the engine runs no sequence: a cancelled stream leaves it at its next step, and an
    "alone" prompt sent before that would be sliced beside it for a step (a TTFT alone that is not)."""
    deadline = time.perf_counter() + 10
    while (await stub.GetLoad(pb.GetLoadRequest(), timeout=5)).running_sequences:
        if time.perf_counter() > deadline:
            raise RuntimeError("the engine still runs sequences 10 s after every stream was cancelled")
        await asyncio.sleep(0.01)


async def measure(address: str, seed: int, rounds: int) -> list[tuple[float, float, float, float]]:
    """Per round: (TTFT alone, median TPOT before, largest gap, TTFT with the streams) in seconds."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await ttft(stub, prompt(seed + 100, LONG))  # warm-up
        for r in range(rounds):
            base = seed + 1000 * (r + 1)
            # each prompt alone waits until the engine runs nothing: ttft() leaves at the first of
            # a prompt's two tokens, and a prompt alone sent while the one before still decoded its
            # second was sliced beside it for a step (seen: 30 ms of a 1.9-s TTFT alone)
            if r % 2 == 0:
                await idle(stub)
                alone = await ttft(stub, prompt(base + 200, LONG))
                tpot, gap, loaded = await with_streams(stub, base + 300)
            else:
                tpot, gap, loaded = await with_streams(stub, base + 300)
                await idle(stub)
                alone = await ttft(stub, prompt(base + 200, LONG))
            out.append((alone, tpot, gap, loaded))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto", help="the engine's --quantize (auto, none, int8, int4)")
    parser.add_argument("--budgets", default="auto,96",
                        help="--max-prefill-tokens values (auto or a count), comma-separated (the first is the reference)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both measurements, alternating their order")
    parser.add_argument("--steps", type=Path, metavar="DIR",
                        help="write each budget's prefilling steps (the engine's debug events prefill_step and "
                             "sliced_prefill_step: rows, tokens, sublayers, ms, the budget's estimates) to "
                             "DIR/steps-BUDGET.jsonl")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be positive, got {args.rounds}")
    budgets = args.budgets.split(",")
    first_alone = None
    print(f"# CPU: {detect().describe()}")
    print(f"# {args.model} dtype {args.dtype}, quantize {args.quantize}: {STEADY} streams ({STEADY_PROMPT}-token prompts) + one {LONG}-token prompt")
    for n, budget in enumerate(budgets):
        with EngineProcess("--model", args.model, "--dtype", args.dtype, "--quantize", args.quantize,
                           "--max-prefill-tokens", budget,
                           "--max-context", "2048", "--threads", "0", "--compile-decode", "auto",
                           start_timeout=300,  # the product's defaults; a first compile is minutes
                           env={"ENGINE_LOG_LEVEL": "debug"} if args.steps else None) as proc:
            with frozen_heap():  # no full collection of this client's heap stops its clocks mid-round
                rounds = asyncio.run(measure(proc.address, 100_000 * (n + 1), args.rounds))
            sliced: list[SlicedPrompt] = []
            if args.steps:
                args.steps.mkdir(parents=True, exist_ok=True)
                steps = sorted(proc.events_named("prefill_step") + proc.events_named("sliced_prefill_step"),
                               key=lambda e: e["timestamp"])
                (args.steps / f"steps-{budget}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
                sliced = sliced_prompts(steps)
        for r, (alone, tpot, gap, loaded) in enumerate(rounds):
            print(f"budget {budget:>5}, round {r + 1}: TTFT alone {alone * 1e3:7.0f} ms, with streams {loaded * 1e3:7.0f} ms "
                  f"({loaded / alone:.2f}x); steady TPOT median {tpot * 1e3:5.1f} ms, largest gap {gap * 1e3:6.0f} ms "
                  f"({gap / tpot:.2f}x)", flush=True)
        if len(sliced) == len(rounds):  # one sliced prompt a round: the long one beside the streams
            for r, ((alone, *_), p) in enumerate(zip(rounds, sliced, strict=True)):
                print(f"  round {r + 1}, the prompt's {p.steps} sliced steps in TTFTs alone: work {p.work / alone:.2f}, "
                      f"decoding parts {p.decoding / alone:.2f}, between {p.between / alone:.2f}; "
                      f"a step {p.factor:.2f} decoding parts (medians)")
        elif args.steps:
            print(f"  (the steps show {len(sliced)} sliced prompts for {len(rounds)} rounds: not taken apart)")
        alone = statistics.median(r[0] for r in rounds)
        first_alone = first_alone or alone
        gaps = [r[2] / r[1] for r in rounds]
        ttfts = [r[3] / r[0] for r in rounds]
        print(f"  largest gap / median TPOT before     : {statistics.median(gaps):6.2f} median, rounds "
              f"{min(gaps):.2f}-{max(gaps):.2f}  (target <= 4)")
        print(f"  TTFT with 8 streams / TTFT alone      : {statistics.median(ttfts):6.2f} median, rounds "
              f"{min(ttfts):.2f}-{max(ttfts):.2f}  (target <= 1.6)")
        print(f"  TTFT alone / TTFT alone at {budgets[0]:>5}     : {alone / first_alone:6.2f}")

if __name__ == "__main__":
    main()
