"""The docker compose stack run for real: the image built (`deploy/image.sh`, what `make image` runs),
`docker compose up --scale engine=3` (or `docker-compose`), every replica's health check waited for,
then a paced sweep through `dns:///engine:50051` from the bench service's container. During the
sweep one replica is stopped with SIGTERM (`docker stop`: it drains, exits 0, and `docker start`
brings it back: `restart: unless-stopped` leaves a stopped container stopped) and another is killed
with SIGKILL as a crash kills it (its process, from the host: Docker counts `docker kill` as an
explicit stop, which the restart policy leaves alone) and its restart policy brings it back.
Asserted as the replicas drill asserts on loopback: the sweep completes in one run, every point once,
completed + failed == requests_per_point, only cut streams fail, requests on all three replicas and
on each restarted one again (replicas named by their `engine-replica` header: container host name and
port); and Prometheus in the stack scrapes all three replicas, found by DNS (`up` by instance).
Jaeger and Prometheus images that cannot be pulled are replaced by deploy/compose.offline.yml's
(the drill says which); spans from the engine and the bench client must reach whichever runs.

Every container, network and volume of the run (a project of its own name) is removed at the end,
also on failure; the daemon, if the drill started it, is stopped. Images are kept (the next run
reuses Docker's layer cache). Where no Docker daemon runs or can be started, the drill cannot run.

    python -m drills [--quick] compose         python -m drills.compose --probe (can a daemon run here?)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench_client.server_process import stop_blocking
from drills.common import ROOT, note
from drills.crash import recorded_lines
from drills.grid import Grid
from drills.replicas import audit_rolling_sweep, config_toml, wait_points
from drills.row import Checks, DrillRow
from drills.sweep_audit import read_jsonl

NAME = "compose"
REPLICAS = 3
IMAGE = "llm-decode-engine:local"
TARGET = "dns:///engine:50051"
THREADS = max(1, (os.cpu_count() or 1) // REPLICAS)  # each replica's --threads: the machine's cores shared out
STOP_TIMEOUT_S = 40  # docker-compose.yml's stop_grace_period: the drain's --grace-seconds (30) and some
HEALTHY_TIMEOUT_S = 300.0  # three replicas loading and tracing smollm2 at once on 2 cores: about a minute
SWEEP_TIMEOUT_S = 1200.0
# The images docker-compose.yml names that may not be at hand, and what deploy/compose.offline.yml has instead.
REPLACEABLE = {"jaeger": "deploy/otlp_sink.py on the project's image",
               "prometheus": "Debian's prometheus package on the Debian base"}
OFFLINE = ROOT / "deploy" / "compose.offline.yml"


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return proc


class Daemon:
    """A Docker daemon to talk to: the running one, or one this drill starts (and stops) itself."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None

    def ensure(self) -> str:
        """Returns how the daemon was had; raises RuntimeError saying why none can be had."""
        if shutil.which("docker") is None:
            raise RuntimeError("no Docker: the docker command is not installed (Debian package docker.io)")
        first = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
        if first.returncode == 0:
            return f"Docker {first.stdout.strip()} (running already)"
        dockerd = shutil.which("dockerd")
        if dockerd is None or os.geteuid() != 0:
            raise RuntimeError(f"no Docker daemon: docker info: {first.stderr.strip()[-200:]}; and "
                               + ("dockerd is not installed" if dockerd is None else "not root, cannot start dockerd"))
        self.log = Path(tempfile.mkstemp(prefix="drill-dockerd-", suffix=".log")[1])
        with self.log.open("ab") as log:
            self.process = subprocess.Popen([dockerd], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
            if info.returncode == 0:
                return f"Docker {info.stdout.strip()} (dockerd started by the drill)"
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-400:]
        self.stop()
        raise RuntimeError(f"no Docker daemon: dockerd did not start within 60 s: {tail}")

    def stop(self) -> None:
        if self.process is not None:
            stop_blocking(self.process, 60)
            self.process = None
        if self.log is not None:
            self.log.unlink(missing_ok=True)
            self.log = None


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor `docker-compose` is installed (Debian package docker-compose)")


