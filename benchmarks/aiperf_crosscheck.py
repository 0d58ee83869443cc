"""AIPerf, an independent benchmark client, against ours: the same server, the same prompts.

    python benchmarks/aiperf_crosscheck.py [--server llama-server|engine] [--short] [--requests N]
        [--prompt-tokens 128] [--output-tokens 64] [--concurrency 1,8] [--server-nice N] [--out DIR]
        [--cache DIR]

One server serves the packaged SmolLM2 GGUF on one core (`taskset -c 0`, one thread, 8 sequences
at once, at most 128 prompt tokens a step, no prompt cache):
  --server llama-server (default): the `make peers` build (bench_client.peers), `-t 1`, `-np 8`,
      `-b 128 -ub 128`, `--no-cache-prompt --cache-ram 0`;
  --server engine: this engine's OpenAI-compatible HTTP front, `python -m engine_service --model
      smollm2 --port 0 --http-port PORT --threads 1 --max-batch 8 --max-context 256
      --max-prefill-tokens 128 --prefix-cache-tokens 0 --grace-seconds 5`.
Each client runs on the other core (`taskset -c 1`): AIPerf's own processes take most of a core,
and a client on the server's core slows it. At each concurrency (1, 8) our client (`python -m
bench_client sweep`, `api = "openai"`) runs, then AIPerf (`aiperf profile --endpoint-type
completions --streaming --use-server-token-count`), each one warmup request and then N measured,
over the same HTTP. Without a prompt cache the second client's prompts, and a measured one equal
to the warmup's, are computed in full as the first time.

Prompts: N texts of exactly --prompt-tokens tokens (our random dataset, bench_client.datasets;
counted again by the server's /tokenize), each for --output-tokens tokens, `ignore_eos`, greedy.
One list, written in each client's JSONL: `prompts.jsonl` (ours, `dataset = "jsonl:PATH"`: lines
{"prompt", "max_tokens"}, other keys refused) and `prompts.aiperf.jsonl` (AIPerf's
`--custom-dataset-type single_turn`: {"text", "output_length"}). Each replays all N lines once
(ours from a seeded line on, AIPerf in order): the same texts. AIPerf 0.13.0 lives in its own venv
(~/.cache/engine-bench/aiperf-0.13.0/venv: ~80 s to install the first time), with a tokenizer
folder written there once from the GGUF by transformers.

Compared, over the measured requests (p50: the interpolated median; ratio AIPerf / ours):
  TTFT p50  ours ttft_ms            AIPerf time_to_first_token     first content chunk - request sent
  TPOT p50  ours tpot_ms            AIPerf inter_token_latency     (E2EL - TTFT) / (output tokens - 1)
  ITL mean  ours itl_ms             AIPerf inter_chunk_latency     gaps between content chunks
  tok/s     ours output_throughput  AIPerf output_token_throughput output tokens / duration
A judged figure agrees when AIPerf's is within 10% of ours; or, where the server itself ran at
another speed under one client than under the other (its own log says so: its TTFT, its time per
token for TPOT and ITL, its tokens per second for throughput), when the ratio divided by the server's own
ratio (`/ server`) is within 10%: the clients then measured the same work alike, and the server
was what changed (on these 2-core machines AIPerf's busy-polling timing manager slows the
server's core too; a run in CI showed TPOT 13.43 / 15.21 ms, 1.133, with the server's own time
per token 13.55 / 15.24 ms, 1.125: 1.007 once divided). Both ratios are printed. The server's own
figures, of the measured requests, each the same statistic as the judged figure: llama-server's
log (each task's launch_slot_ and print_timing lines, stamped with the time since it started): the
median of launch to end less the eval time for TTFT p50 (the wait behind the other slots' prompts
included; the wait from the request's arrival to its launch, up to one batch step, not), the median
and the mean of eval ms per token for TPOT p50 and ITL mean, the eval tokens over first launch to
last end for tok/s; its median prompt eval ms shown. The engine's `request_finished` events
(engine_service/transport/telemetry.py): the median ttft_s (from its acceptance, the queue wait
included) for TTFT p50, the median and the mean of (duration_s - ttft_s) / (output_tokens - 1) for
TPOT p50 and ITL mean, its output tokens over first start to last end for tok/s; its median
prompt_tokens shown. (Until 2026-12-04 llama-server's were its prompt eval ms for TTFT and the
inverse of its ms per token for tok/s, and a CI run at c=1 read tok/s 0.823, 0.914 once divided:
its duration counts the prompts too. Run here on the AVX2 EPYC: 1.183 with the server's own tok/s
1.185, 0.999 divided.)
ITL is judged by its mean, its p50 shown: when one network read carries several events, each
client gives them all that read's time (gaps of 0), so how reads fall splits the gaps' distribution
in two and its median jumps between the groups, while the mean (the same span over the same number
of chunks) does not move (a CI run at c=8: ITL p50 87.1 / 78.4 ms, 0.900, with TPOT 151 / 150 ms,
0.992).
Shown, not judged: ITL p50, E2EL, output tokens per request, the durations, failures, our retries, the
prompt tokens the server ran (llama-server's timings.prompt_n in our answers; the engine's logged
prompt_tokens), and the server's own view of each client's requests (the medians above): where
the clients disagree and the server's own figures differ alike, the server was slower, not a
client wrong. Each run
reports the cores other processes kept busy meanwhile; over 0.25 (`*`) its figures are not fit
to compare (`--server-nice -N`, as root, keeps them off the server's core, and so crowds the
clients' core). Exit 0 when every judged figure is within 10% (at a concurrency that disagreed,
in the means of both pairs: Drift, below), else 1 (the tables are printed as each concurrency
ends). `--short` (CI): 8 requests at c=1, 24 at c=8 (3 x c: Waves, below); by
default 24 and 32.

FINDINGS (AIPerf's source: site-packages/aiperf/ of its venv; llama.cpp: the vendored tree)
- Definitions are ours: TTFT and request latency from the first and last content response
  (metrics/types/ttft_metric.py, request_latency_metric.py); inter_token_latency is (latency -
  TTFT) / (OSL - 1) per request, vLLM's TPOT (inter_token_latency_metric.py:102); inter_chunk_
  latency the gaps (our ITL). Both stamp each network read and give every SSE event in it that
  time (transports/sse_utils.py:133,180; ours openai_http.py's iter_any). tok/s divides by last
  response - first request of the profiling phase (benchmark_duration_metric.py), warmup excluded,
  as ours divides by first measured send to last end (point.py).
- Output tokens: AIPerf re-tokenizes the answer's text unless --use-server-token-count
  (records/inference_result_parser.py:339-345, 650-690). With ignore_eos SmolLM2 emits token
  sequences the tokenizer would not: " servant" in two tokens, 32 times, re-tokenizes to 32 of 64.
  Ours counts usage.completion_tokens, so AIPerf runs with --use-server-token-count.
- Keep-alive: AIPerf pools connections for 300 s (common/environment.py:857,
  AIPERF_HTTP_KEEPALIVE_TIMEOUT), llama-server closes them after 5 s idle (cpp-httplib,
  vendor/cpp-httplib/httplib.h:26): at c=8 the warmup's connection, idle through the first wave,
  was reused dead ("Can not write request body"), counted failed, not retried; the next wave ran 7.
  AIPerf gets our 3 s (openai_pool.KEEPALIVE_TIMEOUT_S), under the engine's 75 s too (aiohttp's
  default keepalive_timeout; http_front.py sets none).
- Arrivals: both start all C at once and send one more as each ends (AIPerf: timing/config.py:57
  CONCURRENCY_BURST, timing/intervals.py:207 zero intervals under a semaphore of C; no ramp unless
  --concurrency-ramp-duration; its warmup ends before profiling, timing/config.py:548). llama-server
  batches whatever has arrived: with the default -b 2048 a burst split 1 + 7 for ours in every wave
  (its first request rides the warmup's pooled connection, the rest connect; then that one ends a
  step early and its successor goes alone again), 3 + 5, 5 + 3, 6 + 2 for AIPerf, so TTFT and TPOT
  p50 fell in the late group for ours and the early one for AIPerf (0.72-0.77, 1.3-1.4). With -b
  128 the server computes the prompts one an iteration whatever the split: c=8 within 0.2-7%.
- Waves: at c=8 the first 8 requests start at once and queue behind each other's prompts; each
  later one starts as one ends, into a running batch, and waits for one prompt: its TTFT falls in
  a band. A quiet run, 24 at c=8, ours sorted: llama-server's first wave 1291 3031 3944 4812 ...
  8131 ms, its 16 successors 1109-3159 (2734-2801 in the second wave, 3089-3159 in the third);
  the engine's first wave 233 456 681 918 ... 1898, its successors 271 299 and 474-530. With
  2 x c requests (the old --short's 16) the successors are exactly half, so the TTFT p50 (the
  8th and 9th of 16) sits at the band's top edge, the first wave's next value above it (the
  engine's 16: 233 271 456 474 477 497 501 509 | 518 521 681): one value more or less below
  moves it by a first-wave step, and the llama-server check failed TTFT at c=8 about 1 run in 3.
  12 (1.5 x c) puts the edge at the p50 too (the engine's 12: 233 271 456 474 477 497 | 681 918,
  p50 589 between the band and the first wave's 3rd; llama-server's 3031 | 3944, 0.9 s apart).
  With 3 x c (24) the successors are 2 x c of 3 x c and the p50 lies among them, about 4 values
  from either edge (the engine's 501 | 509 at ranks 12-13 of a band at ranks 2-18), as with the
  default 4 x c.
- The engine's idle step prefills up to 2,048 tokens (scheduling/scheduler.py IDLE_PREFILL_TOKENS;
  --max-prefill-tokens bounds only the steps beside decoding rows), so a burst reaching the idle
  engine splits by arrival, as llama-server's -b 2048 did: in one run our 8 arrived within a
  millisecond and 5 were prefilled in one step (TTFT 1,059 ms each), then one a step; AIPerf's,
  about 1.5 ms apart, one a step from the first (241, 473, ..., 1,865 ms); the split carried into
  the next wave (5 ending together, their 5 successors sent together). TTFT p50 0.440 of ours, the
  engine's own TTFT p50 0.437 of ours: 1.005 divided. The engine's TTFT counts from its
  acceptance, queue included, so it moves with the split and `/ server` judges how the clients
  measured what the server did; llama-server's view starts at the slot's launch, after the wait
  for its main loop's step, hence -b 128 there too. The engine logs request_finished after the stream's end (http_front.py's _generate), so
  its view waits up to LOG_WAIT_S for the run's events. Its speed moved between the two clients'
  runs even on a quiet machine (its logged ms/token at c=8 65.3 under ours, 77.9 under AIPerf; at
  c=1 18.9 and 17.5): raw ratios 0.86-1.19, each 0.997-1.014 once divided by the same statistic
  of its log. With a core's worth of other processes (`*`; the engine 1.5-2.5 times slower under
  AIPerf than under ours) the divided ratios stayed within 0.99-1.01; by the medians of its time
  per token, as for llama-server, ITL mean and tok/s were off by 0.83 and 1.25 there (a mean
  against a median of per-request speeds that varied 2-fold).
- AIPerf's own CPU: its timing manager busy-polls while every slot is taken (timing/strategies/
  request_rate.py:316,328, yield_to_event_loop in the loop), about 0.6 of the client core; with
  other processes there too its worker reads late, several events a read (gaps of 0: ITL p50 9.5
  against 12.0 ms at c=1). A finished request's successor leaves about 6 ms later through its
  processes (ours: under 1 ms), nothing beside 10 s requests.
- Other processes: pinning keeps neither client's core nor the server's to itself. A client that
  keeps its core busy (AIPerf) pushes other processes onto the server's core: in contended runs the
  server's own prompt and token times moved with AIPerf's figures (1.78 and 1.51 against 1.83 and
  1.53), so both clients measured the server truly and the server was slower. Compare runs
  without `*` only; on a quiet machine every figure agreed within 1% at c=1 and 7% at c=8.
- Drift: a server's speed can move between the two clients' runs with no process to blame (a
  shared machine's neighbours; the busy-cores figure counts only this machine's processes). A CI
  run at c=8 on llama-server, other processes 0.01 cores busy: the server's own ms/token 252 under
  ours, 194 under AIPerf (0.769), its prompt ms 2,755 and 2,172 (0.789); TTFT p50 4,801 / 3,235 ms,
  0.674, 0.855 once divided. At c=8 TTFT is a prompt's wait behind the wave's other prompts and
  decode steps, which the server's prompt time leaves out, so dividing does not undo the drift
  there. A concurrency that disagrees is therefore measured once more, AIPerf first then ours
  (ABBA), and judged by each client's mean over its two runs: drift that is steady over the four
  runs cancels, and a client that measures wrongly stays wrong in both. Both pairs' tables are
  printed; the exit status follows the means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_client import peers  # noqa: E402
from bench_client.server_process import free_port, guarded, stop_blocking, wait_until_serving_blocking  # noqa: E402
from benchmarks.llamacpp import CONTENDED, OthersBusy  # noqa: E402

AIPERF_VERSION = "0.13.0"
TOLERANCE = 0.10  # judged figures agree when AIPerf's is within 10% of ours
CONCURRENCIES = (1, 8)
SLOTS = 8  # llama-server -np: one slot per request in flight at the highest concurrency
SEED = 7
# llama-server's batch (-b, -ub; default 2048 and 512): at most BATCH tokens an iteration, so a burst's
# prompts are computed one after the other whichever of them reached the server first (FINDINGS).
BATCH = 128
STEP_TIMEOUT_S = 900.0


class CrosscheckError(RuntimeError):
    """A step failed; the message names it and quotes what it printed."""


def log(msg: str) -> None:
    print(f"[crosscheck] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    return peers.llamacpp_cache().parent / f"aiperf-{AIPERF_VERSION}"


def run_step(step: str, cmd: Sequence[str], *, timeout: float = STEP_TIMEOUT_S, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> str:
    """Run cmd to its end; its stdout+stderr. CrosscheckError with the output's tail on failure."""
    shown = " ".join(str(c) for c in cmd)
    log(f"{step}: {shown}")
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CrosscheckError(f"{step} failed: `{shown}`: {err}") from err
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CrosscheckError(f"{step} failed (exit {proc.returncode}): `{shown}`\n--- output tail ---\n{out[-3000:]}")
    return out


