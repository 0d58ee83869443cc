"""The memory floor of one decode step, and how far above it the engine's one-stream TPOT sits.

    python benchmarks/roofline.py [--model smollm2|PATH] [--context 160] [--engine-args ARGS]...
                                  [--repetitions 3] [--seed 0]

    python benchmarks/roofline.py                                    # the engine with its defaults
    python benchmarks/roofline.py --engine-args "" --engine-args "--quantize none"   # two engines

A decode step at one stream reads every weight it multiplies by once and does little arithmetic
with it, so its time cannot fall below (bytes it reads) / (the memory's bandwidth). What it
measures, for each engine configuration (one per --engine-args; none by default: the defaults):
  1. The bytes one decode step reads at one stream, counted on the engine's own model: `--model`
     (default the engine's default, `smollm2`: the packaged SmolLM2-135M-Instruct Q4_1 GGUF) is
     loaded here and built by the engine's ModelRunner (pack, quantize) in the dtype and
     quantization the engine reported in GetServerInfo, so in what `--dtype auto`/`--quantize auto`
     chose on this machine unless ARGS say otherwise. Counted (`decode_step_bytes`): each
     projection (q/k/v, o, gate/up, down, the LM head) as `Packed.forward` runs it for one row,
     i.e. its quantized copy where it has one (int4: the packed nibbles + scales and offsets; int8:
     the bytes + scales) and its weights in the model's dtype otherwise, plus biases; every RMSNorm
     weight; one row of the token embedding (none when the LM head is the unquantized embedding
     table itself, which the head reads whole); one row each of the rotary cos/sin tables; and the
     KV cache of --context tokens (default 128 + 32: the compare workload's prompt and half of its
     64 new tokens, the mean context of its decode steps), keys and values of every layer. Not
     counted: activations, the logits, the new token's KV write, and anything a kernel reads twice.
  2. The machine's memory bandwidth: `.sum()` over a float32 tensor of 1 GiB (far above the
     caches) with torch.set_num_threads(2), one warm-up then the best of 7, GB/s = bytes / time.
  3. The floor TPOT = bytes / bandwidth.
  4. The engine's one-stream TPOT: the real server, `python -m engine_service --port 0
     --metrics-port 0 --model MODEL ARGS` (ARGS: one --engine-args, split as a shell would),
     started with bench_client.engine_process.ManagedEngine as benchmarks/prefill.py does. Over
     gRPC with the bench client's adapter (bench_client.rpc), greedy requests of a 128-token
     prompt of random token ids (distinct per request, from --seed) and 64 new tokens, ignore_eos,
     one at a time: a warm-up, then --repetitions measured; TPOT = (E2E - TTFT) / (tokens - 1),
     both taken by the client from the call, the median kept.
  5. engine TPOT / floor TPOT (1 would be a step as fast as reading its bytes once).
Printed: the CPU named (its model name and torch's CPU capability), each engine's command and
the precision it reported (GetServerInfo's dtype, quantization, cpu_capability), the bytes per
step part by part, a table of engine args, dtype, quantization, MB/step, GB/s, floor TPOT, engine
TPOT and the ratio, and a one-line summary. A figure taken while other processes kept over a
quarter of a core busy is marked `*` (as benchmarks/prefill.py and benchmarks/llamacpp.py do): a
marked TPOT is high and a marked bandwidth low, so the ratio is not fit to compare.

Errors name the step and the value that failed; an engine configuration that fails is reported
and the others are still measured; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from llamacpp import CONTENDED, NEW, PROMPT, OthersBusy  # benchmarks/llamacpp.py: the compare workload
from prefill import (
    REQUEST_TIMEOUT_S,
    cpu_name,
    engine_configurations,
    positive_int,
    started_engine,
    tree_cpu_s,
)

from bench_client.prompts import make_prompt
from bench_client.rpc import EngineClient
from bench_client.server_api import DecodeSpec, ServerInfo
from engine_service.machine.cpu import detect
from engine_service.machine.precision import Q4_INT8_KERNEL_ON, Q4_INT16_KERNEL_ON, Q4_KERNEL_ON, choose_dynamic_head
from engine_service.model.llama import LlamaForCausalLM, Packed, RMSNorm
from engine_service.model.loader import load_model
from engine_service.model.presets import DEFAULT_MODEL
from engine_service.model.quantize import DynamicInt8Weight, Int4Weight, Int8Weight, Q4Int16Weight, Q4Weight
from engine_service.runtime.build import DTYPES
from engine_service.runtime.model_runner import ModelRunner

CONTEXT = PROMPT + NEW // 2  # the mean attended length of the compare workload's decode steps
REPETITIONS = 3
BANDWIDTH_THREADS = 2
BANDWIDTH_BYTES = 1 << 30
BANDWIDTH_RUNS = 7


class RooflineError(RuntimeError):
    """A step failed (an engine's start, a request, the model's build, a figure that makes no sense)."""


@dataclass(frozen=True)
class ReadPart:
    """One part of what a decode step reads: what it is, how it is held, its bytes."""

    name: str
    held_as: str
    nbytes: int


@dataclass(frozen=True)
class StepBytes:
    parts: tuple[ReadPart, ...]

    @property
    def total(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class EngineTpot:
    engine_args: str  # as given ("" for the engine's defaults)
    command: tuple[str, ...]
    info: ServerInfo
    tpot_s: tuple[float, ...]  # each measured request's
    others_busy_cores: float | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.tpot_s)

    @property
    def contended(self) -> bool:
        return self.others_busy_cores is not None and self.others_busy_cores > CONTENDED


@dataclass(frozen=True)
class Bandwidth:
    runs_s: tuple[float, ...]
    nbytes: int
    others_busy_cores: float | None

    @property
    def best_gb_s(self) -> float:
        return self.nbytes / min(self.runs_s) / 1e9

    @property
    def median_gb_s(self) -> float:
        return self.nbytes / statistics.median(self.runs_s) / 1e9

    @property
    def contended(self) -> bool:
        return self.others_busy_cores is not None and self.others_busy_cores > CONTENDED


def _log(msg: str) -> None:
    print(f"[roofline] {msg}", file=sys.stderr, flush=True)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _projection_read(packed: Packed) -> tuple[list[torch.Tensor], int, str]:
    """The tensors a one-row call of `packed` reads, their bytes, and how they are held.
    `Packed.forward` takes its quantized copy when x.numel() <= max_rows * K, i.e. at one row
    whenever max_rows >= 1. fbgemm's packed int8 copy is no tensor: its bytes are its own count."""
    q = packed.quantized
    bias = [] if packed.bias is None else [packed.bias]
    if isinstance(q, Int4Weight) and q.max_rows >= 1:
        tensors = [q.packed, q.scales_and_zeros, *bias]
        return tensors, _nbytes(tensors), f"int4 + {_dtype(q.scales_and_zeros)} scales/offsets"
    if isinstance(q, Q4Weight) and q.max_rows >= 1:
        tensors = [q.q, q.scales, q.lows, *bias]
        return tensors, _nbytes(tensors), "int4 + float32 scales/lows (the float32 int4 kernel)"
    if isinstance(q, Q4Int16Weight) and q.max_rows >= 1:
        tensors = [q.q, q.scales, q.lows, *bias]
        return tensors, _nbytes(tensors), f"int4 + float16 scales/lows (the int{q.activation_bits} int4 kernel)"
    if isinstance(q, Int8Weight) and q.max_rows >= 1:
        tensors = [q.weight, q.scales, *bias]
        return tensors, _nbytes(tensors), f"int8 + {_dtype(q.scales)} scales"
    if isinstance(q, DynamicInt8Weight) and q.max_rows >= 1:
        return bias, q.nbytes + _nbytes(bias), f"int8 ({q.bits}-bit values) + float32 scales, 8-bit activations (fbgemm)"
    if packed.weight is None:
        raise RooflineError("a projection has no packed weight: count after ModelRunner (pack_projections) built it")
    return [packed.weight, *bias], _nbytes([packed.weight, *bias]), _dtype(packed.weight)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def decode_step_bytes(model: LlamaForCausalLM, kv_bytes_per_token: int, context: int) -> StepBytes:
    """What one decode step of one stream reads, attending over `context` tokens, on `model` as the
    engine holds it (packed, and quantized where it is: build it with ModelRunner first). The
    module docstring says what is counted and what is not."""
    if context < 1:
        raise RooflineError(f"context must be >= 1 token, got {context!r}")
    *layers, head = model.projections()
    layer_bytes = 0
    held: set[str] = set()
    for packed in layers:
        _, nbytes, how = _projection_read(packed)
        layer_bytes += nbytes
        held.add(how)
    head_tensors, head_bytes, head_how = _projection_read(head)
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    embed = model.model.embed_tokens.weight
    # tied and unquantized, the head reads the embedding table whole: the looked-up row is in it
    head_is_table = any(t.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr() for t in head_tensors)
    rope = model.rope_cos
    n_layers = model.config.num_hidden_layers
    parts = [
        ReadPart(f"layer projections ({n_layers} x q/k/v, o, gate/up, down)", " | ".join(sorted(held)),
                 layer_bytes),
        ReadPart("LM head" + (" (the tied embedding table)" if head_is_table else ""), head_how, head_bytes),
        ReadPart(f"RMSNorm weights ({len(norms)})", " | ".join(sorted({_dtype(t) for t in norms})), _nbytes(norms)),
        ReadPart("token embedding, 1 row" + (" (inside the LM head's table)" if head_is_table else ""), _dtype(embed),
                 0 if head_is_table else embed.shape[1] * embed.element_size()),
        ReadPart("rotary cos/sin, 1 row each", _dtype(rope), 2 * rope.shape[1] * rope.element_size()),
        ReadPart(f"KV cache, {context} tokens x {kv_bytes_per_token} B", "", context * kv_bytes_per_token),
    ]
    return StepBytes(tuple(parts))