def image_at_hand(image: str) -> bool:
    """Here already, or pulled now."""
    if docker("image", "inspect", image, check=False).returncode == 0:
        return True
    return docker("pull", "--quiet", image, timeout=300, check=False).returncode == 0


def container_port(entry: str | int | dict) -> str | dict:  # type: ignore[type-arg]
    """A compose `ports` entry published on an ephemeral host port instead (the drill must not collide
    with whatever holds the stack's fixed ports on this host)."""
    if isinstance(entry, dict):
        return {k: v for k, v in entry.items() if k not in ("published", "host_ip")}
    return str(entry).rsplit(":", 1)[-1]


def stack_file(work: Path, compose: list[str]) -> tuple[Path, list[str]]:
    """docker-compose.yml, with deploy/compose.offline.yml's service for each image that cannot be had,
    merged by compose itself into one file; every published port made ephemeral. Returns the file and
    the services replaced."""
    override = yaml.safe_load(OFFLINE.read_text())
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    replaced = [name for name in REPLACEABLE if not image_at_hand(services[name]["image"])]
    files = ["-f", str(ROOT / "docker-compose.yml")]
    if replaced:
        part = work / "offline.yml"
        part.write_text(yaml.safe_dump({"services": {n: override["services"][n] for n in replaced}}))
        files += ["-f", str(part)]
    merged = subprocess.run([*compose, "--project-directory", str(ROOT), *files, "config"], capture_output=True,
                            text=True, timeout=60)
    if merged.returncode != 0:
        raise RuntimeError(f"compose config exited {merged.returncode}: {merged.stderr.strip()[-300:]}")
    config = yaml.safe_load(merged.stdout)
    # torch's default is a thread per core in each replica: three replicas on one small machine then
    # contend (measured on 2 cores: about 1 s per token instead of tens of ms, and 3 minutes to start).
    config["services"]["engine"]["command"] += ["--threads", str(THREADS)]
    for service in config["services"].values():
        if "ports" in service:
            service["ports"] = [container_port(p) for p in service["ports"]]
    path = work / "stack.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, replaced


@dataclass
class Replica:
    container: str  # id
    number: int  # compose's container number
    name: str  # its engine-replica header: host name:port

    def state(self) -> dict:  # type: ignore[type-arg]
        return json.loads(docker("inspect", "--format", "{{json .State}}", self.container).stdout)

    def running(self) -> int:
        """Sequences it is decoding now (engine_batch_size, from its metrics port as published on the host)."""
        host_port = docker("port", self.container, "9464/tcp").stdout.split()[0].rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{host_port}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("engine_batch_size"):
                    return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def wait_running(self, timeout: float) -> bool:
        """Wait until it decodes something (so that a signal lands mid-stream); False when time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running() > 0:
                return True
            time.sleep(0.05)
        return False

    def ip(self) -> str:
        return docker("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                      self.container).stdout.split()[0]


class Stack:
    def __init__(self, compose: list[str], project: str, file: Path) -> None:
        self.base = [*compose, "-p", project, "-f", str(file), "--project-directory", str(ROOT)]
        self.project = project

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return proc

    def replicas(self) -> list[Replica]:
        ids = self.run("ps", "-q", "engine").stdout.split()
        found = []
        for cid in ids:
            number, host = docker("inspect", "--format",
                                  '{{index .Config.Labels "com.docker.compose.container-number"}} {{.Config.Hostname}}',
                                  cid).stdout.split()
            found.append(Replica(cid, int(number), f"{host}:50051"))
        return sorted(found, key=lambda r: r.number)

    def host_port(self, service: str, port: int) -> int:
        return int(self.run("port", service, str(port)).stdout.strip().rsplit(":", 1)[1])

    def down(self) -> list[str]:
        """Remove all the project made; returns what was left after `down -v` (then removed by hand)."""
        try:
            self.run("down", "-v", "--remove-orphans", "--timeout", "5", timeout=300)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            note(NAME, f"compose down failed ({err}); removing the project's resources by label")
        label = f"label=com.docker.compose.project={self.project}"
        left = []
        for kind, listing, remove in (("container", ["ps", "-aq"], ["rm", "-f", "-v"]),
                                      ("network", ["network", "ls", "-q"], ["network", "rm"]),
                                      ("volume", ["volume", "ls", "-q"], ["volume", "rm", "-f"])):
            ids = docker(*listing, "--filter", label, check=False).stdout.split()
            if ids:
                left.append(f"{len(ids)} {kind}(s)")
                docker(*remove, *ids, check=False)
        return left


def wait_healthy(replicas: list[Replica], timeout: float) -> dict[str, str]:
    """Wait until every replica's health check says healthy; returns their last health states."""
    deadline = time.monotonic() + timeout
    while True:
        states = {r.name: r.state().get("Health", {}).get("Status", "none") for r in replicas}
        if all(s == "healthy" for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(2)


def prometheus_up(port: int) -> dict[str, str]:
    """`up` of the engine job by instance, from Prometheus's HTTP API."""
    query = urllib.parse.urlencode({"query": 'up{job="engine"}'})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=10) as answer:
        body = json.load(answer)
    return {r["metric"]["instance"]: r["value"][1] for r in body["data"]["result"]}


