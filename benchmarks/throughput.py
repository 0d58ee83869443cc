"""Engine throughput against its raw limit and against Hugging Face transformers, in one run.

    python benchmarks/throughput.py [--model small|smollm2|PATH] [--dtype float32|bfloat16]
                                    [--quantize none|int8] [--peers] [--quick]

Same machine, same weights (`--model`: the `small` preset by default; `smollm2` is the default
model, SmolLM2-135M-Instruct), prompt 128 tokens, 64 new tokens, ignore_eos,
greedy. Prints absolute figures and the ratios the README records:
  1. the engine over gRPC at concurrency 1, 8, 32: output tokens/s, TTFT, TPOT (median, p99);
  2. the raw limit: the engine's model in a bare batched decode loop at batch 1, 8, 32;
  3. transformers `generate` one request at a time, and as one static batch of 32;
  4. with --peers (the default model only): llama.cpp in Q4_1, BF16 and F32 on the same workload
     (benchmarks/llamacpp.py builds it once into a cache), the engine with --quantize int8 and
     int4 at concurrency 1 (and their raw steps), and the ratios of issue 11's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.config import QUANTIZE_METHODS
from engine_service.model.kv_cache import KVCache
from engine_service.model.loader import load_model
from engine_service.model.quantize import quantize_model
from tools.local_engine import EngineProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # benchmarks/llamacpp.py
from llamacpp import PRECISIONS, LlamaCppResult

PROMPT, NEW = 128, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    tokens_per_s: float
    ttft_median: float = 0.0
    ttft_p99: float = 0.0
    tpot_median: float = 0.0
    tpot_p99: float = 0.0


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PROMPT), generator=g).tolist()


async def engine_run(address: str, concurrency: int, requests: int) -> Result:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        ttfts, tpots = [], []
        work = prompts(requests, seed=concurrency)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for p in work:
            queue.put_nowait(p)

        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                start = time.perf_counter()
                first = last = None
                count = 0
                async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=p), max_new_tokens=NEW,
                                                              ignore_eos=True)):
                    now = time.perf_counter()
                    if first is None and msg.token_ids:
                        first = now
                    count += len(msg.token_ids)
                    last = now
                assert count == NEW and first is not None and last is not None
                ttfts.append(first - start)
                tpots.append((last - first) / (NEW - 1))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Result(requests * NEW / elapsed, statistics.median(ttfts), p99(ttfts), statistics.median(tpots), p99(tpots))


def raw_loop(model, batch: int, dtype: torch.dtype, repeats: int) -> Result:  # type: ignore[no-untyped-def]
    """The engine's own model with nothing around it: one batched prefill, then 64 decode steps
    (set up as the engine sets it up: `pack_projections`, `setup_rope`, then any quantization, before this)."""
    cache = KVCache(model.config, batch, PROMPT + NEW, dtype, torch.device("cpu"))
    tokens = torch.tensor(prompts(batch), dtype=torch.long)
    lengths = torch.full((batch,), PROMPT, dtype=torch.long)
    best = float("inf")
    step_times = []
    for _ in range(repeats):
        started = time.perf_counter()
        logits = model.prefill(tokens, lengths, cache, 0)
        nxt = logits.argmax(-1)
        positions = lengths.clone()
        t0 = time.perf_counter()
        for _ in range(NEW - 1):
            nxt = model.decode(nxt, positions, cache).argmax(-1)
            positions += 1
        step_times.append((time.perf_counter() - t0) / (NEW - 1))
        best = min(best, time.perf_counter() - started)
    return Result(batch * NEW / best, tpot_median=statistics.median(step_times), tpot_p99=max(step_times))


def hf_model(model, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                         max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                         bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    hf = LlamaForCausalLM(config).to(dtype).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def hf_generate(hf, batch: int, requests: int) -> Result:  # type: ignore[no-untyped-def]
    work = prompts(requests)
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, requests, batch):
            ids = torch.tensor(work[i:i + batch])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW
    return Result(requests * NEW / (time.perf_counter() - started))


def engine_figures(model: str, dtype: str, quantize: str, concurrencies: dict[int, int]) -> dict[int, Result]:
    eng: dict[int, Result] = {}
    with EngineProcess("--model", model, "--dtype", dtype, "--quantize", quantize, "--max-batch", "32",
                       "--max-context", str(PROMPT + NEW), "--threads", "0", "--queue-capacity", "256",
                       "--compile-decode", "auto", start_timeout=300) as proc:
        asyncio.run(engine_run(proc.address, 4, 4))  # warm-up
        for c, requests in concurrencies.items():
            eng[c] = r = asyncio.run(engine_run(proc.address, c, requests))
            print(f"engine {quantize:>4} conc {c:>2}: {r.tokens_per_s:8.1f} tok/s  TTFT med {r.ttft_median * 1e3:7.1f} ms "
                  f"p99 {r.ttft_p99 * 1e3:7.1f} ms  TPOT med {r.tpot_median * 1e3:6.2f} ms p99 {r.tpot_p99 * 1e3:6.2f} ms",
                  flush=True)
    return eng


def ratio(name: str, value: float, target: str) -> None:
    print(f"{name:<58}: {value:6.2f}  ({target})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a preset (small, smollm2, ...), a .gguf file or a directory")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--quantize", choices=QUANTIZE_METHODS, default="none", help="the engine's --quantize")
    parser.add_argument("--peers", action="store_true",
                        help="also llama.cpp (Q4_1, BF16, F32) and the engine with --quantize int8 and int4 at "
                             "concurrency 1 (--model smollm2)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, noisier)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    args = parser.parse_args()
    if args.peers and args.model != "smollm2":
        parser.error(f"--peers compares with llama.cpp on the default model: pass --model smollm2, not {args.model!r}")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    loaded = load_model(args.model, torch.device("cpu"), dtype)
    model = loaded.model
    model.pack_projections()
    model.setup_rope(PROMPT + NEW, torch.device("cpu"))
    if args.quantize != "none":
        quantize_model(model.projections(), args.quantize)
    per_conc = {1: 4 if args.quick else 8, 8: 16 if args.quick else 32, 32: 32 if args.quick else 96}
    repeats = 2 if args.quick else 3
    print(f"# {args.model}, {args.dtype}, quantize {args.quantize}, prompt {PROMPT}, {NEW} new tokens, greedy, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    raw = {b: raw_loop(model, b, dtype, repeats) for b in (1, 8, 32)}
    for b, r in raw.items():
        print(f"raw loop  batch {b:>2}: {r.tokens_per_s:8.1f} tok/s  step {r.tpot_median * 1e3:7.2f} ms", flush=True)
    eng = engine_figures(args.model, args.dtype, args.quantize, per_conc)

    hf_one = hf_batch = None
    if not args.skip_hf:
        hf = hf_model(model, dtype)
        hf_generate(hf, 1, 1)  # warm-up
        hf_one = hf_generate(hf, 1, 3 if args.quick else 6)
        hf_batch = hf_generate(hf, 32, 32)
        print(f"hf generate one at a time : {hf_one.tokens_per_s:8.1f} tok/s")
        print(f"hf generate static batch 32: {hf_batch.tokens_per_s:8.1f} tok/s", flush=True)

    quantized: dict[str, tuple[Result, Result]] = {}  # method -> (raw batch 1, engine concurrency 1)
    peers: dict[str, LlamaCppResult] = {}
    if args.peers:
        for method in ("int8", "int4"):
            if method == args.quantize:
                quantized[method] = (raw[1], eng[1])
                continue
            quantize_model(model.projections(), method)
            q_raw = raw_loop(model, 1, dtype, repeats)
            print(f"raw loop  {method} batch 1: {q_raw.tokens_per_s:8.1f} tok/s  step {q_raw.tpot_median * 1e3:7.2f} ms")
            quantized[method] = (q_raw, engine_figures(args.model, args.dtype, method, {1: per_conc[1]})[1])
        for precision in PRECISIONS:
            peers[precision] = r = llamacpp.measure(precision)
            print(f"llama.cpp {precision:>4}: one stream {r.one_stream_tok_s:6.1f} tok/s (TPOT {r.one_stream_tpot_ms:5.1f} ms)"
                  f"  32 at once {r.batch32_output_tok_s:6.1f} tok/s", flush=True)

    print("\n# ratios (issue 11's targets in parentheses)")
    ratio("engine TPOT conc 1 / raw step batch 1", eng[1].tpot_median / raw[1].tpot_median, "<= 1.15")
    ratio("engine conc  8 / raw loop batch  8", eng[8].tokens_per_s / raw[8].tokens_per_s, ">= 0.9")
    ratio("engine conc 32 / raw loop batch 32", eng[32].tokens_per_s / raw[32].tokens_per_s, ">= 0.9")
    if hf_one is not None and hf_batch is not None:
        ratio("engine conc 32 / hf one at a time", eng[32].tokens_per_s / hf_one.tokens_per_s, "")
        ratio("engine conc 32 / hf static batch 32", eng[32].tokens_per_s / hf_batch.tokens_per_s, ">= 1.2")
    if peers:
        own = {"bfloat16": "BF16", "float32": "F32"}.get(args.dtype, "BF16")
        ratio(f"engine TPOT conc 1 / llama.cpp {own} TPOT", eng[1].tpot_median * 1e3 / peers[own].one_stream_tpot_ms,
              "<= 1")
        best = max(peers.values(), key=lambda r: r.batch32_output_tok_s)
        ratio(f"engine conc 32 / llama.cpp's best at 32 ({best.precision})",
              eng[32].tokens_per_s / best.batch32_output_tok_s, ">= 2")
        for method, (q_raw, q_eng) in quantized.items():
            ratio(f"engine {method} TPOT conc 1 / llama.cpp Q4_1 TPOT", q_eng.tpot_median * 1e3 / peers["Q4_1"].one_stream_tpot_ms,
                  "stretch: <= 1")
            ratio(f"engine {method} TPOT conc 1 / llama.cpp {own} TPOT", q_eng.tpot_median * 1e3 / peers[own].one_stream_tpot_ms,
                  "<= 1")
            ratio(f"engine {method} TPOT conc 1 / raw {method} step batch 1", q_eng.tpot_median / q_raw.tpot_median,
                  "<= 1.15")


if __name__ == "__main__":
    main()