def count_bytes(model_spec: str, info: ServerInfo, context: int) -> StepBytes:
    """Build `model_spec` here as the engine built it (GetServerInfo's dtype and quantization) and count."""
    step = f"the model {model_spec!r} in dtype {info.dtype!r}, quantization {info.quantization!r}"
    if info.dtype not in DTYPES:
        raise RooflineError(f"{step}: the engine reported dtype {info.dtype!r}, not one of {', '.join(DTYPES)}")
    if info.quantization not in ("none", "int8", "int4"):
        raise RooflineError(f"{step}: the engine reported quantization {info.quantization!r}, not none/int8/int4")
    device, dtype = torch.device("cpu"), DTYPES[info.dtype]
    _log(f"building {step} to count its bytes")
    try:
        loaded = load_model(model_spec, device, dtype)
    except ValueError as e:  # CheckpointError included
        raise RooflineError(f"load of {step} failed: {e}") from e
    if loaded.name != info.model:
        raise RooflineError(f"{step}: the engine serves {info.model!r}, the model here is {loaded.name!r} "
                            f"(a --model inside --engine-args? use --model)")
    dynamic_head_bits, _ = choose_dynamic_head(info.quantization, "cpu", detect())  # as the engine chose on this machine
    # the engine's int4 kernels' copies where it says it serves them (their scales: float32, float16)
    int4_kernel = ("float32" if Q4_KERNEL_ON in info.precision_reason else
                   "int16" if Q4_INT16_KERNEL_ON in info.precision_reason else
                   "int8" if Q4_INT8_KERNEL_ON in info.precision_reason else "torch")
    runner = ModelRunner(loaded.model, 1, max(context, 1), device, dtype, info.quantization, trace_decode=False,
                         dynamic_head_bits=dynamic_head_bits, int4_kernel=int4_kernel)
    return decode_step_bytes(loaded.model, runner.cache.bytes_per_token(), context)


