"""Kill -9 against a real llama-server (llama.cpp, built by `make peers`), swept over OpenAI-compatible
HTTP with the server managed by the bench client (`[engine] command`, wrapped in
bench_client.parent_death). (a) The bench client is killed with SIGKILL at seeded random instants of
one sweep (during a point, or while its server loads), each followed by `--resume`, until the sweep
completes; after each kill the client's llama-server must be gone. (b) The llama-server itself is
killed with SIGKILL while requests stream (its /slots shows a sequence decoding); the client restarts
it (`max_restarts`) and the sweep completes in the same run. Only the streams cut by a kill fail
(UNAVAILABLE, no reason: a connection cut mid-answer), within max_error_rate; engines.jsonl records
each crash (exit -9) and the final drain. Either way results.jsonl holds every point exactly once
with completed + failed == requests_per_point. Lost = points missing or duplicated, or counts that do
not add up."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_client import peers
from drills.common import ROOT, note
from drills.crash import recorded_lines
from drills.grid import Grid
from drills.row import Checks, DrillRow
from drills.sweep_audit import audit_completed_sweep, lost_points, read_jsonl

NAME = "http"
KILL_SEED = 7
SLOTS, CTX = 2, 1024  # -np 2 -c 1024: two slots of 512 tokens
# One thread: with two, llama.cpp's threads spin-wait on each other, and on 2 shared cores with any
# other process busy a 48-token answer took 28 s instead of 1.9 s.
THREADS = 1
MAX_ERROR_RATE = 0.5  # a kill cuts at most the SLOTS streams in flight: at most 2 of a point's 4-6 requests
CUT_CODES = {"UNAVAILABLE"}  # how a stream cut by the server's death ends over HTTP (EngineUnavailable)
SWEEP_TIMEOUT_S = 180.0
# points of about 3-6 s on 2 shared cores: the quick sweep takes about 8 s, the full one about 18 s
GRID_QUICK, GRID_FULL = Grid([32], [1, 2], 32, 4), Grid([32, 64], [1, 2], 32, 4)
COMMAND = ["{llama_server}", "-m", "{smollm2_gguf}", "-t", str(THREADS), "-np", str(SLOTS), "-c", str(CTX),
           "--no-repack", "--host", "127.0.0.1", "--port", "{port}"]


def config_toml(grid: Grid, max_restarts: int) -> str:
    return "\n".join([
        'api = "openai"',
        "[workload]",
        f"context_tokens = {grid.context_tokens}",
        f"max_new_tokens = [{grid.max_new_tokens}]",
        f"concurrency = {grid.concurrency}",
        f"requests_per_point = {grid.requests_per_point}",
        "warmup_requests = 0",
        "ignore_eos = true",
        'tokenizer = "smollm2"',  # text prompts of exact lengths, sized by the model's own tokenizer
        "[policy]",
        "health_wait_s = 30.0",
        "request_timeout_s = 60.0",
        f"max_error_rate = {MAX_ERROR_RATE}",
        "[engine]",
        f"command = {json.dumps(COMMAND)}",
        "startup_timeout_s = 60.0",
        "drain_timeout_s = 10.0",
        f"max_restarts = {max_restarts}",
    ]) + "\n"


def sweep(config: Path, out: Path, resume: bool, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "bench_client", "sweep", str(config), "--out", str(out), *extra]
    with log.open("ab") as err:
        return subprocess.Popen(args + (["--resume"] if resume else []), cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=err)


def llama_children(pid: int) -> list[int]:
    """The llama-server processes whose parent is pid (parent_death execs into the server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and cmdline[0].endswith(b"llama-server"):
            found.append(int(entry.name))
    return found


def server_port(pid: int) -> int | None:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return int(args[args.index("--port") + 1]) if "--port" in args else None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    """The pids still alive after waiting up to timeout for all of them to end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def decoding_slots(port: int) -> int:
    """How many of the server's slots are decoding a sequence that has streamed tokens and has more to
    stream (GET /slots), so that a kill now cuts it mid-answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/slots", timeout=2) as resp:
            slots = json.load(resp)
    except (OSError, ValueError):
        return 0
    return sum(1 for s in slots if s.get("is_processing")
               and any(t.get("n_decoded", 0) >= 2 and t.get("n_remain", 0) >= 4 for t in s.get("next_token", [])))


def reap(pids: list[int]) -> None:
    """SIGKILL the drill's own leftovers (a server that outlived its sweep: already a failed check)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def client_kills(work: Path, quick: bool, checks: Checks) -> tuple[int, dict[str, object]]:
    """(a) One sweep killed with SIGKILL at `kills` seeded random instants, resumed after each."""
    grid = GRID_QUICK if quick else GRID_FULL
    kills = 1 if quick else 4
    rng = random.Random(KILL_SEED)
    total = len(grid.points)
    config, out, log = work / "kill.toml", work / "out-kill", work / "sweep-kill.log"
    config.write_text(config_toml(grid, 1))
    note(NAME, f"(a) sweep of {total} points against a managed llama-server, client kill -9 x {kills}")
    mid_sweep, outlived, seen = 0, 0, []
    for k in range(kills):
        before = recorded_lines(out)
        if not checks.expect(before < total, f"kill {k}: the sweep was already complete"):
            break
        # a random instant: once a random number of points (from those already recorded) is recorded
        # and the server is spawned, plus a random delay (the next point, or the server still loading)
        after, delay = rng.randrange(before, total), rng.uniform(0.0, 1.5)
        proc = sweep(config, out, k > 0, log)
        servers: list[int] = []
        started = time.monotonic()
        try:
            while (recorded_lines(out) < after or not servers) and proc.poll() is None \
                    and time.monotonic() - started < 120:
                servers = llama_children(proc.pid) or servers
                time.sleep(0.01)
            time.sleep(delay)
            servers = llama_children(proc.pid) or servers
        finally:
            proc.kill()  # SIGKILL: no handler runs
            proc.wait(10)
        recorded, at = recorded_lines(out), time.monotonic() - started
        mid_sweep += recorded < total
        left = wait_gone(servers)
        outlived += len(left)
        seen += servers
        checks.expect(bool(servers), f"kill {k}: the sweep's llama-server was never seen")
        checks.expect(not left, f"kill {k}: llama-server {left} outlived the killed client")
        reap(left)
        note(NAME, f"client killed at {at:.2f} s (run {k + 1}) with {recorded}/{total} points recorded; "
                   f"its llama-server {'gone' if not left else 'LEFT RUNNING'}; resuming")
    code = sweep(config, out, True, log).wait(SWEEP_TIMEOUT_S)
    checks.expect(code == 0, f"the last resume exited {code}: {log.read_text(errors='replace')[-300:]}")
    checks.expect(mid_sweep == kills, f"only {mid_sweep} of {kills} client kills landed before the sweep ended")
    problems = lost_points(read_jsonl(out / "results.jsonl"), grid)
    checks.expect(not problems, f"results after client kills: {problems[:3]}")
    engines = read_jsonl(out / "engines.jsonl")  # only the completing run lived to record its server's exit
    checks.expect(len(engines) == 1 and engines[0]["how"] == "drained" and engines[0]["exit_code"] == 0,
                  f"engines.jsonl after the resume: {[(e['how'], e['exit_code']) for e in engines]}")
    left = wait_gone([e["pid"] for e in engines] + seen, timeout=5)
    checks.expect(not left, f"llama-server {left} left running after the completed sweep")
    reap(left)
    runs = len({r["run_id"] for r in read_jsonl(out / "results.jsonl")})
    return len(problems), {"client kill -9": kills, "kills mid-sweep": mid_sweep, "resumes tested": kills,
                           "runs that recorded points": runs, "servers outliving a kill": outlived,
                           "points (client kills)": total}


def server_kills(work: Path, quick: bool, checks: Checks) -> tuple[int, dict[str, object]]:
    """(b) The managed llama-server killed with SIGKILL mid-stream, `kills` times; one run must complete."""
    grid = GRID_QUICK if quick else GRID_FULL
    kills = 1 if quick else 2
    total = len(grid.points)
    config, out, log = work / "server.toml", work / "out-server", work / "sweep-server.log"
    config.write_text(config_toml(grid, kills))
    note(NAME, f"(b) sweep of {total} points, its llama-server killed with SIGKILL x {kills} mid-stream")
    killed: list[tuple[int, float, int]] = []  # (pid, when, slots decoding just before)
    seen: list[int] = []
    proc = sweep(config, out, False, log, "--detail")
    recorded_at = -1
    try:
        for k in range(kills):
            # the first kill in the first point, each next one in a later point; each at the start of a
            # point (its first streams), so that requests remain to find the server down and restart it
            need = recorded_at + 1
            deadline = time.monotonic() + 120
            pid, port, streaming = None, None, 0
            while proc.poll() is None and time.monotonic() < deadline:
                servers = [p for p in llama_children(proc.pid) if p not in seen]
                if servers and recorded_lines(out) >= need:
                    pid, port = servers[0], server_port(servers[0])
                    streaming = decoding_slots(port) if port else 0
                    if streaming:
                        break
                time.sleep(0.02)
            if not checks.expect(pid is not None and streaming > 0,
                                 f"server kill {k}: no stream in flight to cut (sweep exit {proc.poll()})"):
                break
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            recorded_at = recorded_lines(out)
            killed.append((pid, time.time(), streaming))
            seen.append(pid)
            note(NAME, f"llama-server {pid} killed with {streaming} streams decoding, {recorded_at}/{total} "
                       "points recorded; the client must restart it")
        code = proc.wait(SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    sweep_log = log.read_text(errors="replace")
    checks.expect(code == 0, f"the sweep exited {code}: {sweep_log[-300:]}")
    records = read_jsonl(out / "results.jsonl")
    completed = audit_completed_sweep(checks, records, grid, CUT_CODES)
    problems = completed.problems
    checks.expect(len({r["run_id"] for r in records}) <= 1, "the sweep took more than one run")
    cut = sum(completed.failed_by_code.values())
    checks.expect(not completed.failed_by_reason,
                  f"failures with a reason, not cut streams: {dict(completed.failed_by_reason)}")
    checks.expect(len(killed) <= cut <= SLOTS * len(killed),
                  f"{cut} requests failed for {len(killed)} kills of a server decoding "
                  f"{[s for _, _, s in killed]} streams")
    details = [d for d in read_jsonl(out / "requests.jsonl") if not d["warmup"]]
    failed = [d for d in details if d["status"] != "ok"]
    not_cut = [d["message"][:120] for d in failed if "connection failed after" not in d["message"]
               or not any(d["sent_at"] < t for _, t, _ in killed)]
    checks.expect(not not_cut, f"failed requests not cut mid-answer by a kill: {not_cut[:2]}")
    after = [sum(1 for d in details if d["status"] == "ok" and d["sent_at"] > t) for _, t, _ in killed]
    checks.expect(all(after), f"requests served after each restart: {after}")
    engines = read_jsonl(out / "engines.jsonl")
    hows = [(e["how"], e["exit_code"]) for e in engines]
    checks.expect(hows == [("crashed", -9)] * len(killed) + [("drained", 0)],
                  f"engines.jsonl: {hows} for {len(killed)} kills")
    checks.expect([e["pid"] for e in engines[:len(killed)]] == [p for p, _, _ in killed],
                  f"crashed pids {[e['pid'] for e in engines]} are not the killed {[p for p, _, _ in killed]}")
    restarts = sweep_log.count('"engine_restarting"')
    checks.expect(restarts == len(killed), f"{restarts} restarts logged for {len(killed)} kills")
    left = wait_gone([e["pid"] for e in engines], timeout=5)
    checks.expect(not left, f"llama-server {left} left running after the sweep")
    reap(left)
    retries = sum(r["requests"]["retries"] for r in records)
    return len(problems), {"llama-server kill -9": len(killed), "server restarts": restarts,
                           "cut by the kills": cut, "retried after restart": retries,
                           "points (server kills)": total}


def run(quick: bool) -> DrillRow:
    try:
        binary = peers.llama_server()
    except peers.PeerMissing as err:
        return DrillRow(NAME, "(could not run)", "-", f"drill could not run: {err}"[:300], 0, False)
    note(NAME, f"llama-server {binary}")
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="drill-http-") as tmp:
        work = Path(tmp)
        lost_a, figures_a = client_kills(work, quick, checks)
        lost_b, figures_b = server_kills(work, quick, checks)
    return checks.row(
        NAME,
        done=f"sweeps over HTTP against a real llama-server (SmolLM2, -np {SLOTS}) that the bench client starts "
             f"and restarts: (a) the client killed with SIGKILL at {figures_a['client kill -9']} random instants "
             f"(seed {KILL_SEED}), each followed by --resume; (b) the llama-server killed with SIGKILL "
             f"{figures_b['llama-server kill -9']}x while requests stream",
        expected="(a) the client's llama-server dies with it, the resumed sweep completes; (b) the client restarts "
                 "the server and the sweep completes in one run, only the cut streams fail (UNAVAILABLE), "
                 "engines.jsonl shows each crash and the restart; results.jsonl holds every point exactly once, "
                 "completed + failed == requests_per_point",
        lost=lost_a + lost_b,
        figures={**figures_a, **figures_b},
    )