# ---------------------------------------------------------------------------------------------
# The environments: AIPerf's own venv and the tokenizer folder, made once in the cache


def aiperf_env(cache: Path) -> Path:
    """AIPerf's executable in its own venv (cache/venv), installed when missing. A venv without the
    marker (an install cut short) is made again."""
    venv = cache / "venv"
    marker = venv / ".aiperf-installed"
    if marker.is_file() and marker.read_text().strip() == AIPERF_VERSION:
        return venv / "bin" / "aiperf"
    shutil.rmtree(venv, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"installing aiperf=={AIPERF_VERSION} into {venv} (about 80 s the first time)")
    run_step("venv", [sys.executable, "-m", "venv", venv], timeout=300)
    run_step("pip install aiperf", [venv / "bin" / "python", "-m", "pip", "install", "-q",
                                    f"aiperf=={AIPERF_VERSION}"], timeout=1800)
    run_step("aiperf --version", [venv / "bin" / "aiperf", "--version"], timeout=120)
    marker.write_text(AIPERF_VERSION + "\n")
    return venv / "bin" / "aiperf"


def smollm2_gguf() -> Path:
    from engine_service.model.presets import PACKAGED

    return PACKAGED["smollm2"].locate("smollm2")


def tokenizer_dir(cache: Path) -> Path:
    """A Hugging Face tokenizer folder of SmolLM2, written from the packaged GGUF by transformers
    (what AIPerf loads with --tokenizer, and what sizes the prompts here)."""
    out = cache / "tokenizer-smollm2"
    if (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    log(f"writing the tokenizer folder {out} from {gguf.name}")
    staging = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=cache))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(staging))
    staging.rename(out)
    return out


