"""Prefill speed, the engine's beside llama.cpp's, on the engine's default model, in one run.

    python benchmarks/prefill.py [--engine-args ARGS]... [--lengths 128,512] [--repetitions 3]
                                 [--threads N] [--seed 0] [--cache DIR]

    python benchmarks/prefill.py                                   # the engine with its defaults
    python benchmarks/prefill.py --engine-args "" --engine-args "--dtype bfloat16" \\
                                 --engine-args="--max-prefill-tokens 512"   # three configurations

What it measures, for each prompt length N (default 128 and 512): prompt tokens per second of one
prompt of N tokens processed from an empty context, no other request in flight.
  - The engine: the real server, `python -m engine_service --port 0 --metrics-port 0 ARGS` (ARGS:
    one --engine-args, split as a shell would; none by default, so the engine's defaults), its port
    read from its `server_started` log line (bench_client.engine_process.ManagedEngine). Over gRPC
    with the bench client's adapter (bench_client.rpc), a prompt of N random token ids (reproducible
    from --seed, distinct for every request, so the prefix cache never serves one; checked with the
    engine's cached_prompt_tokens), max_new_tokens=1, ignore_eos; TTFT is taken by the client from
    the call to the first token. One warm-up request per length, then the best of --repetitions:
    tok/s = N / TTFT. So it includes the gRPC round trip and the first token's sampling, and the
    engine's default chunked prefill (--max-prefill-tokens) as configured.
    Each --engine-args (the option may be given several times) is one engine, started, measured
    and stopped in turn.
  - llama.cpp: `llama-bench -p N -n 0 -r 3` on the packaged Q4_1 GGUF file the engine serves and on
    the F32 file made from it (benchmarks/llamacpp.py builds llama.cpp and makes the file once,
    into its cache); the fastest of llama-bench's 3 repetitions (after its own warm-up run), with
    --threads threads (default: torch's default, the engine's --threads 0).
Printed: a table of length, engine tok/s, llama.cpp Q4_1 tok/s, engine / Q4_1, llama.cpp F32 tok/s,
engine / F32 (above 1: the engine is faster), per engine configuration, with the CPU named (its
model name and torch's CPU capability). A figure taken while other processes kept over a quarter of
a core busy is marked `*` (as benchmarks/llamacpp.py does): it is low, not fit to compare.

Errors name the step and the value that failed: a llama.cpp step ends the run; an engine
configuration that fails (its start, a request) is reported and the others are still measured;
the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # benchmarks/llamacpp.py
import torch
from llamacpp import CONTENDED, LlamaCppError, OthersBusy, PrefillResult

from bench_client.config import EngineLaunchConfig
from bench_client.engine_process import EngineStartError, ManagedEngine, tail
from bench_client.prompts import make_prompt
from bench_client.rpc import EngineClient
from bench_client.server_api import DecodeSpec, ServerClient, ServerInfo
from shared.errors import EngineError
from shared.logging import configure_logging

LENGTHS = (128, 512)
REPETITIONS = 3
PEER_PRECISIONS = ("Q4_1", "F32")
STARTUP_TIMEOUT_S = 600.0  # loading and tracing the model on a busy 2-core machine
REQUEST_TIMEOUT_S = 300.0


class PrefillError(RuntimeError):
    """A step of the engine's side failed (its start, a request, a figure that makes no sense)."""


@dataclass(frozen=True)
class EngineFigures:
    engine_args: str  # as given ("" for the engine's defaults)
    command: tuple[str, ...]
    info: ServerInfo
    tok_s: dict[int, float]  # length -> N / best TTFT
    ttft_s: dict[int, float]  # length -> best TTFT
    others_busy_cores: dict[int, float | None]  # length -> cores other processes kept busy meanwhile

    def contended(self, n: int) -> bool:
        others = self.others_busy_cores.get(n)
        return others is not None and others > CONTENDED


