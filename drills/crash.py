"""Crash and restart, and kill -9 of the client. (a) The engine runs with `--fault crash:step=N`
under a supervisor that restarts it on the same port; the bench client sweeps against it, and
each time the sweep stops (engine down too long) it is resumed once health is SERVING again,
until it completes. (b) The bench client is killed with SIGKILL at random instants and resumed.
Either way the final results.jsonl holds every point of the grid exactly once, with request
counts that add up. (c) An SSE stream of the HTTP front (--http-port) is in flight when the engine
crashes the same way: it must end visibly (an error frame, or a connection cut before `data:
[DONE]`), never as a clean-looking [DONE] over a truncated text, and /health, polled from the
stream's end until the process is gone, never says 200; the process exits 70. Lost = points
missing or duplicated, counts that do not add up, or an HTTP stream that ended as if whole."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_client.server_process import free_port
from drills import raw_http
from drills.common import ROOT, EngineProcess, note
from drills.grid import Grid
from drills.row import Checks, DrillRow
from drills.supervisor import Supervisor
from drills.sweep_audit import lost_points, read_jsonl
from tools.local_engine import wait_serving

NAME = "crash"
KILL_SEED = 6
SWEEP_TIMEOUT_S = 180.0
FATAL_EXIT_CODE = 70
HTTP_CRASH_STEP = 40  # decode steps: some 40 tokens into the stream
HTTP_MAX_NEW = 400


def sweep(config: Path, out: Path, resume: bool, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "bench_client", "sweep", str(config), "--out", str(out)] + (["--resume"] if resume else [])
    with log.open("ab") as err:
        return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.DEVNULL, stderr=err)


def recorded_lines(out: Path) -> int:
    path = out / "results.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def resume_until_done(config: Path, out: Path, log: Path, address: str, first_resume: bool,
                      max_runs: int) -> tuple[int, int]:
    """Run (then resume) the sweep until it exits 0; before each resume wait for health as an
    operator would. Returns (runs, the last exit code)."""
    code, runs = -1, 0
    while runs < max_runs:
        resume = first_resume or runs > 0
        if resume:
            wait_serving(address, 60)
        code = sweep(config, out, resume, log).wait(SWEEP_TIMEOUT_S)
        runs += 1
        if code == 0:
            break
    return runs, code


def engine_crashes(work: Path, quick: bool, checks: Checks) -> tuple[int, dict[str, object]]:
    grid = Grid([8, 16, 32], [1, 2], 16, 4) if quick else Grid([8, 16, 32, 64], [1, 2, 4], 16, 6)
    crash_step = 100 if quick else 150
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = work / "crash.toml"
    config.write_text(grid.toml(address))
    supervisor = Supervisor([sys.executable, "-m", "engine_service", "--model", "tiny", "--threads", "1",
                             "--host", "127.0.0.1", "--port", str(port), "--fault", f"crash:step={crash_step}"],
                            ROOT, work / "engine.log").start()
    try:
        checks.expect(wait_serving(address, 60), "supervised engine never SERVING")
        note(NAME, f"sweep of {len(grid.points)} points against an engine crashing every {crash_step} steps")
        runs, code = resume_until_done(config, work / "out-crash", work / "sweep-crash.log", address, False,
                                       15 if quick else 30)
    finally:
        last_exit = supervisor.stop()
    crashes = sum(1 for c in supervisor.exit_codes if c == 70)
    checks.expect(code == 0, f"sweep did not complete in {runs} runs (last exit {code})")
    checks.expect(crashes >= 1, f"the engine never crashed (exits {supervisor.exit_codes})")
    checks.expect(last_exit == 0, f"the last engine run exited {last_exit} on SIGTERM")
    problems = lost_points(read_jsonl(work / "out-crash" / "results.jsonl"), grid)
    checks.expect(not problems, f"results after crashes: {problems[:3]}")
    return len(problems), {"engine crashes survived": crashes, "sweep runs (crash)": runs,
                           "points (crash)": len(grid.points)}


def client_kills(work: Path, quick: bool, checks: Checks) -> tuple[int, dict[str, object]]:
    # 96 new tokens: a point must outlast the kill's random delay (up to 0.2 s) even on a fast engine,
    # or a kill meant for the last points lands after the sweep has ended
    grid = Grid([8, 16, 24, 32], [1, 2], 96, 4)
    kills = 1 if quick else 5
    rng = random.Random(KILL_SEED)
    lost, resumes, mid_sweep = 0, 0, 0
    with EngineProcess("--model", "tiny") as engine:
        config = work / "kill.toml"
        config.write_text(grid.toml(engine.address))
        for k in range(kills):
            out, log = work / f"out-kill-{k}", work / f"sweep-kill-{k}.log"
            # a random instant: after a random number of recorded points, plus a random delay
            after, delay = rng.randrange(1, len(grid.points) - 1), rng.uniform(0.0, 0.2)
            proc = sweep(config, out, False, log)
            started = time.monotonic()
            while recorded_lines(out) < after and proc.poll() is None and time.monotonic() - started < 60:
                time.sleep(0.01)
            time.sleep(delay)
            proc.kill()  # SIGKILL: no handler runs
            proc.wait(10)
            recorded = recorded_lines(out)
            at = time.monotonic() - started
            mid_sweep += recorded < len(grid.points)
            note(NAME, f"client killed at {at:.2f} s with {recorded} points recorded; resuming")
            runs, code = resume_until_done(config, out, log, engine.address, True, 3)
            resumes += runs
            checks.expect(code == 0, f"kill {k}: resume did not complete (exit {code})")
            problems = lost_points(read_jsonl(out / "results.jsonl"), grid)
            checks.expect(not problems, f"kill {k} at {at:.2f} s: {problems[:3]}")
            lost += len(problems)
    checks.expect(mid_sweep == kills, f"only {mid_sweep} of {kills} kills landed before the sweep ended")
    return lost, {"client kill -9": kills, "kills mid-sweep": mid_sweep, "resumes after kill": resumes}


def http_stream_crash(checks: Checks) -> tuple[int, dict[str, object]]:
    """(c): one greedy SSE stream of HTTP_MAX_NEW tokens, the engine crashing HTTP_CRASH_STEP steps in."""
    with EngineProcess("--model", "tiny", "--http-port", "0", "--fault", f"crash:step={HTTP_CRASH_STEP}") as engine:
        port = raw_http.http_port(engine)
        end = raw_http.completion_stream(port, "crash under me", HTTP_MAX_NEW, limit=30.0)
        healths: list[int | str] = []  # what a load balancer polling /health sees while the process dies
        while engine.proc is not None and engine.proc.poll() is None:
            try:
                healths.append(raw_http.exchange(port, raw_http.request("/health", None, method="GET"), limit=2.0
                                                 ).status or "no answer")
            except OSError as err:  # refused: the port is closed, the process on its way out
                healths.append(type(err).__name__)
            time.sleep(0.02)
        code = engine.wait(10)
    told = end.error is not None and isinstance(end.error.get("code"), int) and end.error["code"] >= 500
    cut = not (end.done and end.complete)
    visible = end.status == 200 and (told or cut) and end.finish is None and end.chunks < HTTP_MAX_NEW
    checks.expect(visible, f"the HTTP stream in flight at the crash ended {end.short()}: an error frame or a cut "
                           f"before [DONE] is due, and no finish_reason")
    checks.expect(200 not in healths, f"/health said 200 after the crash: {healths[:10]}")
    checks.expect(code == FATAL_EXIT_CODE, f"the engine crashed under the HTTP stream exited {code}, not "
                                           f"{FATAL_EXIT_CODE}")
    how = (f"error frame {end.error.get('type')}" if told and end.error else "cut") + \
        (" then [DONE]" if end.done else "")
    return int(not visible), {"HTTP stream at the crash": f"{how} after {end.chunks} chunks",
                              "/health after the crash": ", ".join(sorted({str(h) for h in healths})) or "gone"}


def run(quick: bool) -> DrillRow:
    checks = Checks()
    lost_c, figures_c = http_stream_crash(checks)
    with tempfile.TemporaryDirectory(prefix="drill-crash-") as tmp:
        work = Path(tmp)
        lost_a, figures_a = engine_crashes(work, quick, checks)
        lost_b, figures_b = client_kills(work, quick, checks)
    resumes = int(figures_a["sweep runs (crash)"]) - 1 + int(figures_b["resumes after kill"])  # type: ignore[call-overload]
    return checks.row(
        NAME,
        done=f"(a) sweep against an engine run with --fault crash:step=N under a restarting supervisor (same port), "
             f"resumed after each stop; (b) bench client killed with SIGKILL at {figures_b['client kill -9']} random "
             f"instants (seed {KILL_SEED}), each followed by --resume; (c) an HTTP SSE stream in flight when the "
             f"engine crashes (--fault crash:step={HTTP_CRASH_STEP}), /health polled until the process is gone",
        expected="the sweep completes; results.jsonl holds every point exactly once; completed + failed == "
                 "requests_per_point for each ok/failed point; the HTTP stream ends in an error frame or a cut, "
                 "never a clean [DONE]; /health never 200 after the crash; exit 70",
        lost=lost_a + lost_b + lost_c,
        figures={**figures_a, **figures_b, **figures_c, "resumes tested": resumes},
    )