# ---------------------------------------------------------------------------------------------
# The prompts: N texts of exactly L tokens, in each client's JSONL form


def make_prompts(tok_dir: Path, count: int, length: int, seed: int = SEED) -> list[str]:
    """`count` texts of exactly `length` tokens by the tokenizer folder's tokenizer: our client's
    random dataset (bench_client.datasets.random_items: random ids decoded, re-encoded and cut to
    the length, as vLLM's random dataset, made exact)."""
    from bench_client import datasets
    from bench_client.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tok_dir), base_dir=tok_dir)
    items = asyncio.run(datasets.random_items(tokenizer, lengths=[length] * count, seed=f"aiperf-crosscheck:{seed}"))
    return [item.text for item in items]


def write_prompt_files(out: Path, prompts: Sequence[str], output_tokens: int) -> tuple[Path, Path]:
    """The same prompts twice: ours (jsonl: {"prompt", "max_tokens"}) and AIPerf's single_turn
    ({"text", "output_length"}); the two paths."""
    ours, theirs = out / "prompts.jsonl", out / "prompts.aiperf.jsonl"
    ours.write_text("".join(json.dumps({"prompt": p, "max_tokens": output_tokens}) + "\n" for p in prompts))
    theirs.write_text("".join(json.dumps({"text": p, "output_length": output_tokens}) + "\n" for p in prompts))
    return ours, theirs


# ---------------------------------------------------------------------------------------------
# The server: llama-server, or the engine's HTTP front, on one core, no prompt cache

SERVERS = ("llama-server", "engine")  # --server
LOG_WAIT_S = 10.0  # how long the engine's request_finished events may trail the client's last answer


