"""Rolling restart under load: three engines on loopback ports behind one `ipv4:` target, the bench
client sweeping through them (round_robin with client-side health checking). During the sweep one
replica is drained with SIGTERM and restarted on its port, then another is killed with SIGKILL and
restarted. The sweep must complete in one run; every point is recorded exactly once with
completed + failed == requests_per_point; no point is failed or skipped (the few requests cut
mid-stream by the SIGKILL are failed, within max_error_rate, and are the only failures); requests
land on all three replicas, and on each restarted one after its restart.
Lost = points missing or duplicated, or counts that do not add up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench_client.server_process import free_port
from drills.common import ROOT, EngineProcess, note
from drills.crash import recorded_lines
from drills.grid import Grid
from drills.row import Checks, DrillRow
from drills.sweep_audit import audit_completed_sweep, read_jsonl

NAME = "replicas"
REPLICAS = 3
GRACE_S = 10.0
MAX_ERROR_RATE = 0.34  # a SIGKILL cuts the streams in flight on one replica of three: at most about a third
SWEEP_TIMEOUT_S = 240.0
CUT_CODES = {"UNAVAILABLE", "CANCELLED"}  # how a stream cut by its replica's death ends


def start_replica(port: int) -> EngineProcess:
    return EngineProcess("--model", "tiny", "--port", str(port), "--grace-seconds", f"{GRACE_S:g}").start()


def config_toml(grid: Grid, target: str, rate: float) -> str:
    """The crash drill's sweep, paced by `rate` requests/s so that each point lasts
    requests_per_point / rate seconds however fast the engines are: the restarts land mid-sweep."""
    return (grid.toml(target)
            .replace("warmup_requests = 0", f"warmup_requests = 0\nrequest_rate = [{rate}]")
            .replace("health_wait_s = 2.0", "health_wait_s = 30.0")) + f"max_error_rate = {MAX_ERROR_RATE}\n"


def wait_points(out: Path, count: int, sweep: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until `count` points are recorded while the sweep runs; False if it ended or time ran out."""
    deadline = time.monotonic() + timeout
    while recorded_lines(out) < count:
        if sweep.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run(quick: bool) -> DrillRow:
    # paced points of about 3 s (quick) / 4 s: about 18 s / 80 s of sweep around two restarts of ~3 s
    grid, rate = ((Grid([8, 16, 24, 32, 40, 48], [3], 400, 12), 4.0) if quick
                  else (Grid([8, 16, 32, 48, 64, 96, 128, 160, 192, 256], [3, 6], 600, 24), 6.0))
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="drill-replicas-") as tmp:
        work = Path(tmp)
        ports = [free_port() for _ in range(REPLICAS)]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        replicas = [start_replica(p) for p in ports]
        config, out = work / "replicas.toml", work / "out"
        config.write_text(config_toml(grid, "ipv4:" + ",".join(addresses), rate))
        note(NAME, f"sweep of {len(grid.points)} points over {REPLICAS} replicas; SIGTERM then SIGKILL, restarts")
        restarted_at: dict[str, float] = {}
        drain_exit: int | None = None
        with (work / "sweep.log").open("ab") as log:
            sweep = subprocess.Popen(
                [sys.executable, "-m", "bench_client", "sweep", str(config), "--out", str(out), "--detail"],
                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=log)
        try:
            if checks.expect(wait_points(out, 1, sweep, 120), "the sweep ended or stalled before the SIGTERM"):
                replicas[0].wait_load(lambda load: load.running_sequences > 0, timeout=5)  # drain with work
                replicas[0].signal(signal.SIGTERM)
                drain_exit = replicas[0].wait(GRACE_S + 10)
                note(NAME, f"{addresses[0]} drained (exit {drain_exit}); restarting it")
                replicas[0] = start_replica(ports[0])
                restarted_at[addresses[0]] = time.time()
            after_drain = recorded_lines(out)
            if checks.expect(wait_points(out, after_drain + 1, sweep, 120), "the sweep ended before the SIGKILL"):
                replicas[1].wait_load(lambda load: load.running_sequences > 0, timeout=5)  # cut streams
                replicas[1].signal(signal.SIGKILL)
                replicas[1].wait(10)
                note(NAME, f"{addresses[1]} killed with SIGKILL; restarting it")
                replicas[1] = start_replica(ports[1])
                restarted_at[addresses[1]] = time.time()
            code = sweep.wait(SWEEP_TIMEOUT_S)
        finally:
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait(10)
            for replica in replicas:
                replica.kill()
        records, details = read_jsonl(out / "results.jsonl"), read_jsonl(out / "requests.jsonl")
        sweep_log = (work / "sweep.log").read_text(errors="replace")

    audit = audit_rolling_sweep(checks, grid, records, details, addresses, restarted_at, code, drain_exit, sweep_log)
    problems, failed_by_code, by_replica, after_restart = (audit.problems, audit.failed_by_code, audit.by_replica,
                                                           audit.after_restart)
    retries = sum(r["requests"]["retries"] for r in records)
    return checks.row(
        NAME,
        done=f"sweep of {len(grid.points)} points x {grid.requests_per_point} requests over {REPLICAS} tiny engines "
             f"behind one ipv4: target (round_robin + health checking); mid-sweep one replica drained with SIGTERM "
             f"and restarted, another killed with SIGKILL and restarted, on their ports",
        expected="the sweep completes in one run; every point recorded once, none failed or skipped; "
                 "completed + failed == requests_per_point; only streams cut by the SIGKILL fail; "
                 "requests land on all three replicas, and on each restarted one again",
        lost=len(problems),
        figures={"replica restarts": 2, "points (replicas)": len(records),
                 "cut by SIGKILL": sum(failed_by_code.values()), "retried on another replica": retries,
                 "requests by replica": "/".join(str(by_replica[a]) for a in addresses),
                 "served after restart": "/".join(str(after_restart.get(a, 0)) for a in addresses[:2])},
    )


@dataclass(frozen=True)
class SweepAudit:
    problems: list[str]  # points missing or duplicated, counts that do not add up: each a lost result
    failed_by_code: Counter[str]
    by_replica: Counter[str]
    after_restart: dict[str, int]  # requests each restarted replica served after its restart


def audit_rolling_sweep(checks: Checks, grid: Grid, records: list[dict], details: list[dict],  # type: ignore[type-arg]
                        replicas: list[str], restarted_at: dict[str, float], code: int | None,
                        drain_exit: int | None, sweep_log: str) -> SweepAudit:
    """What a sweep through a drained and a killed replica must show, here and under compose
    (drills/compose.py): it exited 0, the drained replica exited 0, every point once and ok, only cut
    streams failed, requests on every replica (`replicas`, as the records name them) and on each
    restarted one after its restart."""
    checks.expect(code == 0, f"the sweep exited {code}: {sweep_log[-300:]}")
    checks.expect(drain_exit == 0, f"the drained replica exited {drain_exit}")
    completed = audit_completed_sweep(checks, records, grid, CUT_CODES)
    by_replica: Counter[str] = Counter()
    for r in records:
        by_replica.update(r["requests"]["by_replica"])
    missing = [a for a in replicas if by_replica[a] == 0]
    checks.expect(not missing, f"no requests landed on {missing} ({dict(by_replica)})")
    after_restart = {a: sum(1 for d in details if d["peer"] == a and d["sent_at"] > t) for a, t in restarted_at.items()}
    checks.expect(len(restarted_at) == 2 and all(after_restart.values()),
                  f"restarted replicas served after their restart: {after_restart}")
    return SweepAudit(completed.problems, completed.failed_by_code, by_replica, after_restart)

