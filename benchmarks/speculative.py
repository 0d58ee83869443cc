"""Prompt-lookup speculation (`--speculative ngram`) on an input-grounded task, and what it costs
where it cannot help, measured in alternation.

    python benchmarks/speculative.py [--model smollm2] [--engine-args "..."] [--tokens 6] [--rounds 4]

Two engines at once, the same flags but for `--speculative ngram --speculative-tokens K` on the
second (by default the engine's defaults otherwise): each started once, and while one is measured
the other waits idle, its decode loop asleep. Each round measures both at each point in turn, in
the order plain, ngram on even rounds and ngram, plain on odd ones (ABBA), so the machine's drift
(20-30% between runs on some of our machines, and up to 2x within minutes) falls on both alike,
seconds apart:
1. one stream: the model is asked (as a chat) to repeat a given passage of about 300 tokens
   exactly, greedy, 256 new tokens; output tok/s = tokens / (last token - request sent);
2. 8 and 32 at once: 128 random token ids each, 256 new tokens (`--at-once-tokens`), ignore_eos
   (nothing to look up but what random text repeats by chance): output tok/s over the whole point,
   and over the window while every stream decodes (from the last stream's first token to the first
   stream's last), where there is one: a whole point's rate holds the prompts' admission too, whose
   steps each engine's learned prefill budget sizes its own way. With 64 new tokens (until
   2026-12-06) that was 5.4-8.0 s of a 7.7-10.5 s point at 32 at once on an AMD EPYC of the Zen 4
   class, and it moved the point more than speculation's own cost did (rounds 0.76-1.22x).
Prints each round's figures, their ratios and the draft tokens the ngram engine accepted at each
point, then per point the ratio of the two engines' mean tok/s over the rounds, with the median
and range of the rounds' own ratios (targets: >= 1.8 at one stream, >= 0.95 at 8 and 32), and the
same over the windows, in the rounds that had one.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_client.prompts import make_prompt
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.machine.cpu import detect
from tools.local_engine import EngineProcess

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for forty years the same keeper had climbed its "
    "stairs every evening at dusk. He trimmed the wick, polished the great lens until it shone, and wrote in his "
    "logbook the state of the wind, the sea and the sky. Ships that passed in the night never saw him, only the "
    "steady beam that swept across the water every ten seconds, but the captains knew his light and trusted it. "
    "When the storms of winter came, the waves broke over the rock and salt spray reached the lantern room itself. "
    "On those nights he did not sleep at all; he sat by the lamp with a pot of tea and listened to the wind. In the "
    "spring the fishermen from the village brought him bread, letters and news, and he gave them fish he had "
    "caught from the rocks and the weather he had written down. When at last he retired, the light was made "
    "automatic, and it still turns every ten seconds, though no one climbs the stairs at dusk any more."
)
VOCAB, SPECIAL = 40003, (0, 1, 2)


async def repeat_once(stub: engine_pb2_grpc.EngineServiceStub, new_tokens: int) -> tuple[float, int, int]:
    """(output tok/s, draft tokens, accepted) for one greedy request to repeat the passage."""
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=(
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"))])
    started, count, last = time.perf_counter(), 0, None
    async for msg in stub.Decode(pb.DecodeRequest(chat=chat, max_new_tokens=new_tokens)):
        count += len(msg.token_ids)
        last = msg
    elapsed = time.perf_counter() - started
    return count / elapsed, last.usage.speculative_draft_tokens, last.usage.speculative_accepted_tokens


async def at_once(stub: engine_pb2_grpc.EngineServiceStub, n: int, seed: int,
                  new_tokens: int) -> tuple[float, float | None, int, int]:
    """(output tok/s over the point, tok/s while all n decode, draft tokens, accepted) for n
    requests of random ids at once, `new_tokens` each."""
    async def one(i: int) -> tuple[list[float], int, int]:
        ids = list(make_prompt(seed=seed, length=128, index=i, vocab_size=VOCAB, avoid=SPECIAL))
        stamps, last = [], None
        async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                                      max_new_tokens=new_tokens, ignore_eos=True)):
            stamps.extend([time.perf_counter()] * len(msg.token_ids))
            last = msg
        return stamps, last.usage.speculative_draft_tokens, last.usage.speculative_accepted_tokens

    started = time.perf_counter()
    streams = await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - started
    return (sum(len(s[0]) for s in streams) / elapsed, decoding_rate([s[0] for s in streams]),
            sum(s[1] for s in streams), sum(s[2] for s in streams))


def decoding_rate(stamps: list[list[float]]) -> float | None:
    """Output tok/s while every stream decodes: the tokens that arrive after the last stream's
    first and up to the first stream's last, over that window; None where the window holds fewer
    than 2 of each stream's tokens (a stream finished before the last was admitted)."""
    opened, closed = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    inside = sum(1 for s in stamps for t in s if opened < t <= closed)
    if closed <= opened or inside < 2 * len(stamps):
        return None
    return inside / (closed - opened)