def measure_bandwidth() -> Bandwidth:
    """A streaming read: `.sum()` of 1 GiB of float32 with BANDWIDTH_THREADS threads, after a warm-up."""
    torch.set_num_threads(BANDWIDTH_THREADS)
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)  # written once: every page is mapped
    float(data.sum())
    runs = []
    with OthersBusy(f"the bandwidth read ({BANDWIDTH_THREADS} threads)", tree_cpu_s, _log) as busy:
        for _ in range(BANDWIDTH_RUNS):
            started = time.perf_counter()
            total = float(data.sum())
            runs.append(time.perf_counter() - started)
    if total != data.numel():
        raise RooflineError(f"bandwidth read: the sum of {data.numel()} ones came out {total!r}")
    return Bandwidth(tuple(runs), data.nbytes, busy.cores)


async def _tpot(client: EngineClient, ids: tuple[int, ...], request_id: str) -> float:
    """(E2E - TTFT) / (tokens - 1) of one greedy request of NEW tokens for `ids`, in seconds."""
    spec = DecodeSpec(request_id=request_id, prompt_token_ids=ids, max_new_tokens=NEW, ignore_eos=True,
                      temperature=0.0, top_p=1.0, top_k=0, seed=0)
    started = time.perf_counter()
    first, last, tokens = None, None, 0
    async for chunk in client.decode(spec, timeout=REQUEST_TIMEOUT_S):
        if first is None and chunk.num_tokens > 0:
            first = chunk.received_at
        tokens += chunk.num_tokens
        last = chunk
    if first is None or last is None:
        raise RooflineError(f"request {request_id}: the stream ended without a token (last message {last})")
    if tokens != NEW:
        raise RooflineError(f"request {request_id}: {tokens} tokens came back, {NEW} were asked for with ignore_eos "
                            f"(finish reason {last.finish_reason!r})")
    e2e, ttft = last.received_at - started, first - started
    return (e2e - ttft) / (tokens - 1)


