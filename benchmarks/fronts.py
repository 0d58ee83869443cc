"""Same speed on both fronts: ONE engine process, measured by the bench client over gRPC (engine.v1)
and over its OpenAI-compatible HTTP front (/v1/completions, streamed), in one run.

    .venv/bin/python benchmarks/fronts.py [--model smollm2] [--engine-args ARGS] [--concurrency 1,32]
                                          [--context 128] [--new-tokens 64] [--requests N] [--rounds 2]

The engine: `python -m engine_service --model MODEL --port 0 --http-port 0 --threads 0 ARGS` (its
defaults but for the ports: --threads 0 is the CLI's own default, restated over tools/local_engine's
--threads 1; no ARGS by default). Both fronts serve the same engine, on the same event loop.

The client: the sweeps' own request machinery, `bench_client.point.PointRunner` (the policy table,
the prompts of bench_client/workload.py, the metrics of bench_client/metrics.py), with the gRPC
adapter (bench_client.rpc.EngineClient) or the HTTP one (bench_client.openai_http.OpenAIClient:
SSE, the usage of the last chunk), in this process. Each run is one point: --context-token text
prompts of exactly that many tokens by the smollm2 tokenizer (the packaged GGUF's, client side),
--new-tokens new tokens, greedy, ignore_eos, all at once at the concurrency; first one wave of
warm-up requests (not measured), then --requests measured ones (default max(16, 2 x concurrency)).
Every run gets fresh prompts of the same generator and lengths (its own seed): the engine's prefix
cache, on by default, would otherwise serve a front the prompts the other front sent before it
(checked: the `cached` column, the prompt tokens per request the cache supplied, is 0).

At each concurrency, first one run on each front that is not measured (--warmup-runs: the engine's
TorchScript traces meet the batch shapes of that concurrency and its prefill budget its step times
there: the first run at 32 streams was 2-3x slower than the next in a trial), then the measured
runs, alternating the fronts, grpc, http, http, grpc for --rounds 2 (ABBA: a drift linear in time
cancels from the means). Printed: each run's TPOT p50 (ms), output tok/s (the
point's output tokens, the server's usage counts, over the point's duration), TTFT p50, the client's
and the engine's CPU seconds during the run, and the cores other processes kept busy meanwhile (a
figure marked `*` was taken with over a quarter of a core busy elsewhere: it is low, not fit to
compare); then per concurrency the mean of each front's runs and HTTP / gRPC for both figures, and
whether HTTP is within 5% of gRPC (TPOT ratio <= 1.05 and tok/s ratio >= 0.95). The CPU is named
(its model name, its vector flags from /proc/cpuinfo, torch's capability), with the load average
before and after.

A failed request ends the run (exit status 1), naming the front, the concurrency and the codes.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_overhead import _NoHealth, _NoObserver  # benchmarks/client_overhead.py: the same stand-ins
from llamacpp import CONTENDED, OthersBusy  # benchmarks/llamacpp.py
from prefill import cpu_name, distinct_positive_ints, positive_int, tree_cpu_s  # benchmarks/prefill.py

from bench_client import metrics
from bench_client.config import PolicyConfig, WorkloadConfig
from bench_client.openai_http import OpenAIClient
from bench_client.point import PointRunner, PointSpec
from bench_client.rpc import EngineClient
from bench_client.server_api import ServerClient, ServerInfo
from bench_client.tokenizer import load_tokenizer
from bench_client.workload import PointPrompts
from shared.errors import EngineError
from tools.local_engine import EngineProcess

GRPC, HTTP = "grpc", "http"
STARTUP_TIMEOUT_S = 600.0  # loading and tracing the model on a busy 2-core machine
REQUEST_TIMEOUT_S = 300.0
WITHIN = 0.05  # HTTP may be this much slower than gRPC
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


class FrontsError(RuntimeError):
    """A step failed: the engine's start, a request, a figure that makes no sense."""


@dataclass(frozen=True)
class FrontRun:
    front: str
    concurrency: int
    number: int  # 1-based, per front and concurrency (< 0: a warm-up run, not reported)
    tpot_ms: float  # p50
    tokens_per_s: float
    ttft_ms: float  # p50
    cached: float  # prompt tokens per request the prefix cache supplied (mean)
    output_tokens: int
    client_cpu_s: float
    engine_cpu_s: float
    others_cores: float | None

    @property
    def contended(self) -> bool:
        return self.others_cores is not None and self.others_cores > CONTENDED


