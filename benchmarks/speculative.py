"""Prompt-lookup speculation (`--speculative ngram`) on an input-grounded task, and what it costs
where it cannot help.

    python benchmarks/speculative.py [--model smollm2] [--engine-args "..."] [--tokens 6]

Two engines in turn, the same flags but for `--speculative ngram --speculative-tokens K` on the
second (by default the engine's defaults otherwise). For each:
1. one stream: the model is asked (as a chat) to repeat a given passage of about 300 tokens
   exactly, greedy, 256 new tokens; output tok/s = tokens / (last token - request sent), best of 2
   after a warm-up;
2. 8 and 32 at once: 128 random token ids each, 64 new tokens, ignore_eos (nothing to look up
   but what random text repeats by chance): output tok/s over the whole point.
Prints each figure, speculation's ratio over plain decoding (target: >= 1.8 at one stream,
>= 0.95 at 8 and 32), and the draft tokens accepted per request at one stream.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
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


async def at_once(stub: engine_pb2_grpc.EngineServiceStub, n: int, seed: int) -> float:
    async def one(i: int) -> int:
        ids = list(make_prompt(seed=seed, length=128, index=i, vocab_size=VOCAB, avoid=SPECIAL))
        count = 0
        async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=64,
                                                      ignore_eos=True)):
            count += len(msg.token_ids)
        return count

    started = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return total / (time.perf_counter() - started)


async def measure(address: str, new_tokens: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await repeat_once(stub, 16)  # warm-up
        runs = [await repeat_once(stub, new_tokens) for _ in range(2)]
        best = max(runs)
        out = {"one": best[0], "drafted": best[1], "accepted": best[2]}
        for n in (8, 32):
            out[f"at{n}"] = await at_once(stub, n, seed=n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--engine-args", default="", help="further engine flags for both engines")
    parser.add_argument("--tokens", default="6", help="--speculative-tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    # the product's defaults (threads, the compiled one-row step) unless --engine-args says otherwise
    base = ["--model", args.model, "--max-context", "2048", "--threads", "0", "--compile-decode", "auto",
            *shlex.split(args.engine_args)]
    print(f"# CPU: {detect().describe()}")
    results = {}
    for name, extra in (("plain", []), ("ngram", ["--speculative", "ngram", "--speculative-tokens", args.tokens])):
        with EngineProcess(*base, *extra, start_timeout=300) as proc:
            results[name] = asyncio.run(measure(proc.address, args.new_tokens))
        r = results[name]
        print(f"{name:>5}: one stream repeating {r['one']:6.1f} tok/s (drafted {r['drafted']:.0f}, accepted "
              f"{r['accepted']:.0f}); 8 at once {r['at8']:6.1f} tok/s; 32 at once {r['at32']:6.1f} tok/s", flush=True)
    plain, spec = results["plain"], results["ngram"]
    print(f"one stream, ngram / plain : {spec['one'] / plain['one']:5.2f}  (target >= 1.8)")
    print(f"8 at once,  ngram / plain : {spec['at8'] / plain['at8']:5.2f}  (target >= 0.95)")
    print(f"32 at once, ngram / plain : {spec['at32'] / plain['at32']:5.2f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