@dataclass
class Server:
    """A server pinned to `core` (at niceness `nice`), started on enter (ready when GET /health
    answers 200). Its command, its own view of each client's requests and its /tokenize body are
    the subclass's: LlamaServer, EngineServer."""

    core: int
    ctx: int  # tokens of context, all slots together
    log_path: Path
    nice: int = 0
    port: int = 0
    proc: subprocess.Popen | None = None
    command: list[str] = field(default_factory=list)

    name: ClassVar[str] = "server"
    # Each judged figure's counterpart in the server's own view, and its sense: the server's prompt
    # time (or TTFT) moves TTFT, its time per token moves TPOT and ITL, and throughput inversely.
    view: ClassVar[dict[str, tuple[str, int]]] = {}
    shown: ClassVar[tuple[str, ...]] = ()  # the server's rows among the table's shown ones
    differed: ClassVar[str] = "the server's own figure differed"  # the verdict when only `/ server` agrees

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def server_command(self) -> list[str]:
        """The server's own command line, on self.port (pinning and niceness are added around it)."""
        raise NotImplementedError

    def description(self) -> str:
        """What serves, where, as the header line says it."""
        raise NotImplementedError

    def own_timings(self, since: int, run: Run) -> dict[str, float | None]:
        """The server's own view of the requests of `run` it logged after byte `since` of its log,
        by the rows in `shown`."""
        raise NotImplementedError

    def tokenize_body(self, text: str) -> dict[str, str]:
        """The body of POST /tokenize for `text`."""
        raise NotImplementedError

    def __enter__(self) -> Server:
        self.port = free_port()
        self.command = [*(["nice", "-n", str(self.nice)] if self.nice else []), "taskset", "-c", str(self.core),
                        *self.server_command()]
        log(f"{self.name}: {' '.join(self.command)}")
        with open(self.log_path, "ab") as out:  # guarded: SIGTERM to the server should this script die
            proc = subprocess.Popen(guarded(self.command), cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.proc = proc
        if wait_until_serving_blocking(proc, self._healthy, 120, poll_s=0.1):
            return self
        exited = proc.poll()
        self.__exit__()
        if exited is not None:
            raise CrosscheckError(f"{self.name} exited with {exited}; "
                                  f"log {self.log_path}:\n{self.log_path.read_text(errors='replace')[-3000:]}")
        raise CrosscheckError(f"{self.name} not ready after 120 s; log {self.log_path}")

    def _healthy(self, timeout: float) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.HTTPError, OSError):
            return False  # 503 while loading, or not listening yet

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_blocking(proc, 10)

    def _log_since(self, since: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (/proc/PID/stat utime + stime, all its threads)."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def token_counts(self, prompts: Sequence[str]) -> list[int]:
        """How many tokens the server's own tokenizer makes of each prompt (POST /tokenize)."""
        counts = []
        for text in prompts:
            req = urllib.request.Request(f"{self.url}/tokenize", data=json.dumps(self.tokenize_body(text)).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                counts.append(len(json.load(resp)["tokens"]))
        return counts


@dataclass
class LlamaServer(Server):
    """llama-server (the `make peers` build): `-t 1`, one slot per request in flight, batch BATCH,
    no prompt cache."""

    name: ClassVar[str] = "llama-server"
    # Each judged figure's counterpart is the same statistic of the server's own log, as for the
    # engine: its TTFT from the slot's launch (the wait behind the other slots' prompts included),
    # its time per token (a median, and a mean for ITL's mean: when a contended run's per-request
    # speed swings, a mean and a median part), its own tokens per second.
    view: ClassVar[dict[str, tuple[str, int]]] = {
        "TTFT p50 ms": ("server's TTFT ms p50", 1), "TPOT p50 ms": ("server's ms/token p50", 1),
        "ITL mean ms": ("server's ms/token mean", 1), "output tok/s": ("server's tok/s", 1)}
    shown: ClassVar[tuple[str, ...]] = ("server prompt_n", "server's prompt ms p50", "server's TTFT ms p50",
                                        "server's ms/token p50", "server's ms/token mean", "server's tok/s")
    differed: ClassVar[str] = "the server's own speed differed"

    def server_command(self) -> list[str]:
        # Weight repacking off (--no-repack): this build dies of SIGILL loading Q4_1 with it (tests/llama_server.py).
        return [str(peers.llama_server()), "-m", str(smollm2_gguf()),
                "-t", "1", "-np", str(SLOTS), "-c", str(self.ctx), "-b", str(BATCH), "-ub", str(BATCH),
                "--host", "127.0.0.1",
                "--port", str(self.port), "--no-repack", "--no-cache-prompt", "--cache-ram", "0"]

    def description(self) -> str:
        return f"llama-server (SmolLM2-135M Q4_1) on core {self.core} (1 thread, -b {BATCH})"

    def tokenize_body(self, text: str) -> dict[str, str]:
        return {"content": text}

    def own_timings(self, since: int, run: Run) -> dict[str, float | None]:
        """The server's view of the run's measured requests, from its log after byte `since`: each
        task's launch (`launch_slot_`) and its print_timing lines, stamped with the time since the
        server started (minutes.seconds.milliseconds.microseconds). Per task: the prompt eval ms;
        its TTFT, from the launch to the end less the eval time (the time after the first token);
        the eval ms per token. Then their medians, the mean ms per token, and its tokens per second:
        the eval tokens over the first launch to the last end. Each client sends its warmup alone
        and waits for its end, so the first `run.warmup` tasks launched are the warmup's, and left
        out."""
        text = self._log_since(since)
        launched = {m["task"]: _log_time(m) for m in LAUNCH_RE.finditer(text)}
        prompt_ms = {m["task"]: float(m["prompt_ms"]) for m in PROMPT_RE.finditer(text)}
        tasks = []  # (launch s, end s, prompt ms, TTFT ms, ms per token, tokens) per finished task
        for m in EVAL_RE.finditer(text):
            task, end, eval_ms = m["task"], _log_time(m), float(m["eval_ms"])
            if task not in launched or task not in prompt_ms:
                raise CrosscheckError(f"llama-server's log {self.log_path}: task {task}'s eval time at "
                                      f"{m['stamp']} has no launch_slot_ line or prompt eval time before it")
            tasks.append((launched[task], end, prompt_ms[task], (end - launched[task]) * 1e3 - eval_ms,
                          float(m["per_token"]), int(m["tokens"])))
        measured = sorted(tasks)[run.warmup:]
        own = ("server's prompt ms p50", "server's TTFT ms p50", "server's ms/token p50", "server's ms/token mean",
               "server's tok/s")
        if not measured:
            return dict.fromkeys(own)
        span = max(t[1] for t in measured) - min(t[0] for t in measured)
        per_token = [t[4] for t in measured]
        return dict(zip(own, (statistics.median(t[2] for t in measured), statistics.median(t[3] for t in measured),
                              statistics.median(per_token), statistics.fmean(per_token),
                              sum(t[5] for t in measured) / span if span > 0 else None), strict=True))


# llama-server's log lines, each stamped with the time since it started (common/log.cpp)
_STAMP = r"^(?P<stamp>(?P<min>\d+)\.(?P<sec>\d\d)\.(?P<milli>\d{3})\.(?P<micro>\d{3})) I slot "
LAUNCH_RE = re.compile(_STAMP + r"launch_slot_: id\s+\d+ \| task (?P<task>\d+) \| processing task", re.M)
PROMPT_RE = re.compile(r"\| task (?P<task>\d+) \| prompt eval time =\s*(?P<prompt_ms>[\d.]+) ms", re.M)
EVAL_RE = re.compile(_STAMP + r"print_timing: id\s+\d+ \| task (?P<task>\d+) \|\s+eval time =\s*"
                     r"(?P<eval_ms>[\d.]+) ms /\s*(?P<tokens>\d+) tokens \(\s*(?P<per_token>[\d.]+) ms per", re.M)


def _log_time(m: re.Match[str]) -> float:
    """Seconds since the server started, from a line's stamp."""
    return int(m["min"]) * 60 + int(m["sec"]) + int(m["milli"]) / 1e3 + int(m["micro"]) / 1e6


@dataclass
class EngineServer(Server):
    """This engine's OpenAI-compatible HTTP front (`python -m engine_service --http-port`) on the
    packaged SmolLM2 GGUF: `--threads 1`, SLOTS sequences decoded together, at most BATCH prompt
    tokens prefilled a step (llama-server's -b), no prefix cache (its --no-cache-prompt)."""

    name: ClassVar[str] = "engine"
    # Each judged figure's counterpart is the same statistic of the engine's own log: a median for
    # the medians, the mean time per token for ITL's mean, its own tokens per second for tok/s.
    view: ClassVar[dict[str, tuple[str, int]]] = {
        "TTFT p50 ms": ("server's TTFT ms p50", 1), "TPOT p50 ms": ("server's ms/token p50", 1),
        "ITL mean ms": ("server's ms/token mean", 1), "output tok/s": ("server's tok/s", 1)}
    shown: ClassVar[tuple[str, ...]] = ("server's prompt tokens", "server's TTFT ms p50", "server's ms/token p50",
                                        "server's ms/token mean", "server's tok/s")
    differed: ClassVar[str] = "the server's own figure differed alike"

    def server_command(self) -> list[str]:
        return [sys.executable, "-m", "engine_service", "--model", "smollm2", "--host", "127.0.0.1", "--port", "0",
                "--http-port", str(self.port), "--threads", "1", "--max-batch", str(SLOTS),
                "--max-context", str(self.ctx // SLOTS), "--max-prefill-tokens", str(BATCH),
                "--prefix-cache-tokens", "0", "--grace-seconds", "5"]

    def description(self) -> str:
        return (f"the engine's HTTP front (engine_service, SmolLM2-135M Q4_1 GGUF) on core {self.core} "
                f"(--threads 1, --max-prefill-tokens {BATCH})")

    def tokenize_body(self, text: str) -> dict[str, str]:
        return {"prompt": text}  # vLLM's shape

    def own_timings(self, since: int, run: Run) -> dict[str, float | None]:
        """The engine's view of the run's measured requests that succeeded, from their
        `request_finished` events (engine_service/transport/telemetry.py): the median prompt_tokens;
        the median ttft_s (acceptance to first token, the queue wait included: the server's TTFT);
        the median and the mean of (duration_s - ttft_s) / (output_tokens - 1), its time per token
        after the first (duration_s runs from the handler's start, ttft_s from the acceptance a few
        ms later, and to the stream's end after the last token: within a few ms over 64 tokens);
        and its tokens per second, all output tokens over first start (timestamp - duration_s) to
        last end (the event's timestamp, logged at the end). Each client sends its warmup alone and
        waits for its end, so the first `run.warmup` events after byte `since` are the warmup's, and
        left out. An event is logged as its answer ends, so this waits up to LOG_WAIT_S for all of
        the run's."""
        expected = run.warmup + run.requests
        deadline = time.monotonic() + LOG_WAIT_S
        events = self._finished(since)
        while len(events) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            events = self._finished(since)
        if len(events) < expected:
            log(f"warning: the engine's log {self.log_path} has {len(events)} request_finished events after "
                f"byte {since}, not the {expected} requests sent ({run.warmup} warmup), {LOG_WAIT_S:.0f} s "
                "after the last answer; its own view covers those")
        ok = [e for e in events[run.warmup:] if e.get("status") == "OK"]
        if not ok:
            return dict.fromkeys(self.shown)
        field_of = self._field
        prompt = [field_of(e, "prompt_tokens") for e in ok]
        ttft = [field_of(e, "ttft_s") * 1e3 for e in ok]
        per_token = [(field_of(e, "duration_s") - field_of(e, "ttft_s")) * 1e3 / (field_of(e, "output_tokens") - 1)
                     for e in ok if field_of(e, "output_tokens") >= 2]
        ends = [self._ended_at(e) for e in ok]
        span = max(ends) - min(end - field_of(e, "duration_s") for e, end in zip(ok, ends, strict=True))
        return {"server's prompt tokens": statistics.median(prompt),
                "server's TTFT ms p50": statistics.median(ttft),
                "server's ms/token p50": statistics.median(per_token) if per_token else None,
                "server's ms/token mean": statistics.fmean(per_token) if per_token else None,
                "server's tok/s": sum(field_of(e, "output_tokens") for e in ok) / span if span > 0 else None}

    def _field(self, event: dict[str, Any], key: str) -> float:
        """A number from a successful request's request_finished event; CrosscheckError naming it
        when it is missing or not one."""
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CrosscheckError(f"the engine's log {self.log_path}: request_finished of request "
                                  f"{event.get('request_id')!r} (status OK) has {key}={value!r}, not a number")
        return float(value)

    def _ended_at(self, event: dict[str, Any]) -> float:
        """The event's `timestamp` (ISO 8601, UTC, logged at the request's end) in seconds."""
        stamp = event.get("timestamp")
        try:
            return datetime.fromisoformat(str(stamp)).timestamp()
        except ValueError as err:
            raise CrosscheckError(f"the engine's log {self.log_path}: request_finished of request "
                                  f"{event.get('request_id')!r} has timestamp={stamp!r}, not ISO 8601: {err}") from err

    def _finished(self, since: int) -> list[dict[str, Any]]:
        """The request_finished events in the complete lines after byte `since` (the engine logs one
        JSON object a line; lines that are not JSON, a library's warning, are passed over)."""
        text = self._log_since(since)
        events = []
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n") or not line.startswith("{"):
                continue  # a line still being written, or not one of the engine's events
            try:
                event = json.loads(line)
            except json.JSONDecodeError as err:
                raise CrosscheckError(f"the engine's log {self.log_path}: a line after byte {since} is not "
                                      f"JSON ({err}): {line[:200]!r}") from err
            if isinstance(event, dict) and event.get("event") == "request_finished":
                events.append(event)
        return events


def make_server(kind: str, core: int, ctx: int, work: Path, nice: int) -> Server:
    """The --server's Server (not started: enter it), its log in `work`."""
    if kind == "llama-server":
        return LlamaServer(core, ctx, work / "llama-server.log", nice=nice)
    if kind == "engine":
        return EngineServer(core, ctx, work / "engine.log", nice=nice)
    raise CrosscheckError(f"--server must be one of {', '.join(SERVERS)}, got {kind!r}")


# ---------------------------------------------------------------------------------------------
# The two clients: one run each at one concurrency, its figures by the table's names


@dataclass(frozen=True)
class Run:
    concurrency: int
    requests: int
    warmup: int
    prompt_tokens: int
    output_tokens: int


@dataclass
class Figures:
    client: str
    values: dict[str, float | None]  # the table's rows, by name
    note: str = ""
    others_busy_cores: float | None = None
    wall_s: float = 0.0


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(step: str, server: Server, run: Run, fn: Callable[..., Figures], *args: Any) -> Figures:
    """fn(*args), with the cores other processes (not the server, not our children) kept busy
    meanwhile, and the server's own view of the run's requests (Server.own_timings)."""
    t0, log_at = time.monotonic(), server.log_path.stat().st_size
    with OthersBusy(step, own_cpu_s=lambda: _children_cpu_s() + server.cpu_s(), log=log) as busy:
        figures = fn(*args)
    figures.others_busy_cores, figures.wall_s = busy.cores, time.monotonic() - t0
    figures.values.update(server.own_timings(log_at, run))
    return figures


def our_config(server: Server, run: Run, prompts_file: Path, tok_dir: Path) -> str:
    """Our sweep's TOML: one point, the prompts file replayed (each line's own max_tokens)."""
    return (f'api = "openai"\ntarget = "{server.url}"\n\n[workload]\ndataset = "jsonl:{prompts_file}"\n'
            f'tokenizer = "{tok_dir}"\nconcurrency = [{run.concurrency}]\nrequests_per_point = {run.requests}\n'
            f"warmup_requests = {run.warmup}\nseed = {SEED}\nignore_eos = true\ntemperature = 0.0\n")


def run_ours(server: Server, run: Run, work: Path, prompts_file: Path, tok_dir: Path, core: int) -> Figures:
    work.mkdir(parents=True)
    (work / "sweep.toml").write_text(our_config(server, run, prompts_file, tok_dir))
    run_step(f"ours c={run.concurrency}", ["taskset", "-c", str(core), sys.executable, "-m", "bench_client",
                                            "sweep", work / "sweep.toml", "--out", work / "out", "--detail"], cwd=REPO)
    records = [json.loads(line) for line in (work / "out" / "results.jsonl").read_text().splitlines() if line]
    if len(records) != 1 or records[0].get("status") != "ok":
        raise CrosscheckError(f"ours c={run.concurrency}: expected one ok point, got {records}")
    m, req = records[0]["metrics"], records[0]["requests"]
    return Figures("ours", {
        "TTFT p50 ms": m["ttft_ms"]["median"], "TPOT p50 ms": m["tpot_ms"]["median"],
        "ITL mean ms": m["itl_ms"]["mean"], "ITL p50 ms": m["itl_ms"]["median"],
        "output tok/s": m["output_throughput"],
        "E2EL p50 ms": m["e2el_ms"]["median"],
        "output tokens/request": m["total_output_tokens"] / m["completed"] if m["completed"] else None,
        "duration s": m["duration_s"], "completed": req["completed"], "failed": req["failed"],
        "retries": req["retries"], "server prompt_n": m.get("server_timings_mean", {}).get("prompt_n"),
    }, note=f"output tokens from {m.get('output_token_source')}")


def aiperf_command(aiperf: Path, server: Server, run: Run, prompts_file: Path, tok_dir: Path,
                   artifacts: Path) -> list[str]:
    return [str(aiperf), "profile", "--model", "smollm2", "--url", server.url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", str(tok_dir), "--input-file", str(prompts_file),
            "--custom-dataset-type", "single_turn", "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", "temperature:0", "--extra-inputs", "top_p:1",
            "--concurrency", str(run.concurrency), "--request-count", str(run.requests),
            "--warmup-request-count", str(run.warmup), "--random-seed", str(SEED), "--ui-type", "none",
            "--artifact-dir", str(artifacts), "--max-workers", "1", "--record-processor-service-count", "1",
            "--no-server-metrics", "--use-server-token-count"]


def aiperf_env_vars() -> dict[str, str]:
    """AIPerf's environment: its pooled connections kept idle no longer than ours are (3 s), under
    llama-server's 5 s (cpp-httplib's keep-alive timeout); AIPerf's default, 300 s, reuses
    connections the server has closed, and the request fails ("Can not write request body")."""
    from bench_client.openai_pool import KEEPALIVE_TIMEOUT_S

    return {**os.environ, "AIPERF_HTTP_KEEPALIVE_TIMEOUT": str(int(KEEPALIVE_TIMEOUT_S))}


def _stat(summary: dict, key: str, stat: str) -> float | None:
    value = summary.get(key, {})
    return value.get(stat) if isinstance(value, dict) else None


def run_aiperf(aiperf: Path, server: Server, run: Run, work: Path, prompts_file: Path, tok_dir: Path,
               core: int) -> Figures:
    work.mkdir(parents=True)
    cmd = ["taskset", "-c", str(core), *aiperf_command(aiperf, server, run, prompts_file, tok_dir, work / "artifacts")]
    (work / "command.txt").write_text(f"AIPERF_HTTP_KEEPALIVE_TIMEOUT={aiperf_env_vars()['AIPERF_HTTP_KEEPALIVE_TIMEOUT']} "
                                      + " ".join(cmd) + "\n")
    run_step(f"AIPerf c={run.concurrency}", cmd, cwd=work, env=aiperf_env_vars())
    summary = json.loads((work / "artifacts" / "profile_export_aiperf.json").read_text())
    records = summary.get("records", summary)  # the metrics: under "records" in 0.13.0
    return Figures("AIPerf", {
        "TTFT p50 ms": _stat(records, "time_to_first_token", "p50"),
        "TPOT p50 ms": _stat(records, "inter_token_latency", "p50"),
        "ITL mean ms": _stat(records, "inter_chunk_latency", "avg"),
        "ITL p50 ms": _stat(records, "inter_chunk_latency", "p50"),
        "output tok/s": _stat(records, "output_token_throughput", "avg"),
        "E2EL p50 ms": _stat(records, "request_latency", "p50"),
        "output tokens/request": _stat(records, "output_sequence_length", "avg"),
        "duration s": _stat(records, "benchmark_duration", "avg"),
        "completed": _stat(records, "request_count", "avg"),
        "failed": _stat(records, "error_request_count", "avg") or 0,
        "retries": None, "server prompt_n": None,
    }, note="output tokens from usage (--use-server-token-count)")


# ---------------------------------------------------------------------------------------------
# The table


JUDGED = ("TTFT p50 ms", "TPOT p50 ms", "ITL mean ms", "output tok/s")
# Shown, not judged: the clients' rows, then the server's own (Server.shown).
SHOWN = ("ITL p50 ms", "E2EL p50 ms", "output tokens/request", "duration s", "completed", "failed", "retries")


def agrees(ours: float | None, theirs: float | None) -> bool:
    return ours is not None and theirs is not None and ours > 0 and abs(theirs / ours - 1.0) <= TOLERANCE


def server_adjusted(name: str, ours: Figures, theirs: Figures, server: Server) -> float | None:
    """AIPerf / ours for `name`, divided by how much the server itself was slower or faster under
    AIPerf than under ours (its own log's figure for the same thing, Server.view): what remains is
    the two clients' difference in measuring the same work. None where the server logged nothing."""
    a, b = ours.values.get(name), theirs.values.get(name)
    view, sense = server.view[name]
    sa, sb = ours.values.get(view), theirs.values.get(view)
    if not (a and b and sa and sb):
        return None
    return (b / a) / (sb / sa) ** sense


def pooled(first: Figures, second: Figures) -> Figures:
    """One client's two runs as one: each row the mean of the two (None where either lacks it), the
    busiest run's other processes, the walls summed."""
    values = {name: (v + second.values[name]) / 2 if v is not None and second.values.get(name) is not None else None
              for name, v in first.values.items()}
    busy = [f.others_busy_cores for f in (first, second) if f.others_busy_cores is not None]
    return Figures(first.client, values, note=f"{first.note}; the mean of 2 runs",
                   others_busy_cores=max(busy) if busy else None, wall_s=first.wall_s + second.wall_s)


def table(run: Run, ours: Figures, theirs: Figures, server: Server, title: str = "") -> tuple[list[str], bool]:
    """The lines of one concurrency's table, and whether every judged figure agrees."""
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"

    lines = [f"c={run.concurrency}{title}: {run.requests} requests (+{run.warmup} warmup), {run.prompt_tokens} prompt "
             f"tokens, {run.output_tokens} output, ignore_eos, greedy",
             f"  {'metric':<24}{'ours':>12}{'AIPerf':>12}{'ratio':>9}{'/ server':>10}  within 10%?"]
    ok = True
    for name in (*JUDGED, *SHOWN, *server.shown):
        a, b = ours.values.get(name), theirs.values.get(name)
        ratio = f"{b / a:.3f}" if a and b is not None else "-"
        adjusted = server_adjusted(name, ours, theirs, server) if name in JUDGED else None
        verdict = ""
        if name in JUDGED:
            if agrees(a, b):
                verdict = "yes"
            elif adjusted is not None and abs(adjusted - 1.0) <= TOLERANCE:
                verdict = f"yes, {server.differed}"
            else:
                verdict = "NO"
        ok = ok and (verdict != "NO")
        shown = f"{adjusted:.3f}" if adjusted is not None else ""
        lines.append(f"  {name:<24}{fmt(a):>12}{fmt(b):>12}{ratio:>9}{shown:>10}  {verdict}")
    for f in (ours, theirs):
        busy = "?" if f.others_busy_cores is None else f"{f.others_busy_cores:.2f}"
        flag = " *" if f.others_busy_cores is not None and f.others_busy_cores > CONTENDED else ""
        lines.append(f"  {f.client}: {f.note}; {f.wall_s:.0f} s wall; other processes {busy} cores busy{flag}")
    return lines, ok


# ---------------------------------------------------------------------------------------------
# main


def requests_at(concurrency: int, args: argparse.Namespace) -> int:
    """Measured requests at `concurrency`: --requests, else at least 3 waves of `concurrency`
    (--short: max(8, 3 x c); else max(24, 4 x c)), so that the TTFT median falls among the
    successors, never at the edge between them and the first wave (the docstring's "Waves")."""
    if args.requests:
        return args.requests
    return max(8, 3 * concurrency) if args.short else max(24, 4 * concurrency)


def cores() -> tuple[int, int]:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or not shutil.which("taskset"):
        raise CrosscheckError(f"needs 2 cores and taskset (the server on one, each client on the other); "
                              f"allowed cores {allowed}, taskset {shutil.which('taskset')}")
    return allowed[0], allowed[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="the CI form: 8 requests at c=1, 24 at c=8")
    ap.add_argument("--requests", type=int, default=0, help="measured requests per concurrency (default 24 at "
                    "c=1, 4 x c above; --short: 8, 3 x c)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="comma-separated (default 1,8)")
    ap.add_argument("--server", choices=SERVERS, default="llama-server",
                    help="what both clients measure: llama-server (the `make peers` build; default) or this "
                         "engine's OpenAI-compatible HTTP front (python -m engine_service --http-port)")
    ap.add_argument("--server-nice", type=int, default=0, help="the server's niceness (default 0); on a machine "
                    "others share, a negative one (root) keeps their processes off its core")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--cache", type=Path, default=None, help=f"AIPerf's venv and the tokenizer (default {default_cache()})")
    args = ap.parse_args(argv)
    args.concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.concurrencies or min(args.concurrencies) < 1 or max(args.concurrencies) > SLOTS or args.requests < 0:
        ap.error(f"--concurrency: 1..{SLOTS} each; --requests >= 1")
    if args.prompt_tokens < 1 or args.output_tokens < 2:
        ap.error("--prompt-tokens >= 1 and --output-tokens >= 2 (TPOT needs two tokens)")
    work = args.out or Path(tempfile.mkdtemp(prefix="aiperf-crosscheck-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        all_ok, contended = crosscheck(args, work, args.cache or default_cache())
    except (CrosscheckError, FileNotFoundError) as err:  # PeerMissing is a FileNotFoundError
        print(f"error: {err}", file=sys.stderr)
        return 1
    verdict = "all judged figures agree within 10%" if all_ok else "DISAGREEMENT: see the rows marked NO"
    if contended:
        verdict += f" (* other processes kept over {CONTENDED} cores busy: rerun on a quiet machine)"
    print(f"{verdict} ({time.monotonic() - t0:.0f} s)")
    return 0 if all_ok else 1


def crosscheck(args: argparse.Namespace, work: Path, cache: Path) -> tuple[bool, bool]:
    """Each concurrency's table printed as it ends; (every judged figure agrees, any run contended)."""
    server_core, client_core = cores()
    if args.server == "llama-server":
        peers.llama_server()  # PeerMissing before anything is installed
    aiperf, tok_dir = aiperf_env(cache), tokenizer_dir(cache)
    runs = [Run(c, requests_at(c, args), 1, args.prompt_tokens, args.output_tokens) for c in args.concurrencies]
    prompts = make_prompts(tok_dir, max(r.requests for r in runs), args.prompt_tokens)
    ctx = SLOTS * -(-(args.prompt_tokens + args.output_tokens + 16) // 256) * 256
    server = make_server(args.server, server_core, ctx, work, args.server_nice)
    print(f"AIPerf {AIPERF_VERSION} against the bench client, {server.description()}, "
          f"each client on core {client_core}; work dir {work}\n"
          "ratio = AIPerf / ours; judged: TTFT, TPOT (AIPerf's inter_token_latency), ITL mean (its inter_chunk_latency avg), "
          "output tok/s\n", flush=True)
    all_ok, contended = True, False
    with server:
        counts = server.token_counts(prompts)
        if set(counts) != {args.prompt_tokens}:
            log(f"warning: the server makes {sorted(set(counts))} tokens of the prompts, not {args.prompt_tokens}")
        for run in runs:
            base = _fresh(work / f"c{run.concurrency}")
            ours_file, aiperf_file = write_prompt_files(base, prompts[:run.requests], run.output_tokens)
            ours, theirs, ok = compare_at(run, server, aiperf, base, ours_file, aiperf_file, tok_dir, client_core)
            all_ok = all_ok and ok
            contended = contended or any(f.others_busy_cores is not None and f.others_busy_cores > CONTENDED
                                         for f in (ours, theirs))
    return all_ok, contended


def compare_at(run: Run, server: Server, aiperf: Path, base: Path, ours_file: Path, aiperf_file: Path,
               tok_dir: Path, core: int) -> tuple[Figures, Figures, bool]:
    """Ours then AIPerf at one concurrency, the table printed; where it disagrees, a second pair in
    the other order (ABBA) and the means of both judged (the docstring's Drift). (ours, AIPerf, ok)."""
    def measure_ours(attempt: str) -> Figures:
        return timed(f"ours c={run.concurrency}{attempt}", server, run, run_ours,
                     server, run, base / f"ours{attempt}", ours_file, tok_dir, core)

    def measure_aiperf(attempt: str) -> Figures:
        return timed(f"AIPerf c={run.concurrency}{attempt}", server, run, run_aiperf,
                     aiperf, server, run, base / f"aiperf{attempt}", aiperf_file, tok_dir, core)

    ours = measure_ours("")
    theirs = measure_aiperf("")
    lines, ok = table(run, ours, theirs, server)
    print("\n".join(lines) + "\n", flush=True)
    if ok:
        return ours, theirs, ok
    print(f"c={run.concurrency} disagreed: a second pair, AIPerf first, and the means of both pairs judged\n",
          flush=True)
    theirs_2 = measure_aiperf("-2")
    ours_2 = measure_ours("-2")
    lines, _ = table(run, ours_2, theirs_2, server, ", second pair (not judged)")
    print("\n".join(lines) + "\n", flush=True)
    ours, theirs = pooled(ours, ours_2), pooled(theirs, theirs_2)
    lines, ok = table(run, ours, theirs, server, ", the means of both pairs (judged)")
    print("\n".join(lines) + "\n", flush=True)
    return ours, theirs, ok


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=False)
    return path


if __name__ == "__main__":
    sys.exit(main())
