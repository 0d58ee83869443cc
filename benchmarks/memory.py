"""Engine resident memory under load: it must stay within weights + KV cache + a fixed overhead,
and not grow over a long run.

    python benchmarks/memory.py [--model small] [--requests 2000] [--concurrency 32]
    python benchmarks/memory.py --model smollm2 --distinct-prefixes --prompt 512 --max-context 640

Starts the engine, reads its RSS (/proc/PID/status VmRSS) when ready, after a warm-up, and after
`--requests` requests at full batch, and prints the figures and the overhead beyond weights + KV.
With `--distinct-prefixes` every prompt is new tokens from its first block on, so each request
offers the prefix cache blocks it has never seen: the store fills, then evicts, and RSS must stop
growing at its capacity (`--prefix-cache-tokens`, printed in MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_client.prompts import make_prompt
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.config import DEFAULT_PREFIX_CACHE_TOKENS
from engine_service.model.kv_cache import KVCache
from engine_service.model.presets import PRESETS
from tools.local_engine import EngineProcess

MIB = 1024 * 1024


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory now (VmRSS), or its peak so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


async def run(address: str, requests: int, concurrency: int, prompt: int, new: int, distinct: bool = False,
              first: int = 0) -> int:
    done = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        todo = iter(range(requests))

        async def worker() -> None:
            nonlocal done
            for i in todo:
                n = first + i
                ids = (list(make_prompt(seed=0, length=prompt, index=n, vocab_size=256)) if distinct
                       else [(i * 7 + j) % 256 for j in range(prompt)])
                count = 0
                async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                                              max_new_tokens=new, ignore_eos=True)):
                    count += len(msg.token_ids)
                if count != new:
                    raise RuntimeError(f"request {i} produced {count} tokens, expected {new}")
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a preset (small, smollm2, ...) or a .gguf file")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--distinct-prefixes", action="store_true",
                        help="every prompt new from its first token (fills and then evicts the prefix cache)")
    parser.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    config = model_config(args.model)
    dtype = getattr(torch, args.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in _param_shapes(config)) * size
    per_token = KVCache(config, 1, 1, dtype, torch.device("meta")).bytes_per_token()
    kv = per_token * args.concurrency * args.max_context
    store = per_token * args.prefix_cache_tokens
    with EngineProcess("--model", args.model, "--dtype", args.dtype, "--max-batch", str(args.concurrency),
                       "--max-context", str(args.max_context), "--threads", "0",
                       "--prefix-cache-tokens", str(args.prefix_cache_tokens)) as proc:
        pid = proc.proc.pid
        ready, loading_peak = rss_bytes(pid), rss_bytes(pid, "VmHWM")
        warmup = args.concurrency * 2
        asyncio.run(run(proc.address, warmup, args.concurrency, args.prompt, args.new, args.distinct_prefixes))
        warm = rss_bytes(pid)
        half = args.requests // 2
        asyncio.run(run(proc.address, half, args.concurrency, args.prompt, args.new, args.distinct_prefixes, warmup))
        middle, store_used = rss_bytes(pid), proc.load().prefix_cache_used_tokens
        done = half + asyncio.run(run(proc.address, args.requests - half, args.concurrency, args.prompt, args.new,
                                      args.distinct_prefixes, warmup + half))
        end = rss_bytes(pid)
        store_end = proc.load().prefix_cache_used_tokens
    print(f"# {args.model} {args.dtype}, max-batch {args.concurrency}, max-context {args.max_context}, {done} requests "
          f"({args.prompt} prompt + {args.new} new tokens{', distinct prefixes' if args.distinct_prefixes else ''})")
    print(f"weights {weights / MIB:8.1f} MiB   KV cache {kv / MIB:8.1f} MiB   prefix cache "
          f"{args.prefix_cache_tokens} tokens = {store / MIB:8.1f} MiB at most")
    print(f"prefix cache used: {store_used} tokens after {warmup + half} requests, {store_end} after all")
    print(f"RSS after {warmup + half} requests {middle / MIB:8.1f} MiB; growth over the second half "
          f"{(end - middle) / MIB:+8.1f} MiB")
    print(f"peak RSS up to ready (loading) {loading_peak / MIB:8.1f} MiB = {loading_peak / (weights + kv):.2f}x "
          f"weights ({args.dtype}, dequantized) + KV")
    print(f"RSS ready {ready / MIB:8.1f} MiB   after warm-up {warm / MIB:8.1f} MiB   after {done} requests {end / MIB:8.1f} MiB")
    print(f"overhead beyond weights + KV + the full prefix cache after the run: "
          f"{(end - weights - kv - store) / MIB:8.1f} MiB")
    print(f"growth over the run (end - warm-up): {(end - warm) / MIB:+8.1f} MiB")


def model_config(spec: str):  # type: ignore[no-untyped-def]
    """The architecture of a preset, packaged model or GGUF file, without loading its weights."""
    from engine_service.model.gguf_checkpoint import parse_config
    from engine_service.model.gguf_reader import read_gguf
    from engine_service.model.presets import PACKAGED

    if spec in PRESETS:
        return PRESETS[spec]
    return parse_config(read_gguf(PACKAGED[spec].locate(spec) if spec in PACKAGED else Path(spec)))


def _param_shapes(config):  # type: ignore[no-untyped-def]
    from engine_service.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        return list(LlamaForCausalLM(config).parameters())


if __name__ == "__main__":
    main()