def _log(msg: str) -> None:
    print(f"[prefill] {msg}", file=sys.stderr, flush=True)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), torch's CPU capability and the logical CPU count."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: the name stays unknown, the rest is still said
    return f"{model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} logical CPUs"


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one live process (/proc/PID/stat); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0], utime fields[11]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return found
    return found


def tree_cpu_s() -> float:
    """CPU seconds of this process and its live descendants (the engine): what counts as ours
    when the engine is measured."""
    total, todo = time.process_time(), _children(os.getpid())
    while todo:
        pid = todo.pop()
        total += _proc_cpu_s(pid)
        todo += _children(pid)
    return total


def engine_command(engine_args: str) -> list[str]:
    """The ManagedEngine command template (bench_client.command) for one --engine-args value."""
    try:
        extra = shlex.split(engine_args)
    except ValueError as e:
        raise PrefillError(f"--engine-args {engine_args!r} cannot be split as a shell would: {e}") from e
    escaped = [a.replace("{", "{{").replace("}", "}}") for a in extra]  # no placeholders in the user's args
    return ["{python}", "-m", "engine_service", "--port", "{port}", "--metrics-port", "0", *escaped]


async def _ttft(client: ServerClient, ids: tuple[int, ...], request_id: str) -> float:
    """Seconds from the call to the first token of a max_new_tokens=1 request for `ids`."""
    spec = DecodeSpec(request_id=request_id, prompt_token_ids=ids, max_new_tokens=1, ignore_eos=True,
                      temperature=0.0, top_p=1.0, top_k=0, seed=0)
    started = time.perf_counter()
    first = None
    last = None
    async for chunk in client.decode(spec, timeout=REQUEST_TIMEOUT_S):
        if first is None and chunk.num_tokens > 0:
            first = chunk.received_at
        last = chunk
    if first is None or last is None:
        raise PrefillError(f"request {request_id}: the stream ended without a token (last message {last})")
    if last.prompt_tokens is not None and last.prompt_tokens != len(ids):
        raise PrefillError(f"request {request_id}: the engine counted {last.prompt_tokens} prompt tokens, "
                           f"{len(ids)} were sent")
    if last.cached_prompt_tokens:
        raise PrefillError(f"request {request_id}: {last.cached_prompt_tokens} of its {len(ids)} prompt tokens "
                           f"came from the prefix cache; the figure would not be a prefill")
    return first - started


class EngineRun:
    """One engine started for a benchmark (`started_engine`): its client, its GetServerInfo, and
    `step`, what the benchmark is doing with it now, named in the error if that fails."""

    def __init__(self, engine: ManagedEngine, client: EngineClient, info: ServerInfo, step: str) -> None:
        self.engine, self.client, self.info, self.step = engine, client, info, step


@contextlib.asynccontextmanager
async def started_engine(engine_args: str, log_dir: Path, number: int, error: type[Exception],
                         log: Callable[[str], None] = _log) -> AsyncIterator[EngineRun]:
    """The engine of `engine_args` (engine_command) started, asked GetServerInfo, and stopped after;
    its log in log_dir/engine-NUMBER.log. A failed start, or an EngineError while it runs, raises
    `error` naming the step, with the log's tail."""
    launch = EngineLaunchConfig(command=tuple(engine_command(engine_args)), startup_timeout_s=STARTUP_TIMEOUT_S,
                                max_restarts=0)
    log_path = log_dir / f"engine-{number}.log"
    engine = ManagedEngine(launch, {}, log_path, on_exit=lambda _exit: None, make_client=EngineClient)
    client: EngineClient | None = None
    step = f"start of the engine with --engine-args {engine_args!r}"
    try:
        log(f"{step}: {' '.join(launch.command)}")
        try:
            await engine.start()
        except EngineStartError as e:
            raise error(f"{step} failed: {e}") from e
        client = EngineClient(engine.target)
        step = f"GetServerInfo of the engine with --engine-args {engine_args!r} at {engine.target}"
        run = EngineRun(engine, client, await client.server_info(), step)
        try:
            yield run
        finally:
            step = run.step
    except EngineError as e:
        raise error(f"{step} failed: {type(e).__name__}: {e}\n--- engine log tail ({log_path}) ---\n"
                    + "\n".join(tail(log_path, 20))) from e
    finally:
        if client is not None:
            await client.close()
        if engine.command:  # spawned: drain it (a no-op when it already exited)
            await engine.stop()
        await engine.close()


