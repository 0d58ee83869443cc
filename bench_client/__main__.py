"""CLI: `python -m bench_client sweep [CONFIG.toml] --out DIR [--resume] [--detail]`,
`python -m bench_client report DIR`, `python -m bench_client export DIR [--format json|csv] [--out FILE]`,
`python -m bench_client compare RUN_A [RUN_B] [--plot FILE]` and
`python -m bench_client chat QUESTION [--target HOST:PORT]`.
Without CONFIG, the sweep runs the packaged demo (demo.toml).

Exit codes of sweep: 0 every point recorded; 1 the sweep stopped (engine down, credentials;
resumable); 2 a usage or configuration error (the sweep TOML, --out, or an OTEL_* variable), before
any request; 130/143 interrupted by SIGINT/SIGTERM after draining (resumable).
Exit codes of chat: 0 answered; 1 the engine refused or failed the question (its status, reason and
message are printed) or a managed engine did not start; 2 a usage error; 130 interrupted.
Exit codes of report, export and compare: 0 done; 2 a results directory cannot be read (or compare
was given one run of a single server), or export's --out cannot be written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import structlog

from bench_client.chat import DEFAULT_MODEL, Question, ask_engine, logprob_lines
from bench_client.compare import Comparison, compare, compare_servers, print_comparison, write_plot
from bench_client.config import ConfigError, SweepConfig, load_config
from bench_client.engine_process import EngineStartError
from bench_client.export import FORMATS, export_run, load_run
from bench_client.progress import SweepProgress
from bench_client.report import print_table, write_plots
from bench_client.results import ResultsDir, ResultsError, load_for_report
from bench_client.sweep import SweepEnd, SweepResult, SweepRunner, open_workload
from shared.errors import EngineError, status_code_of
from shared.heap import frozen_heap
from shared.logging import configure_logging
from shared.tracing import configure_tracing, shutdown_tracing

log = structlog.get_logger()

EXIT_OK = 0
EXIT_STOPPED = 1
EXIT_USAGE = 2


def _configure_logging() -> None:
    """The process-wide structlog set-up: JSON lines when stderr is not a TTY."""
    configure_logging("info")


def _configure_tracing() -> None:
    """The process's tracer provider: off unless an OTEL_* variable asks for it (shared.tracing)."""
    try:
        configure_tracing("bench-client")
    except ValueError as err:  # an unknown exporter or protocol; the message names the variable
        raise ConfigError(str(err)) from err


def _sweep_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("config", nargs="?", type=Path, default=None,
                        help="sweep configuration (TOML); the packaged demo.toml when omitted")
    parser.add_argument("--out", type=Path, required=True, help="results directory (must be empty unless --resume)")
    parser.add_argument("--resume", action="store_true", help="run only the points not yet recorded in --out")
    parser.add_argument("--detail", action="store_true", help="also write one line per request to requests.jsonl")
    return parser


def _load(path: Path | None) -> SweepConfig:
    if path is None:
        with resources.as_file(resources.files("bench_client") / "demo.toml") as demo:
            return load_config(demo)
    return load_config(path)


def run_sweep(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config)
        workload = open_workload(config)
        _configure_tracing()
        results = ResultsDir.open(args.out, resume=args.resume, detail=args.detail)
    except (ConfigError, ResultsError) as err:
        print(f"error: {err}", file=sys.stderr)
        shutdown_tracing()
        return EXIT_USAGE
    try:
        # the workload and all start-up made, out of the collector's full passes: none stops the
        # sweep's clocks mid-measurement (shared/heap.py)
        with SweepProgress() as progress, frozen_heap():
            runner = SweepRunner(config, results, progress, workload)
            result, signum = asyncio.run(_run_with_signals(runner))
    finally:
        results.close()
        shutdown_tracing()  # exports the sweep's spans, on every way out (stopped, interrupted, a crash)
    print_table(results.records)
    for server, base, found in runner.search_results:
        over = config.search.over if config.search else ""
        print(f"SLO search{f' of {server}' if server else ''} at {base.tag()}: largest {over} meeting the SLOs "
              f"{found.best if found.best is not None else 'none (not even search.low)'}"
              f"{f', missed at {found.first_miss:g}' if found.first_miss is not None else ''} "
              f"({found.probes} probes)")
    plots = write_plots(results.records, args.out)
    log.info("report_written", results=str(args.out / "results.jsonl"), plots=[str(p) for p in plots])
    if result.end is SweepEnd.STOPPED:
        print(f"sweep stopped: {result.message}\nrecorded points are intact; fix the cause and run again with "
              f"--resume --out {args.out}", file=sys.stderr)
        return EXIT_STOPPED
    if result.end is SweepEnd.INTERRUPTED:
        return 128 + (signum or signal.SIGTERM)
    return EXIT_OK