def wait_scraped(port: int, instances: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    up: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            up = prometheus_up(port)
        except OSError as err:  # not serving yet (URLError is an OSError)
            up = {"error": str(err)}
        if set(up) == instances and all(v == "1" for v in up.values()):
            break
        time.sleep(2)
    return up


def span_services(stack: Stack, replaced: list[str]) -> dict[str, int]:
    """Spans received by service name: the OTLP sink's running totals (its log), or Jaeger's services."""
    if "jaeger" in replaced:
        totals: dict[str, int] = {}
        for line in stack.run("logs", "--no-color", "jaeger").stdout.splitlines():
            start = line.find("{")
            if start >= 0 and '"otlp_spans"' in line:
                totals = json.loads(line[start:])["totals"]
        return totals
    port = stack.host_port("jaeger", 16686)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/services", timeout=10) as answer:
        return {name: 1 for name in json.load(answer)["data"] or []}  # Jaeger lists services, not counts


def run(quick: bool) -> DrillRow:
    # Points paced at `rate` requests/s: the sweep outlasts the two restarts (a replica loads and traces
    # smollm2 in about a minute, more while the others serve), so the restarted ones serve again.
    grid, rate = ((Grid([64, 128], [2, 4], 16, 40), 1.0) if quick
                  else (Grid([64, 128, 192, 256, 320], [2, 4], 24, 48), 1.5))
    daemon = Daemon()
    how = daemon.ensure()
    try:
        return _run(grid, rate, how)
    finally:
        daemon.stop()


def _run(grid: Grid, rate: float, how: str) -> DrillRow:
    checks = Checks()
    note(NAME, how)
    compose = compose_command()
    started = time.monotonic()
    note(NAME, "deploy/image.sh (make image): its progress lines follow")
    build = subprocess.run([str(ROOT / "deploy" / "image.sh")], cwd=ROOT, env={**os.environ, "IMAGE": IMAGE},
                           stdout=subprocess.DEVNULL, timeout=3600)
    if build.returncode != 0:
        raise RuntimeError(f"deploy/image.sh exited {build.returncode} (its messages are above)")
    build_s = time.monotonic() - started
    size_gb = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout) / 1e9
    note(NAME, f"image {IMAGE} ({size_gb:.2f} GB) ready in {build_s:.0f} s (Docker's layer cache reuses what has "
               "not changed)")
    project = f"drill-compose-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="drill-compose-") as tmp:
        work = Path(tmp)
        shared = work / "shared"  # mounted into the bench container, which runs as the image's user
        shared.mkdir()
        shared.chmod(0o777)
        file, replaced = stack_file(work, compose)
        note(NAME, "replaced: " + (", ".join(f"{n} ({REPLACEABLE[n]})" for n in replaced) or "nothing"))
        stack = Stack(compose, project, file)
        try:
            figures = _drive(stack, grid, rate, shared, replaced, checks)
        finally:
            left = stack.down()
            if os.geteuid() != 0 and (shared / "out").exists():  # written by the image's user: removed by it
                docker("run", "--rm", "-v", f"{shared}:/drill", "--entrypoint", "rm", IMAGE, "-rf", "/drill/out",
                       check=False)
        checks.expect(not left, f"left after compose down -v: {left}")
    lost = figures.pop("lost")
    return checks.row(
        NAME,
        done=f"the image built ({build_s:.0f} s, {size_gb:.2f} GB); docker compose up --scale engine={REPLICAS} "
             f"(replaced: {', '.join(replaced) or 'none'}; --threads {THREADS} each); a sweep of {len(grid.points)} points x "
             f"{grid.requests_per_point} requests through {TARGET} from the bench container; mid-sweep one replica "
             f"stopped with SIGTERM (drains; docker start), another's process killed with SIGKILL (restart policy)",
        expected="the sweep completes in one run; every point once; completed + failed == requests_per_point; "
                 "only cut streams fail; requests on all three replicas and on each restarted one again; Prometheus "
                 "scrapes all three by DNS; spans from engine and bench client arrive; nothing left after down -v",
        lost=lost, figures=figures)