async def measure_engine(engine_args: str, lengths: Sequence[int], repetitions: int, seed: int,
                         log_dir: Path, number: int) -> EngineFigures:
    """Start one engine, time its prefill for each length, stop it."""
    label = engine_args or "(defaults)"
    async with started_engine(engine_args, log_dir, number, PrefillError) as run:
        tok_s, ttft_s, others = {}, {}, {}
        for n in lengths:
            prompts = [make_prompt(seed=seed, length=n, index=i, vocab_size=run.info.vocab_size,
                                   avoid=(run.info.eos_token_id, run.info.bos_token_id)) for i in range(1 + repetitions)]
            run.step = f"warm-up request of {n} tokens to the engine with --engine-args {engine_args!r}"
            await _ttft(run.client, prompts[0], f"prefill-{number}-{n}-warmup")
            run.step = f"timed requests of {n} tokens to the engine with --engine-args {engine_args!r}"
            with OthersBusy(f"the engine's prefill of {n} tokens (--engine-args {engine_args!r})", tree_cpu_s,
                            _log) as busy:
                times = [await _ttft(run.client, ids, f"prefill-{number}-{n}-{i}") for i, ids in enumerate(prompts[1:])]
            best = min(times)
            if best <= 0:
                raise PrefillError(f"{run.step}: a TTFT of {best!r} s")
            ttft_s[n], tok_s[n], others[n] = best, n / best, busy.cores
            _log(f"engine {label}: {n} tokens, TTFTs {', '.join(f'{t * 1e3:.0f}' for t in times)} ms "
                 f"-> {n / best:.1f} tok/s")
        return EngineFigures(engine_args=engine_args, command=run.engine.command, info=run.info, tok_s=tok_s,
                             ttft_s=ttft_s, others_busy_cores=others)


def measure_llamacpp(lengths: Sequence[int], threads: int, cache: Path | None) -> dict[str, PrefillResult]:
    bin_dir = llamacpp.build(cache)
    files = llamacpp.model_files(cache)
    return {p: llamacpp.prefill(bin_dir, files[p], lengths, threads) for p in PEER_PRECISIONS}


def distinct_positive_ints(what: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated distinct integers >= 1 (`what` names them in the refusal)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"comma-separated ints expected, got {text!r}") from e
        if not values or any(n < 1 for n in values) or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"distinct {what} >= 1 expected, got {text!r}")
        return values

    return parse


def engine_configurations(ap: argparse.ArgumentParser, given: list[str] | None) -> list[str]:
    """The --engine-args values (one with none when none was given), each checked to split as a
    shell would (ap.error otherwise); ManagedEngine's logging set to warnings."""
    configurations = given if given is not None else [""]
    configure_logging("warning", json=False)  # ManagedEngine's info events stay quiet; its warnings show
    for engine_args in configurations:
        try:
            engine_command(engine_args)
        except PrefillError as e:
            ap.error(str(e))
    return configurations


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a positive int expected, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive int expected, got {text!r}")
    return value