async def _run_with_signals(runner: SweepRunner) -> tuple[SweepResult, int | None]:
    """First SIGTERM/SIGINT: finish the current point, drain, return. Second: cancel at once."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            runner.request_stop()
        elif task is not None:
            log.warning("sweep_cancelled", signal=signal.Signals(signum).name)
            task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        result = await runner.run()
    except asyncio.CancelledError:
        if len(received) < 2:
            raise  # not our own cancel: let it propagate
        # The second signal cancelled the point in flight (not recorded); the engine was drained by
        # the runner's exit stack on the way out, and every recorded point is intact.
        result = SweepResult(SweepEnd.INTERRUPTED, "cancelled by a second signal; run again with --resume",
                             runner.recorded)
    return result, (received[0] if received else None)


def run_report(args: argparse.Namespace) -> int:
    try:
        records = load_for_report(args.dir / "results.jsonl")
    except ResultsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print_table(records)
    for path in write_plots(records, args.dir):
        print(f"wrote {path}")
    return EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    try:
        text = export_run(args.dir).render(args.format)
    except ResultsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.out is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        args.out.write_text(text, encoding="utf-8")
    except OSError as err:
        print(f"error: --out {str(args.out)!r} cannot be written: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.out}", file=sys.stderr)
    return EXIT_OK


_COMPARE_HELP = """Ratios B / A per point both runs share (same server, engine settings, dataset,
endpoint, context, prefix, new tokens, concurrency, rate): TTFT, TPOT, ITL, E2EL medians, output tok/s,
request goodput. With one run (a sweep of several [servers.NAME]), each server against the first
server (the server of the run's first point). The plot goes to --plot, else beside RUN_B (or RUN):
RUN_B_vs_RUN_A.png, RUN_servers.png."""


def _compare_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_a", type=Path, metavar="RUN_A", help="the baseline results directory")
    parser.add_argument("run_b", type=Path, nargs="?", default=None, metavar="RUN_B",
                        help="the results directory compared with RUN_A; without it, RUN_A's servers are compared")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="where to write the PNG of the ratios")
    return parser


def run_compare(args: argparse.Namespace) -> int:
    try:
        comparisons: list[Comparison]
        if args.run_b is None:
            comparisons = compare_servers(load_run(args.run_a), str(args.run_a))
            default_plot = args.run_a.resolve().parent / f"{args.run_a.resolve().name}_servers.png"
        else:
            comparisons = [compare(load_run(args.run_a), load_run(args.run_b), str(args.run_a), str(args.run_b))]
            b = args.run_b.resolve()
            default_plot = b.parent / f"{b.name}_vs_{args.run_a.resolve().name}.png"
    except (ResultsError, ValueError) as err:  # ValueError: one run of a single server
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    for comparison in comparisons:
        print_comparison(comparison)
    try:
        plot = write_plot(comparisons, args.plot or default_plot)
    except OSError as err:
        print(f"error: --plot {str(args.plot or default_plot)!r} cannot be written: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {plot}" if plot is not None else "no plot: no shared point has a ratio")
    return EXIT_OK


def _unsigned(bits: int) -> Callable[[str], int]:
    """An argparse type for a DecodeRequest field of `bits` unsigned bits: a value the field cannot
    hold (negative, too big) is a usage error, where protobuf would raise; the engine judges the rest."""
    top = 2**bits - 1

    def parse(text: str) -> int:
        value = int(text)  # ValueError: argparse's "invalid uintN value"
        if not 0 <= value <= top:
            raise argparse.ArgumentTypeError(f"must be 0..{top}, got {value}")
        return value

    parse.__name__ = f"uint{bits}"
    return parse


def _chat_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("question", help="the user message")
    parser.add_argument("--target", default=None,
                        help="a running engine (HOST:PORT); without it, a managed engine is started and drained")
    parser.add_argument("--model", default=None,
                        help=f"the managed engine's --model (default: {DEFAULT_MODEL}); not with --target")
    parser.add_argument("--system", default="", help="a system message before the question")
    parser.add_argument("--max-new-tokens", type=_unsigned(32), default=256, help="at most this many answer tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--seed", type=_unsigned(64), default=0, help="the sampling seed when temperature > 0")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds the answer may take")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the answer before this text (repeat for several; at most 8)")
    parser.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                        help="answer with JSON that validates against the JSON Schema in FILE")
    parser.add_argument("--logprobs", type=_unsigned(32), default=0, metavar="N",
                        help="print each answer token's log-probability and its N most likely alternatives "
                             "to stderr (1..20)")
    return parser


def run_chat(args: argparse.Namespace) -> int:
    if args.target is not None and args.model is not None:
        print(f"error: --model {args.model!r} names a managed engine's model; with --target {args.target!r} the "
              "engine there answers with its own model", file=sys.stderr)
        return EXIT_USAGE
    schema = None
    if args.json_schema is not None:
        try:
            schema = args.json_schema.read_text(encoding="utf-8")
            json.loads(schema)
        except (OSError, ValueError) as err:  # ValueError: UnicodeDecodeError and JSONDecodeError
            print(f"error: --json-schema {str(args.json_schema)!r} is not a readable JSON file: {err}", file=sys.stderr)
            return EXIT_USAGE
    question = Question(args.question, system=args.system, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed, stop=tuple(args.stop), json_schema=schema,
                        top_logprobs=args.logprobs)
    try:
        answer = asyncio.run(ask_engine(question, target=args.target, model=args.model or DEFAULT_MODEL,
                                        timeout=args.timeout, out=sys.stdout))
    except EngineError as err:
        print(f"error: {status_code_of(err).name} {err.reason}: {err.message}", file=sys.stderr)
        return EXIT_STOPPED
    except EngineStartError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    for line in logprob_lines(answer.logprobs):
        print(line, file=sys.stderr)
    if answer.finish_reason == "LENGTH":
        print(f"(the answer stopped at --max-new-tokens {args.max_new_tokens})", file=sys.stderr)
    if answer.stop_string is not None:
        print(f"(the answer stopped at --stop {answer.stop_string!r})", file=sys.stderr)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    _configure_logging()
    parser = argparse.ArgumentParser(prog="python -m bench_client", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _sweep_parser(commands.add_parser("sweep", help="run a sweep"))
    report = commands.add_parser("report", help="print the table and write the plots of a results directory")
    report.add_argument("dir", type=Path)
    export = commands.add_parser("export", help="write a results directory as vLLM bench serve JSON, or as CSV",
                                 description="One entry per recorded point; the fields: bench_client/export.py.")
    export.add_argument("dir", type=Path, metavar="RUN", help="a sweep's --out directory")
    export.add_argument("--format", choices=FORMATS, default="json", help="json (default) or csv")
    export.add_argument("--out", type=Path, default=None, metavar="FILE", help="write here instead of stdout")
    _compare_parser(commands.add_parser("compare", help="ratios of two runs (or of one run's servers) per point",
                                        description=_COMPARE_HELP))
    _chat_parser(commands.add_parser("chat", help="ask one question as chat messages; stream the answer"))
    args = parser.parse_args(argv)
    commands_run = {"sweep": run_sweep, "report": run_report, "export": run_export, "compare": run_compare,
                    "chat": run_chat}
    return commands_run[args.command](args)


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """The `bench-sweep` console script: the same arguments as `python -m bench_client sweep`."""
    _configure_logging()
    args = _sweep_parser(argparse.ArgumentParser(prog="bench-sweep")).parse_args(argv)
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