POINTS = ("one", "at8", "at32")


async def warm_up(address: str) -> None:
    """A short request and a point of 8, before any is timed (the engine's first steps warm its caches)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await repeat_once(stub, 16)
        await at_once(stub, 8, seed=1, new_tokens=64)


async def measure(address: str, point: str, new_tokens: int, at_once_tokens: int, seed: int) -> dict[str, float]:
    """One point on one engine: its tok/s (and, at once, while all decode), its draft tokens and
    accepted ones."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        if point == "one":
            rate, drafted, accepted = await repeat_once(stub, new_tokens)
            return {"rate": rate, "drafted": drafted, "accepted": accepted}
        n = int(point.removeprefix("at"))
        rate, decoding, drafted, accepted = await at_once(stub, n, seed=seed + n, new_tokens=at_once_tokens)
        return {"rate": rate, "drafted": drafted, "accepted": accepted,
                **({"decoding": decoding} if decoding is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engine-args", default="", help="further engine flags for both engines")
    parser.add_argument("--tokens", default="6", help="--speculative-tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="the one stream's new tokens")
    parser.add_argument("--at-once-tokens", type=int, default=256,
                        help="each request's new tokens at 8 and 32 at once (64 until 2026-12-06: the points were "
                             "mostly their prompts' admission, and at 32 no window while all decode was left)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both engines, alternating their order")
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 1 or args.at_once_tokens < 1:
        parser.error(f"--rounds {args.rounds}, --new-tokens {args.new_tokens} and --at-once-tokens "
                     f"{args.at_once_tokens} must be positive")
    # the product's defaults (threads, the compiled one-row step) unless --engine-args says otherwise
    base = ["--model", args.model, "--max-context", "2048", "--threads", "0", "--compile-decode", "auto",
            *shlex.split(args.engine_args)]
    flags = {"plain": [], "ngram": ["--speculative", "ngram", "--speculative-tokens", args.tokens]}
    print(f"# CPU: {detect().describe()}")
    results: dict[str, dict[str, list[dict[str, float]]]] = {name: {p: [] for p in POINTS} for name in flags}
    with ExitStack() as stack:
        # one after the other: the first start compiles the one-row step, the second finds it on disk
        address = {name: stack.enter_context(EngineProcess(*base, *extra, start_timeout=300)).address
                   for name, extra in flags.items()}
        for name in flags:
            asyncio.run(warm_up(address[name]))
        for r in range(args.rounds):
            order = list(flags) if r % 2 == 0 else list(reversed(flags))
            for point in POINTS:  # both engines point by point: the machine drifts less in seconds than in a round
                for name in order:  # the same prompts for both engines in a round, new ones each round
                    results[name][point].append(asyncio.run(measure(address[name], point, args.new_tokens,
                                                                    args.at_once_tokens, seed=100 * r)))
            print(f"round {r + 1} ({', '.join(order)}): " + "; ".join(
                f"{point} {results['plain'][point][-1]['rate']:.1f} -> {results['ngram'][point][-1]['rate']:.1f} tok/s"
                f" ({results['ngram'][point][-1]['rate'] / results['plain'][point][-1]['rate']:.2f}x), accepted "
                f"{results['ngram'][point][-1]['accepted']:.0f} of {results['ngram'][point][-1]['drafted']:.0f} drafted"
                for point in POINTS), flush=True)
    targets = {"one": 1.8, "at8": 0.95, "at32": 0.95}
    labels = {"one": "one stream", "at8": "8 at once", "at32": "32 at once"}
    for point in POINTS:
        plain = statistics.fmean(r["rate"] for r in results["plain"][point])
        spec = statistics.fmean(r["rate"] for r in results["ngram"][point])
        ratios = [s["rate"] / p["rate"] for p, s in zip(results["plain"][point], results["ngram"][point], strict=True)]
        print(f"{labels[point]:>10}, ngram / plain: {spec / plain:5.2f} of the means ({plain:.1f} -> {spec:.1f} tok/s), "
              f"rounds' median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}  "
              f"(target >= {targets[point]})")
        pairs = [(p["decoding"], s["decoding"]) for p, s in zip(results["plain"][point], results["ngram"][point],
                                                                strict=True) if "decoding" in p and "decoding" in s]
        if pairs:  # the same while every stream decodes: no prompt admitted beside them (--at-once-tokens)
            window = [s / p for p, s in pairs]
            print(f"{'':>10}  while all decode: {statistics.fmean(s for _, s in pairs) / statistics.fmean(p for p, _ in pairs):5.2f} "
                  f"of the means, rounds' median {statistics.median(window):.2f}, range {min(window):.2f}-{max(window):.2f} "
                  f"({len(pairs)} of {len(ratios)} rounds had the window)")

if __name__ == "__main__":
    main()