async def measure_engine(model: str, engine_args: str, repetitions: int, seed: int, log_dir: Path,
                         number: int) -> EngineTpot:
    """Start one engine, time its one-stream decode, stop it."""
    given = shlex.join(["--model", model]) + (f" {engine_args}" if engine_args else "")
    async with started_engine(given, log_dir, number, RooflineError, _log) as run:
        info = run.info
        prompts = [make_prompt(seed=seed, length=PROMPT, index=i, vocab_size=info.vocab_size,
                               avoid=(info.eos_token_id, info.bos_token_id)) for i in range(1 + repetitions)]
        run.step = f"warm-up request to the engine with --engine-args {engine_args!r}"
        await _tpot(run.client, prompts[0], f"roofline-{number}-warmup")
        run.step = f"timed requests to the engine with --engine-args {engine_args!r}"
        with OthersBusy(f"the engine's one-stream decode (--engine-args {engine_args!r})", tree_cpu_s, _log) as busy:
            tpots = [await _tpot(run.client, ids, f"roofline-{number}-{i}") for i, ids in enumerate(prompts[1:])]
        if min(tpots) <= 0:
            raise RooflineError(f"{run.step}: a TPOT of {min(tpots)!r} s")
        _log(f"engine {engine_args or '(defaults)'}: TPOTs {', '.join(f'{t * 1e3:.2f}' for t in tpots)} ms")
        return EngineTpot(engine_args, run.engine.command, info, tuple(tpots), busy.cores)


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB" if n < 10e6 else f"{n / 1e6:.1f} MB"