def _drive(stack: Stack, grid: Grid, rate: float, shared: Path, replaced: list[str], checks: Checks
           ) -> dict[str, object]:
    started = time.monotonic()
    stack.run("up", "-d", "--no-build", "--scale", f"engine={REPLICAS}", "engine", "jaeger", "prometheus",
              timeout=600)
    replicas = stack.replicas()
    if len(replicas) != REPLICAS:
        raise RuntimeError(f"compose up started {len(replicas)} engine replicas, expected {REPLICAS}")
    states = wait_healthy(replicas, HEALTHY_TIMEOUT_S)
    if set(states.values()) != {"healthy"}:
        raise RuntimeError(f"replicas not healthy after {HEALTHY_TIMEOUT_S:.0f} s: {states}")
    note(NAME, f"{REPLICAS} replicas healthy in {time.monotonic() - started:.0f} s: {', '.join(states)}")

    (shared / "sweep.toml").write_text(config_toml(grid, TARGET, rate))
    out = shared / "out"
    log = shared / "sweep.log"
    sweep_cmd = [*stack.base, "run", "--rm", "--no-deps", "-T", "-v", f"{shared}:/drill", "bench",
                 "python", "-m", "bench_client", "sweep", "/drill/sweep.toml", "--out", "/drill/out", "--detail"]
    note(NAME, f"sweep of {len(grid.points)} points x {grid.requests_per_point} at {rate:g}/s through {TARGET}")
    with log.open("ab") as err:
        sweep = subprocess.Popen(sweep_cmd, stdout=subprocess.DEVNULL, stderr=err)
    drained, crashed = replicas[0], replicas[1]
    restarted_at: dict[str, float] = {}
    drain_exit = None
    try:
        if checks.expect(wait_points(out, 1, sweep, 600), "the sweep ended or stalled before the SIGTERM"):
            drained.wait_running(10)  # drain with work in flight
            docker("stop", "--time", str(STOP_TIMEOUT_S), drained.container, timeout=STOP_TIMEOUT_S + 30)
            drain_exit = drained.state()["ExitCode"]
            docker("start", drained.container)  # unless-stopped leaves a stopped container stopped
            restarted_at[drained.name] = time.time()
            note(NAME, f"replica {drained.number} ({drained.name}) drained on SIGTERM (exit {drain_exit}); started")
        if checks.expect(wait_points(out, recorded_lines(out) + 1, sweep, 600), "the sweep ended before the SIGKILL"):
            crashed.wait_running(10)  # cut streams
            before = crashed.state()
            os.kill(before["Pid"], signal.SIGKILL)  # a crash: the restart policy's case
            restarted_at[crashed.name] = time.time()
            deadline = time.monotonic() + 60
            while crashed.state()["StartedAt"] == before["StartedAt"] and time.monotonic() < deadline:
                time.sleep(0.2)
            state = crashed.state()
            checks.expect(state["StartedAt"] != before["StartedAt"],
                          f"replica {crashed.number} was not restarted by its restart policy: {state['Status']}")
            note(NAME, f"replica {crashed.number} ({crashed.name}) killed with SIGKILL; restarted by its policy "
                       f"({state['Status']})")
        code = sweep.wait(SWEEP_TIMEOUT_S)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait(30)
    note(NAME, f"sweep exited {code} after {time.monotonic() - started:.0f} s of stack")
    sweep_log = log.read_text(errors="replace")
    records, details = read_jsonl(out / "results.jsonl"), read_jsonl(out / "requests.jsonl")

    names = [r.name for r in replicas]
    audit = audit_rolling_sweep(checks, grid, records, details, names, restarted_at, code, drain_exit, sweep_log)
    problems, failed_by_code, by_replica, after_restart = (audit.problems, audit.failed_by_code, audit.by_replica,
                                                           audit.after_restart)

    states = wait_healthy(replicas, HEALTHY_TIMEOUT_S)
    checks.expect(set(states.values()) == {"healthy"}, f"replicas not healthy after the sweep: {states}")
    instances = {f"{r.ip()}:9464" for r in replicas}
    up = wait_scraped(stack.host_port("prometheus", 9090), instances, 90)
    checks.expect(set(up) == instances and all(v == "1" for v in up.values()),
                  f"Prometheus's up by instance {up}, expected 1 for each of {sorted(instances)}")
    spans = span_services(stack, replaced)
    checks.expect(spans.get("engine", 0) > 0 and spans.get("bench-client", 0) > 0,
                  f"spans from the engine and the bench client: {spans}")
    requests = sum(r["requests"]["sent"] for r in records)
    lost = len(problems)
    return {"lost": lost, "replicas": REPLICAS, "kills": len(restarted_at), "requests": requests,
            "points": len(records), "cut by SIGKILL": sum(failed_by_code.values()),
            "retried on another replica": sum(r["requests"]["retries"] for r in records),
            "requests by replica": "/".join(str(by_replica[n]) for n in names),
            "served after restart": "/".join(str(after_restart.get(n, 0)) for n in names[:2]),
            "prometheus up": sum(v == "1" for v in up.values()),
            "spans": "/".join(f"{k} {v}" for k, v in sorted(spans.items()))}


def outcome(row: DrillRow) -> str:
    """The drill's last line: `compose: 3 replicas, 2 kills, 480 requests, 0 lost`."""
    if "requests" not in row.figures:
        return f"compose: not run ({row.happened})"
    f = row.figures
    return f"compose: {f['replicas']} replicas, {f['kills']} kills, {f['requests']} requests, {row.lost} lost"


def probe() -> int:
    """Exit 0 when a Docker daemon runs here or can be started (then stopped again), else 1, saying why."""
    daemon = Daemon()
    try:
        print(f"compose drill: {daemon.ensure()}")
        return 0
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(f"compose drill cannot run: {err}", file=sys.stderr)
        return 1
    finally:
        daemon.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m drills.compose", description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="only say whether a Docker daemon runs or can start")
    if parser.parse_args().probe:
        sys.exit(probe())
    parser.error("run the drill as `python -m drills [--quick] compose`; this module alone only has --probe")