def _log(msg: str) -> None:
    print(f"[fronts] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> str:
    """The vector flags of /proc/cpuinfo that decide the engine's kernels (those this CPU has)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and ":" in line:
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in VECTOR_FLAGS if f in have) or "none of " + " ".join(VECTOR_FLAGS)
    except OSError:
        pass  # not Linux: no flags to name
    return "unknown"


def order(rounds: int) -> list[str]:
    """The fronts in turn: grpc, http, http, grpc, grpc, http... (ABBA for each pair of rounds)."""
    return [front for r in range(rounds) for front in ((GRPC, HTTP) if r % 2 == 0 else (HTTP, GRPC))]


async def measure(client: ServerClient, info: ServerInfo, front: str, concurrency: int, number: int,
                  args: argparse.Namespace, seed: int) -> FrontRun:
    """One run: a point of `concurrency` streams through PointRunner, its prompts of its own seed."""
    requests = args.requests or max(16, 2 * concurrency)
    workload = WorkloadConfig(context_tokens=(args.context,), max_new_tokens=(args.new_tokens,),
                              concurrency=(concurrency,), requests_per_point=requests,
                              warmup_requests=max(2, concurrency), seed=seed, ignore_eos=True, temperature=0.0)
    runner = PointRunner(client, info, workload, PolicyConfig(request_timeout_s=REQUEST_TIMEOUT_S, max_attempts=1),
                         _NoHealth(), _NoObserver(), f"fronts-{front}-c{concurrency}-{number}",
                         prompts=PointPrompts(workload), tokenizer=args.tokenizer)
    step = f"{front} {'run ' + str(number) if number > 0 else 'warm-up run'} at concurrency {concurrency}"
    client_cpu, all_cpu = time.process_time(), tree_cpu_s()
    with OthersBusy(step, tree_cpu_s, _log) as busy:
        outcome = await runner.run(PointSpec(args.context, args.new_tokens, concurrency, math.inf))
    client_cpu_s = time.process_time() - client_cpu
    engine_cpu_s = tree_cpu_s() - all_cpu - client_cpu_s
    failed = [r for r in outcome.requests if not r.ok]
    if failed:
        raise FrontsError(f"{step}: {len(failed)} of {len(outcome.requests)} requests failed: "
                          f"{sorted({(r.status_code, r.reason, r.message[:120]) for r in failed})[:3]}")
    figures = metrics.compute([r.timeline for r in outcome.requests if r.timeline is not None], outcome.duration_s)
    tpot, ttft = figures.tpot_ms.median, figures.ttft_ms.median
    if figures.total_output_tokens != requests * args.new_tokens or tpot is None or ttft is None:
        raise FrontsError(f"{step}: {figures.total_output_tokens} output tokens counted, "
                          f"{requests} x {args.new_tokens} asked (ignore_eos); TPOT p50 {tpot}, TTFT p50 {ttft}")
    _log(f"{step}: TPOT p50 {tpot:.2f} ms, {figures.output_throughput:.1f} tok/s")
    return FrontRun(front, concurrency, number, tpot, figures.output_throughput, ttft,
               figures.mean_cached_prompt_tokens or 0.0, figures.total_output_tokens, client_cpu_s, engine_cpu_s,
               busy.cores)


async def run_all(address: str, http_url: str, args: argparse.Namespace) -> tuple[ServerInfo, list[FrontRun]]:
    grpc_client = EngineClient(address)
    http_client = OpenAIClient(http_url, concurrency=max(args.concurrency))
    try:
        info = await grpc_client.server_info()
        clients: dict[str, tuple[ServerClient, ServerInfo]] = {
            GRPC: (grpc_client, info), HTTP: (http_client, await http_client.server_info())}
        runs: list[FrontRun] = []
        seed = 0
        for concurrency in args.concurrency:
            for warmup in range(args.warmup_runs):
                for front in (HTTP, GRPC):
                    seed += 1
                    client, front_info = clients[front]
                    await measure(client, front_info, front, concurrency, -1 - warmup, args, seed)
            numbers = {GRPC: 0, HTTP: 0}
            for front in order(args.rounds):
                numbers[front] += 1
                seed += 1
                client, front_info = clients[front]
                runs.append(await measure(client, front_info, front, concurrency, numbers[front], args, seed))
        return info, runs
    finally:
        await grpc_client.close()
        await http_client.close()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(runs: Sequence[FrontRun], info: ServerInfo, command: Sequence[str], args: argparse.Namespace,
           load_before: str, load_after: str) -> bool:
    """Print the runs and the summary; whether HTTP is within 5% of gRPC at every concurrency."""
    print("fronts: one engine over gRPC (engine.v1 Decode) and HTTP (/v1/completions, SSE), the bench client's "
          "PointRunner on each")
    print(f"CPU: {cpu_name()}; flags: {cpu_flags()}")
    print(f"engine: {shlex.join(command)}")
    print(f"        {info.model}, {info.dtype}, quantization {info.quantization or 'none'}, "
          f"max batch {info.max_batch_size}, context {info.max_context_tokens}, {info.engine_version}")
    print(f"workload: {args.context}-token text prompts (smollm2 tokenizer), {args.new_tokens} new tokens, greedy, "
          f"ignore_eos; per run one warm-up wave, then {args.requests or 'max(16, 2 x concurrency)'} requests; "
          f"at each concurrency {args.warmup_runs} unreported run(s) per front, then {', '.join(order(args.rounds))}")
    print(f"load average (1, 5, 15 min): {load_before} before, {load_after} after\n")
    print(f"{'conc':>4} {'front':<5} {'run':>3} {'TPOT p50 ms':>11} {'out tok/s':>9} {'TTFT p50 ms':>11} "
          f"{'cached':>6} {'client CPU s':>12} {'engine CPU s':>12} {'others cores':>12}")
    for r in runs:
        mark = "*" if r.contended else " "
        others = f"{r.others_cores:.2f}" if r.others_cores is not None else "-"
        print(f"{r.concurrency:>4} {r.front:<5} {r.number:>3} {r.tpot_ms:>11.2f} {r.tokens_per_s:>9.1f} "
              f"{r.ttft_ms:>11.1f} {r.cached:>6.1f} {r.client_cpu_s:>12.2f} {r.engine_cpu_s:>12.2f} "
              f"{others:>11}{mark}")
    print(f"\n{'conc':>4} {'gRPC TPOT':>9} {'HTTP TPOT':>9} {'HTTP/gRPC':>9}   {'gRPC tok/s':>10} {'HTTP tok/s':>10} "
          f"{'HTTP/gRPC':>9}   within 5%")
    ok = True
    for concurrency in args.concurrency:
        by = {front: [r for r in runs if r.concurrency == concurrency and r.front == front] for front in (GRPC, HTTP)}
        tpot = {f: statistics.fmean(r.tpot_ms for r in rs) for f, rs in by.items()}
        tps = {f: statistics.fmean(r.tokens_per_s for r in rs) for f, rs in by.items()}
        tpot_ratio, tps_ratio = tpot[HTTP] / tpot[GRPC], tps[HTTP] / tps[GRPC]
        within = tpot_ratio <= 1 + WITHIN and tps_ratio >= 1 - WITHIN
        ok &= within
        contended = " (a run marked *)" if any(r.contended for rs in by.values() for r in rs) else ""
        print(f"{concurrency:>4} {tpot[GRPC]:>9.2f} {tpot[HTTP]:>9.2f} {tpot_ratio:>8.3f}x   {tps[GRPC]:>10.1f} "
              f"{tps[HTTP]:>10.1f} {tps_ratio:>8.3f}x   {'yes' if within else 'NO'}{contended}")
    print("\nTPOT in ms (mean over each front's runs of the run's p50); tok/s: output tokens per second of the point")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="the engine's --model (default: smollm2, its default)")
    ap.add_argument("--engine-args", default="", metavar="ARGS",
                    help="more engine arguments, split as a shell would (default: none)")
    ap.add_argument("--concurrency", type=distinct_positive_ints("concurrencies"), default=[1, 32], help="comma-separated (default: 1,32)")
    ap.add_argument("--context", type=positive_int, default=128, help="prompt tokens (default: 128)")
    ap.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per request (default: 64)")
    ap.add_argument("--requests", type=positive_int, default=None,
                    help="measured requests per run (default: max(16, 2 x concurrency))")
    ap.add_argument("--rounds", type=positive_int, default=2, help="runs per front and concurrency (default: 2)")
    ap.add_argument("--warmup-runs", type=int, choices=range(0, 4), default=1,
                    help="runs per front and concurrency before the measured ones, not reported (default: 1)")
    args = ap.parse_args(argv)
    try:
        extra = shlex.split(args.engine_args)
    except ValueError as e:
        ap.error(f"--engine-args {args.engine_args!r} cannot be split as a shell would: {e}")
    args.tokenizer = load_tokenizer("smollm2", base_dir=Path.cwd())
    load_before = _load()
    engine = EngineProcess("--model", args.model, "--threads", "0", "--http-port", "0", *extra)
    _log(f"starting the engine: {shlex.join(engine.args)}")
    try:
        engine.start(timeout=STARTUP_TIMEOUT_S)
        (started,) = engine.events_named("server_started")
        info, runs = asyncio.run(run_all(engine.address, f"http://127.0.0.1:{started['http_port']}", args))
    except (FrontsError, EngineError, RuntimeError) as e:  # RuntimeError: EngineProcess's failed start
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if engine.proc is not None and engine.proc.poll() is None:
            engine.signal()  # a drain
            try:
                engine.wait(60)
            except subprocess.TimeoutExpired:
                _log(f"the engine (pid {engine.proc.pid}) outlasted its drain by 60 s: killed")
                engine.kill()
    ok = report(runs, info, ["python", "-m", "engine_service", *engine.args], args, load_before, _load())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