def report(lengths: Sequence[int], repetitions: int, threads: int, peers: dict[str, PrefillResult],
           engines: list[EngineFigures]) -> None:
    q4, f32 = peers["Q4_1"], peers["F32"]
    print(f"Prefill, SmolLM2-135M-Instruct: one prompt of N random tokens from an empty context, no other request "
          f"running; tok/s = N / time to first token (engine: over gRPC, best of {repetitions} after a warm-up; "
          f"llama.cpp: llama-bench -p N -n 0, best of 3)")
    print(f"CPU: {cpu_name()}")
    print(f"llama.cpp: llama-cpp-python {llamacpp.VERSION} vendored, {threads} threads, --repack 0")
    for e in engines:
        print(f"engine {e.engine_args or '(defaults)'}: {' '.join(e.command)}")
        print(f"    model {e.info.model}, dtype {e.info.dtype}, quantization {e.info.quantization or '?'}, "
              f"device {e.info.device}" + (f" ({e.info.precision_reason})" if e.info.precision_reason else ""))
    print()
    width = max([len("engine args"), *(len(e.engine_args or "(defaults)") for e in engines)])
    print(f"{'engine args':<{width}}  {'length':>6}  {'engine tok/s':>12}  {'llama.cpp Q4_1 tok/s':>20}  {'ratio':>6}  "
          f"{'llama.cpp F32 tok/s':>19}  {'ratio':>6}")
    flagged = False
    for e in engines:
        for n in lengths:
            mark = e.contended(n) or q4.contended or f32.contended
            flagged |= mark
            print(f"{e.engine_args or '(defaults)':<{width}}  {n:>6}  {e.tok_s[n]:>12.1f}  "
                  f"{q4.best_tok_s[n]:>20.1f}  {e.tok_s[n] / q4.best_tok_s[n]:>6.2f}  "
                  f"{f32.best_tok_s[n]:>19.1f}  {e.tok_s[n] / f32.best_tok_s[n]:>6.2f}" + ("  *" if mark else ""))
    print("ratio: engine tok/s / llama.cpp tok/s (above 1: the engine is faster)")
    if flagged:
        print(f"* other processes kept over {CONTENDED} cores busy during the engine's or llama.cpp's run: "
              f"figures low, rerun on a quiet machine")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="An --engine-args value that starts with '-' and has no space needs the "
                                        "--engine-args=VALUE form.")
    ap.add_argument("--engine-args", action="append", default=None, metavar="ARGS",
                    help="arguments added to `python -m engine_service --port 0 --metrics-port 0`, one engine "
                         "configuration; may be given several times (default: one, with none: the defaults)")
    ap.add_argument("--lengths", type=distinct_positive_ints("lengths"), default=list(LENGTHS),
                    help=f"prompt lengths, comma-separated (default: {','.join(map(str, LENGTHS))})")
    ap.add_argument("--repetitions", type=positive_int, default=REPETITIONS,
                    help=f"timed engine requests per length, the best kept (default: {REPETITIONS})")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                    help="llama-bench's threads (default: torch's default here, "
                         f"{torch.get_num_threads()}, what the engine's --threads 0 uses)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (default: 0)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="llama.cpp's cache (default: $LLAMACPP_CACHE or " + str(llamacpp.default_cache()) + ")")
    args = ap.parse_args(argv)
    configurations = engine_configurations(ap, args.engine_args)

    try:
        peers = measure_llamacpp(args.lengths, args.threads, args.cache)
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log_dir = Path(tempfile.mkdtemp(prefix="prefill-"))
    engines: list[EngineFigures] = []
    failed: list[str] = []
    for i, engine_args in enumerate(configurations, 1):
        try:
            engines.append(asyncio.run(measure_engine(engine_args, args.lengths, args.repetitions, args.seed,
                                                      log_dir, i)))
        except PrefillError as e:  # the other configurations are still measured
            print(f"error: {e}", file=sys.stderr)
            failed.append(engine_args or "(defaults)")
    if failed:
        print(f"(engine logs kept in {log_dir})", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    report(args.lengths, args.repetitions, args.threads, peers, engines)
    for engine_args in failed:
        print(f"engine with --engine-args {engine_args!r}: failed (its error is on stderr), not measured")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