def report(model: str, context: int, repetitions: int, bandwidth: Bandwidth,
           rows: Sequence[tuple[EngineTpot, StepBytes]]) -> None:
    bw = bandwidth.best_gb_s
    bw_mark = "*" if bandwidth.contended else ""
    print(f"Roofline, {model}: one decode stream; floor = bytes a step reads at a context of {context} tokens / "
          f"memory bandwidth; engine TPOT = (E2E - TTFT) / (tokens - 1) over gRPC, {PROMPT}-token prompt, {NEW} new "
          f"tokens, greedy, ignore_eos, median of {repetitions} after a warm-up")
    print(f"CPU: {cpu_name()}")
    print(f"bandwidth: .sum() of {BANDWIDTH_BYTES >> 30} GiB float32, {BANDWIDTH_THREADS} threads, best of "
          f"{len(bandwidth.runs_s)}: {bw:.2f} GB/s{bw_mark} (median {bandwidth.median_gb_s:.2f})")
    for e, step in rows:
        print(f"engine {e.engine_args or '(defaults)'}: {' '.join(e.command)}")
        print(f"    model {e.info.model}, dtype {e.info.dtype}, quantization {e.info.quantization}, "
              f"cpu_capability {e.info.cpu_capability}")
        width = max(len(p.name) for p in step.parts)
        held = max(len(p.held_as) for p in step.parts)
        for p in step.parts:
            print(f"    {p.name:<{width}}  {p.held_as:<{held}}  {_mb(p.nbytes):>12}")
        print(f"    {'bytes per step':<{width}}  {'':<{held}}  {_mb(step.total):>12}")
    print()
    width = max([len("engine args"), *(len(e.engine_args or "(defaults)") for e, _ in rows)])
    print(f"{'engine args':<{width}}  {'dtype':>8}  {'quant':>5}  {'MB/step':>8}  {'GB/s':>6}  {'floor ms':>8}  "
          f"{'engine ms':>9}  {'ratio':>6}")
    for e, step in rows:
        floor_ms = step.total / (bw * 1e9) * 1e3
        engine_ms = e.median_s * 1e3
        mark = "  *" if e.contended or bandwidth.contended else ""
        print(f"{e.engine_args or '(defaults)':<{width}}  {e.info.dtype:>8}  {e.info.quantization:>5}  "
              f"{step.total / 1e6:>8.2f}  {bw:>6.2f}  {floor_ms:>8.2f}  {engine_ms:>9.2f}  {engine_ms / floor_ms:>6.2f}"
              + mark)
    print("ratio: engine TPOT / floor TPOT (1: a step as fast as reading its bytes once)")
    if bandwidth.contended or any(e.contended for e, _ in rows):
        print(f"* other processes kept over {CONTENDED} cores busy during the engine's run or the bandwidth read: "
              f"TPOT high or bandwidth low, rerun on a quiet machine")
    for e, step in rows:
        floor_ms = step.total / (bw * 1e9) * 1e3
        print(f"Summary ({cpu_name()}): {model} in {e.info.dtype} with {e.info.quantization} weights "
              f"(--engine-args {e.engine_args!r}) decodes one stream at {e.median_s * 1e3:.2f} ms a token, "
              f"{e.median_s * 1e3 / floor_ms:.2f}x its memory floor of {floor_ms:.2f} ms "
              f"({step.total / 1e6:.1f} MB a step at {bw:.2f} GB/s)"
              + (" [*: measured on a busy machine]" if e.contended or bandwidth.contended else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="An --engine-args value that starts with '-' and has no space needs the "
                                        "--engine-args=VALUE form.")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"the model served (--model of the engine) and counted here (default: {DEFAULT_MODEL})")
    ap.add_argument("--context", type=positive_int, default=CONTEXT,
                    help=f"tokens of KV cache a step attends to, for the floor's bytes (default: {PROMPT}+{NEW // 2}"
                         f" = {CONTEXT}, the mean of the {PROMPT}-token prompt, {NEW} new tokens workload)")
    ap.add_argument("--engine-args", action="append", default=None, metavar="ARGS",
                    help="arguments added to `python -m engine_service --port 0 --metrics-port 0 --model MODEL`, "
                         "one engine configuration; may be given several times (default: one, with none)")
    ap.add_argument("--repetitions", type=positive_int, default=REPETITIONS,
                    help=f"timed requests per engine, the median kept (default: {REPETITIONS})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (default: 0)")
    args = ap.parse_args(argv)
    configurations = engine_configurations(ap, args.engine_args)

    log_dir = Path(tempfile.mkdtemp(prefix="roofline-"))
    rows: list[tuple[EngineTpot, StepBytes]] = []
    failed: list[str] = []
    for i, engine_args in enumerate(configurations, 1):
        try:
            measured = asyncio.run(measure_engine(args.model, engine_args, args.repetitions, args.seed, log_dir, i))
            rows.append((measured, count_bytes(args.model, measured.info, args.context)))
        except RooflineError as e:  # the other configurations are still measured
            print(f"error: {e}", file=sys.stderr)
            failed.append(engine_args or "(defaults)")
        gc.collect()  # the counted model goes before the next engine and the bandwidth read
    if failed:
        print(f"(engine logs kept in {log_dir})", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    if rows:
        report(args.model, args.context, args.repetitions, measure_bandwidth(), rows)
    for engine_args in failed:
        print(f"engine with --engine-args {engine_args!r}: failed (its error is on stderr), not measured")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
