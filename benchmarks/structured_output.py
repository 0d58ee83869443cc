"""Structured output: what the grammar masks cost one decode step, on SmolLM2's 49,152-token vocabulary.

    python benchmarks/structured_output.py [--rows 1,8] [--steps 200] [--device cpu] [--threads N]

Each constrained row holds a typical JSON schema (an object of strings, integers, an enum, an array
of bounded length), compiled once as the engine does at admission (a fresh one when a row's output
completes). Every step draws random logits for a batch of 8 rows, masks the constrained ones with
`apply_masks` (the step's whole cost: llguidance's masks into the shared bitmask, then expanding it
into -inf on the logits), takes each masked row's argmax and consumes it. Prints, per row count, the
median and 90th percentile of `apply_masks` per step, the share of it that is llguidance's mask
computation (timed apart, on the same states, before a second `apply_masks` that then reuses the
cached mask), and `consume`; and the compile time, with the CPU it ran on. Only the tokenizer is
loaded, not the model.

With `--served`, it also starts the engine on SmolLM2 (its defaults) and measures, in one run, the
engine's own time per output token (Timing: (total - first token) / (tokens - 1)) of chat requests
with this schema and of the same requests without it, at 1 and 8 at once: the per-step cost of
structured output as served.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_service.generation.constraint import ConstraintCompiler, apply_masks
from engine_service.machine.cpu import detect
from engine_service.model.gguf_checkpoint import parse_config
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.gguf_tokenizer import build_gguf_tokenizer
from engine_service.model.hf_tokenizer import HFTokenizer
from engine_service.model.presets import PACKAGED
from engine_service.requests import ResponseFormat

BATCH = 8
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z]{1,12}\\.(com|org|net)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "email", "tags", "active"],
    "additionalProperties": False,
})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(compiler: ConstraintCompiler, rows: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    fmt = ResponseFormat("json_schema", SCHEMA)
    constraints = [compiler.compile(fmt) for _ in range(rows)]
    scratch = torch.zeros(rows, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
    generator = torch.Generator(device=device).manual_seed(0)
    times: dict[str, list[float]] = {"apply_masks": [], "llguidance": [], "consume": [], "compile": []}
    row_ids = list(range(rows))
    for step in range(2 * steps):
        logits = torch.randn(BATCH, compiler.vocab_size, generator=generator, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        if step % 2 == 0:  # the step as the engine runs it
            apply_masks(logits, row_ids, constraints)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times["apply_masks"].append(time.perf_counter() - started)
        else:  # llguidance's part alone, then apply_masks on the cached masks (not recorded)
            compiler._executor.unsafe_compute_mask_ptr(
                [(c.matcher, i) for i, c in enumerate(constraints)], scratch.data_ptr(), scratch.shape[1] * 4, rows)
            times["llguidance"].append(time.perf_counter() - started)
            apply_masks(logits, row_ids, constraints)
        tokens = logits[:rows].argmax(dim=-1).tolist()
        started = time.perf_counter()
        for constraint, token in zip(constraints, tokens, strict=True):
            constraint.consume([token])
        times["consume"].append(time.perf_counter() - started)
        for i, constraint in enumerate(constraints):
            if constraint.done:
                started = time.perf_counter()
                constraints[i] = compiler.compile(fmt)
                times["compile"].append(time.perf_counter() - started)
    return times


def served(concurrency: tuple[int, ...], requests: int) -> None:
    """TPOT with and without the schema, served (the engine's Timing), median over `requests`."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.v1 import engine_pb2 as pb
    from tools.local_engine import EngineProcess

    question = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=f"Invent a user as JSON: {SCHEMA}")])

    def tpot(stub, constrained: bool, seed: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
        request = pb.DecodeRequest(chat=question, max_new_tokens=96, sampling=pb.SamplingParams(
            temperature=0.7, seed=seed), response_format=pb.ResponseFormat(json_schema=SCHEMA) if constrained else None)
        last = list(stub.Decode(request, timeout=300))[-1]
        tokens = last.usage.completion_tokens
        return (last.timing.total_seconds - last.timing.time_to_first_token_seconds) / max(1, tokens - 1), tokens

    with EngineProcess("--model", "smollm2", "--max-batch", "8") as proc:
        stub = proc.stub()
        tpot(stub, True, 0)  # the compiler is built on first use: not measured
        for n in concurrency:
            figures = {}
            for constrained in (False, True):
                with ThreadPoolExecutor(n) as pool:
                    out = list(pool.map(lambda i, c=constrained: tpot(stub, c, i), range(requests)))
                figures[constrained] = (statistics.median(t for t, _ in out) * 1e3,
                                        statistics.median(k for _, k in out))
            (free_ms, free_tokens), (json_ms, json_tokens) = figures[False], figures[True]
            print(f"served, {n} at once: TPOT without schema {free_ms:.1f} ms ({free_tokens:.0f} tokens), with "
                  f"schema {json_ms:.1f} ms ({json_tokens:.0f} tokens): +{json_ms - free_ms:.1f} ms per step, "
                  f"x{json_ms / free_ms:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8", help="constrained rows per step, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--served", action="store_true", help="also measure TPOT served, with and without the schema")
    parser.add_argument("--requests", type=int, default=16, help="--served: requests per figure")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gguf = read_gguf(PACKAGED["smollm2"].locate("smollm2"))
    config = parse_config(gguf)
    tokenizer = HFTokenizer(build_gguf_tokenizer(gguf), config.vocab_size, config.bos_token_id,
                            config.eos_token_id, kind="gguf")
    started = time.perf_counter()
    compiler = ConstraintCompiler(tokenizer, config.vocab_size, frozenset({config.eos_token_id}))
    print(f"# CPU: {detect().describe()}; torch threads {torch.get_num_threads()}; device {device}")
    print(f"# SmolLM2 vocabulary {config.vocab_size}; ConstraintCompiler built in "
          f"{(time.perf_counter() - started) * 1e3:.0f} ms; {BATCH}-row logits, {args.steps} steps per figure")
    for rows in (int(r) for r in args.rows.split(",")):
        times = measure(compiler, rows, args.steps, device)
        ms = {name: [t * 1e3 for t in values] for name, values in times.items()}
        compile_ms = f"{statistics.median(ms['compile']):.1f}" if ms["compile"] else "-"
        print(f"{rows} constrained row(s): apply_masks median {statistics.median(ms['apply_masks']):.3f} ms, "
              f"p90 {percentile(ms['apply_masks'], 0.9):.3f} ms (llguidance's masks median "
              f"{statistics.median(ms['llguidance']):.3f} ms); consume median {statistics.median(ms['consume']):.3f} "
              f"ms; compile median {compile_ms} ms over {len(ms['compile'])} outputs completed", flush=True)
    if args.served:
        served((1, 8), args.requests)


if __name__ == "__main__":
    main()
