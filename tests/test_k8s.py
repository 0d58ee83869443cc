"""The Kubernetes manifests (deploy/k8s), checked without a cluster: every manifest against a pinned
Kubernetes version's schemas (kubernetes-validate ships them, strict: unknown fields fail), then what a
schema cannot see: probes on declared ports, the grace period above the engine's drain, selectors that
select the pods, the engine's args as the engine parses them, memory from the measured RSS, the Job's
--resume and its results on the PVC, the image's user and layout. Each check is shown to fail on a
manifest broken on purpose."""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from bench_client.__main__ import _sweep_parser
from bench_client.config import load_config
from engine_service.cli import build_parser, configs_from_args
from tests.engines import ROOT

K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
# The oldest Kubernetes these manifests are for (native gRPC probes are GA from 1.27, Job
# podFailurePolicy beta and on by default from 1.26), and the newest the pinned kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
READINESS_SERVICE = "engine.v1.EngineService"

# README "Performance and memory": SmolLM2 in bfloat16 at --max-batch 8 --max-context 640 with the
# 8,192-token prefix cache full measured RSS 1,030 MiB = runtime + weights + KV cache + prefix cache.
RUNTIME_MIB = 470.0  # Python, torch, gRPC
WEIGHTS_MIB = {"bfloat16": 270.0, "float32": 607.0}  # SmolLM2-135M dequantized, with its mapped file's pages
KIB_PER_TOKEN = {"bfloat16": 22.5, "float32": 45.0}  # keys and values of one token, all layers
# the quantized copies of SmolLM2's projections: 106M layer weights at 0.5 B (int4) or 1 B (int8) plus
# scales, and the 28M-weight head at 1 B (int8 in both)
QUANTIZED_MIB = {"none": 0.0, "int4": 95.0, "int8": 140.0}


def expected_rss_mib(args: argparse.Namespace) -> float:
    """The engine's RSS with its KV cache and prefix cache full. `--dtype auto` is sized for its larger
    choice, float32 (a CPU without native bfloat16), and `--quantize auto` for what it serves on
    smollm2's Q4_1 file, int4 copies."""
    assert args.model == "smollm2", f"memory is derived for smollm2 only, not {args.model!r}"
    dtype = "float32" if args.dtype == "auto" else args.dtype
    quantize = "int4" if args.quantize == "auto" else args.quantize
    tokens = args.max_batch * args.max_context + args.prefix_cache_tokens
    return RUNTIME_MIB + WEIGHTS_MIB[dtype] + QUANTIZED_MIB[quantize] + tokens * KIB_PER_TOKEN[dtype] / 1024


def test_memory_model_reproduces_the_measurement() -> None:
    measured = build_parser().parse_args(["--dtype", "bfloat16", "--quantize", "none", "--max-batch", "8",
                                          "--max-context", "640", "--model", "smollm2"])
    assert abs(expected_rss_mib(measured) - 1030) < 15


# ---- loading ----------------------------------------------------------------------------------------

def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def generated_configmaps(kust: dict) -> list[dict]:
    """The ConfigMaps kustomize's configMapGenerator makes from files (key: the file's name)."""
    maps = []
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (K8S / f).read_text() for f in gen.get("files", [])}
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return maps


def load_manifests() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs + generated_configmaps(kustomization())


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return load_manifests()


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---- the schemas --------------------------------------------------------------------------------------

def test_kustomization_lists_every_manifest() -> None:
    kust = kustomization()
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(on_disk)
    for gen in kust.get("configMapGenerator", []):
        for f in gen["files"]:
            assert (K8S / f).is_file(), f


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_schemas(manifests: list[dict], version: str) -> None:
    kinds = set()
    for doc in manifests:
        # strict: additionalProperties false everywhere; a kind without a schema raises too.
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "PersistentVolumeClaim", "ConfigMap"} <= kinds


def test_the_schema_check_fails_on_a_wrong_manifest(manifests: list[dict]) -> None:
    deployment = copy.deepcopy(one(manifests, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(one(manifests, "Deployment"))
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Deploymnt", "metadata": {"name": "x"}},
                                     K8S_VERSIONS[0], strict=True)


# ---- what a schema cannot see -------------------------------------------------------------------------

def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|K|M|G)?", str(quantity))
    assert m, quantity
    return float(m.group(1)) * (units[m.group(2)] if m.group(2) else 1 / 2**20)


def cores(quantity: str | int) -> float:
    s = str(quantity)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def dockerfile() -> dict:
    text = DOCKERFILE.read_text()
    uid = re.search(r"useradd\b[^\n]*--uid (\d+)", text)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    workdir = re.search(r"^WORKDIR (\S+)$", text, re.M)
    assert uid and cmd and workdir
    return {"uid": int(uid.group(1)), "cmd": yaml.safe_load(cmd.group(1)), "workdir": workdir.group(1)}


def pod_labels(spec_template: dict) -> dict:
    return spec_template["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(container: dict) -> dict:
    """name -> number, and number -> number, of each declared port."""
    ports = {}
    for p in container.get("ports", []):
        ports[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            ports[p["name"]] = p["containerPort"]
    return ports


def probe_port(probe: dict) -> int | str:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return probe[handler]["port"]
    raise AssertionError(f"probe without a network handler: {probe}")


def engine_args(container: dict) -> argparse.Namespace:
    """The engine container's args as `python -m engine_service` parses them (SystemExit if unknown)."""
    command = container.get("command", []) + container.get("args", [])
    return build_parser().parse_args(command[3:])


def security_problems(what: str, pod: dict, uid: int) -> list[str]:
    problems = []
    psc = pod.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True:
        problems.append(f"{what}: runAsNonRoot is not true")
    if psc.get("runAsUser") != uid:
        problems.append(f"{what}: runAsUser {psc.get('runAsUser')} is not the image's user {uid}")
    for c in pod["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{what}/{c['name']}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{what}/{c['name']}: readOnlyRootFilesystem is not true")
        if sc.get("privileged"):
            problems.append(f"{what}/{c['name']}: privileged")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{what}/{c['name']}: capabilities do not drop ALL")
        if sc.get("capabilities", {}).get("add"):
            problems.append(f"{what}/{c['name']}: capabilities added")
        if sc.get("runAsUser", uid) == 0:
            problems.append(f"{what}/{c['name']}: runs as root")
    return problems


def engine_problems(docs: list[dict]) -> list[str]:
    problems = []
    deployment = one(docs, "Deployment", "engine")
    template = deployment["spec"]["template"]
    pod = template["spec"]
    (engine,) = pod["containers"]
    ports = container_ports(engine)
    command = engine.get("command", []) + engine.get("args", [])
    if command[:3] != ["python", "-m", "engine_service"]:
        return [f"engine: its command is not python -m engine_service: {shlex.join(command)}"]
    try:
        args = engine_args(engine)
        configs_from_args(args)
    except SystemExit:
        return ["engine: its args are not valid flags of python -m engine_service"]
    except ValueError as err:
        return [f"engine: {err}"]

    # Ports: the args bind what the container declares; probes hit a declared port.
    if args.host != "0.0.0.0":
        problems.append(f"engine: --host {args.host} is not reachable from other pods")
    if ports.get("grpc") != args.port:
        problems.append(f"engine: container port grpc {ports.get('grpc')} is not --port {args.port}")
    if ports.get("metrics") != args.metrics_port:
        problems.append(f"engine: container port metrics {ports.get('metrics')} is not --metrics-port "
                        f"{args.metrics_port}")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in engine and probe_port(engine[kind]) not in ports:
            problems.append(f"engine: {kind} port {probe_port(engine[kind])} is not a declared container port")
        if kind in engine and engine[kind].get("grpc", {}).get("port") not in (None, args.port):
            problems.append(f"engine: {kind} is not on the gRPC port --port {args.port}")

    # Probes: grpc.health.v1; readiness on the EngineService; liveness never kills a loading or
    # draining engine.
    readiness, liveness, startup = (engine.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe"))
    if not readiness or readiness.get("grpc", {}).get("service") != READINESS_SERVICE:
        problems.append(f"engine: readinessProbe is not gRPC health of {READINESS_SERVICE}")
    if not liveness or "grpc" not in liveness:
        problems.append("engine: livenessProbe is not gRPC health")
    elif liveness["grpc"].get("service", "") not in ("", READINESS_SERVICE):
        problems.append(f"engine: livenessProbe asks an unknown health service {liveness['grpc']['service']!r}")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if liveness:
        budget = liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3)
        if budget <= args.grace_seconds:
            problems.append(f"engine: livenessProbe fails in {budget} s, within the {args.grace_seconds} s drain")
        load_budget = (startup["periodSeconds"] * startup["failureThreshold"] if startup and "grpc" in startup
                       else liveness.get("initialDelaySeconds", 0))
        if load_budget < 120:
            problems.append(f"engine: only {load_budget} s for the model to load before liveness counts "
                            "(a startupProbe or initialDelaySeconds)")

    # The drain: SIGTERM, then --grace-seconds for the streams, then exit, all before the SIGKILL.
    if not grace > args.grace_seconds:
        problems.append(f"engine: terminationGracePeriodSeconds {grace} is not above --grace-seconds "
                        f"{args.grace_seconds}")

    # Resources: derived from the measured RSS; requests = limits; threads = CPU.
    res = engine.get("resources", {})
    req, lim = res.get("requests", {}), res.get("limits", {})
    if "memory" not in req or "memory" not in lim or "cpu" not in req or "cpu" not in lim:
        problems.append("engine: resources lack memory or cpu requests and limits")
    else:
        need = expected_rss_mib(args)
        if mebibytes(req["memory"]) != mebibytes(lim["memory"]):
            problems.append("engine: memory request and limit differ")
        if not 1.1 * need <= mebibytes(lim["memory"]) <= 1.6 * need:
            problems.append(f"engine: memory limit {lim['memory']} is not 1.1-1.6x the expected RSS "
                            f"{need:.0f} MiB")
        if args.threads != cores(lim["cpu"]):
            problems.append(f"engine: --threads {args.threads} is not the CPU limit {lim['cpu']}")

    # Replicas and their disruption budget.
    pdb = one(docs, "PodDisruptionBudget")
    if deployment["spec"].get("replicas", 1) < 2:
        problems.append("engine: fewer than two replicas")
    if not selects(pdb["spec"]["selector"].get("matchLabels", {}), pod_labels(template)):
        problems.append("PodDisruptionBudget: its selector does not select the engine pods")
    if pdb["spec"].get("maxUnavailable", 0) >= deployment["spec"].get("replicas", 1):
        problems.append("PodDisruptionBudget: allows every replica down at once")
    if not selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(template)):
        problems.append("engine: the Deployment's selector does not select its own pods")

    # Services: a headless one on the gRPC port, one for the HTTP front, one for the metrics port, each
    # selecting the engines.
    services = {s["metadata"]["name"]: s for s in docs if s["kind"] == "Service"}
    headless = [s for s in services.values() if s["spec"].get("clusterIP") == "None"]
    if len(headless) != 1:
        problems.append("no headless Service (clusterIP: None) for client-side balancing")
    for s in services.values():
        if not selects(s["spec"].get("selector", {}), pod_labels(template)):
            problems.append(f"Service {s['metadata']['name']}: its selector does not select the engine pods")
        for p in s["spec"]["ports"]:
            if ports.get(p.get("targetPort", p["port"])) is None:
                problems.append(f"Service {s['metadata']['name']}: targetPort {p.get('targetPort')} is not a "
                                "container port")
    if headless and not any(ports.get(p.get("targetPort", p["port"])) == args.port
                            for p in headless[0]["spec"]["ports"]):
        problems.append("the headless Service does not reach the gRPC port")
    scraped = [s for s in services.values() if s["metadata"].get("annotations", {}).get("prometheus.io/scrape")
               == "true"]
    for s in scraped + [template]:
        ann = s["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(args.metrics_port):
            problems.append(f"{s['metadata'].get('name', 'engine pods')}: not annotated for scraping at "
                            f"--metrics-port {args.metrics_port}")
    if not any(ports.get(p.get("targetPort")) == args.metrics_port for s in scraped for p in s["spec"]["ports"]):
        problems.append("no annotated Service on the metrics port")
    if args.http_port is None or not any(ports.get(p.get("targetPort")) == args.http_port
                                         for s in services.values() for p in s["spec"]["ports"]):
        problems.append(f"no Service on the HTTP front's port (--http-port {args.http_port})")
    return problems


def bench_problems(docs: list[dict]) -> list[str]:
    problems = []
    job = one(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (bench,) = pod["containers"]
    command = bench.get("command", []) + bench.get("args", [])
    if command[:3] != ["python", "-m", "bench_client"] or command[3:4] != ["sweep"]:
        return [f"Job: its command is not python -m bench_client sweep: {shlex.join(command)}"]
    try:
        args = _sweep_parser(argparse.ArgumentParser()).parse_args(command[4:])
    except SystemExit:
        return [f"Job: its command does not parse: {shlex.join(command)}"]
    if not args.resume:
        problems.append("Job: the sweep has no --resume, so a rescheduled pod cannot continue")
    if pod.get("restartPolicy") not in ("Never", "OnFailure"):
        problems.append("Job: restartPolicy")
    if job["spec"].get("backoffLimit", 6) < 1:
        problems.append("Job: no retries")

    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in bench.get("volumeMounts", [])}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    on_pvc = [path for path, vol in mounts.items()
              if vol.get("persistentVolumeClaim", {}).get("claimName") in claims
              and (args.out == Path(path) or Path(path) in args.out.parents)]
    if not on_pvc:
        problems.append(f"Job: --out {args.out} is not under the mountPath of a PersistentVolumeClaim of these "
                        "manifests")

    # The sweep's config: mounted from the ConfigMap; it loads, and targets the headless Service.
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    source = [(Path(path), maps[vol["configMap"]["name"]]) for path, vol in mounts.items()
              if "configMap" in vol and vol["configMap"]["name"] in maps]
    config_text = [cm["data"][args.config.name] for path, cm in source
                   if args.config is not None and args.config.parent == path and args.config.name in cm["data"]]
    if not config_text:
        return problems + [f"Job: its config {args.config} is not a file of a mounted ConfigMap"]
    raw = tomllib.loads(config_text[0])
    headless = [s for s in docs if s["kind"] == "Service" and s["spec"].get("clusterIP") == "None"]
    targets = {f"dns:///{s['metadata']['name']}:{p['port']}" for s in headless for p in s["spec"]["ports"]}
    if raw.get("target") not in targets:
        problems.append(f"Job: the sweep's target {raw.get('target')!r} is not the headless Service "
                        f"({', '.join(sorted(targets))})")
    return problems


def image_problems(docs: list[dict]) -> list[str]:
    problems = []
    image = dockerfile()
    compose_image = yaml.safe_load(COMPOSE.read_text())["services"]["engine"]["image"]
    for d in docs:
        if d["kind"] not in ("Deployment", "Job"):
            continue
        what = f"{d['kind']} {d['metadata']['name']}"
        pod = d["spec"]["template"]["spec"]
        problems += security_problems(what, pod, image["uid"])
        for c in pod["containers"]:
            if c["image"].split(":")[0] != compose_image.split(":")[0]:
                problems.append(f"{what}: image {c['image']} is not the project's image {compose_image}")
            command = c.get("command", []) + c.get("args", [])
            if command[:2] != image["cmd"][:2]:
                problems.append(f"{what}: command {command[:2]} does not start as the Dockerfile's CMD "
                                f"{image['cmd'][:2]}")
            module = command[2] if len(command) > 2 else ""
            if not (ROOT / module / "__main__.py").is_file():
                problems.append(f"{what}: python -m {module}: no such package in the image's {image['workdir']}")
            if "resources" not in c or not {"requests", "limits"} <= c["resources"].keys():
                problems.append(f"{what}: no resource requests and limits")
    return problems


def all_problems(docs: list[dict]) -> list[str]:
    return engine_problems(docs) + bench_problems(docs) + image_problems(docs)


def test_the_manifests_have_no_problems(manifests: list[dict]) -> None:
    assert all_problems(manifests) == []


# Each check, shown to fail: a manifest broken one way, and the words of the problem it must report.

def _engine(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def _set_arg(docs: list[dict], name: str, value: str) -> None:
    args = _engine(docs)["args"]
    (i,) = [i for i, a in enumerate(args) if a.startswith(name + "=")]
    args[i] = f"{name}={value}"


def _bench(docs: list[dict]) -> dict:
    return one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    "readiness on the empty service": (
        lambda d: _engine(d)["readinessProbe"]["grpc"].update(service=""), "readinessProbe is not gRPC health"),
    "readiness on another port": (
        lambda d: _engine(d)["readinessProbe"]["grpc"].update(port=50052), "not a declared container port"),
    "liveness over http": (
        lambda d: _engine(d).update(livenessProbe={"httpGet": {"port": 9464, "path": "/"}}),
        "livenessProbe is not gRPC health"),
    "no startupProbe": (lambda d: _engine(d).pop("startupProbe"), "for the model to load"),
    "liveness quicker than the drain": (
        lambda d: _engine(d)["livenessProbe"].update(failureThreshold=1), "within the 30.0 s drain"),
    "grace period equal to the drain": (
        lambda d: one(d, "Deployment")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30),
        "is not above --grace-seconds"),
    "drain longer than the grace period": (lambda d: _set_arg(d, "--grace-seconds", "60"),
                                           "is not above --grace-seconds"),
    "an unknown engine flag": (lambda d: _engine(d)["args"].append("--max-batchh=4"), "not valid flags"),
    "a flag value the engine refuses": (lambda d: _set_arg(d, "--max-batch", "many"), "not valid flags"),
    "metrics port not declared": (lambda d: _set_arg(d, "--metrics-port", "9465"), "--metrics-port 9465"),
    "KV cache doubled, memory not": (lambda d: _set_arg(d, "--max-batch", "32"), "the expected RSS"),
    "prefix cache quadrupled, memory not": (lambda d: _set_arg(d, "--prefix-cache-tokens", "32768"),
                                            "the expected RSS"),
    "memory limit above request": (
        lambda d: _engine(d)["resources"]["limits"].update(memory="2Gi"), "request and limit differ"),
    "threads above the CPU limit": (lambda d: _set_arg(d, "--threads", "8"), "is not the CPU limit"),
    "Service selecting other pods": (
        lambda d: one(d, "Service", "engine-grpc")["spec"]["selector"].update({"app.kubernetes.io/component": "x"}),
        "Service engine-grpc: its selector"),
    "PDB selecting other pods": (
        lambda d: one(d, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/name": "other"}), "PodDisruptionBudget: its selector"),
    "pod labels changed": (
        lambda d: one(d, "Deployment")["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/component"),
        "does not select its own pods"),
    "no headless Service": (lambda d: one(d, "Service", "engine-grpc")["spec"].pop("clusterIP"),
                            "no headless Service"),
    "metrics Service on the gRPC port": (
        lambda d: one(d, "Service", "engine-metrics")["spec"]["ports"][0].update(targetPort="grpc"),
        "no annotated Service on the metrics port"),
    "scrape annotation on the wrong port": (
        lambda d: one(d, "Deployment")["spec"]["template"]["metadata"]["annotations"].update(
            {"prometheus.io/port": "50051"}), "not annotated for scraping"),
    "Job without --resume": (lambda d: _bench(d)["command"].remove("--resume"), "no --resume"),
    "Job writing outside the PVC": (
        lambda d: _bench(d)["command"].__setitem__(_bench(d)["command"].index("--out") + 1, "/tmp/results"),
        "is not under the mountPath"),
    "Job's config not mounted": (
        lambda d: _bench(d)["command"].__setitem__(4, "/etc/other/sweep.toml"), "is not a file of a mounted"),
    "sweep targeting a ClusterIP name": (
        lambda d: one(d, "ConfigMap")["data"].update(
            {"sweep.toml": one(d, "ConfigMap")["data"]["sweep.toml"].replace("dns:///engine-grpc", "dns:///engine")}),
        "is not the headless Service"),
    "root user": (
        lambda d: one(d, "Job")["spec"]["template"]["spec"]["securityContext"].update(runAsUser=0),
        "is not the image's user"),
    "capabilities kept": (lambda d: _engine(d)["securityContext"].pop("capabilities"), "do not drop ALL"),
    "writable root filesystem": (
        lambda d: _bench(d)["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRootFilesystem"),
    "privilege escalation": (
        lambda d: _engine(d)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    "another image": (lambda d: _engine(d).update(image="python:3.11-slim"), "is not the project's image"),
    "a module the image lacks": (lambda d: _engine(d)["command"].__setitem__(2, "engine_serve"),
                                 "no such package"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_a_broken_manifest_is_reported(manifests: list[dict], name: str) -> None:
    breaking, expected = BREAKAGES[name]
    docs = copy.deepcopy(manifests)
    breaking(docs)
    problems = all_problems(docs)
    assert any(expected in p for p in problems), problems


def test_the_sweep_config_loads(tmp_path: Path) -> None:
    """The Job's sweep file is a valid bench_client config (as the Job's pod will load it)."""
    (cm,) = generated_configmaps(kustomization())
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
        config = load_config(tmp_path / name)
        assert config.servers[0].target.startswith("dns:///")
        assert config.policy.health_wait_s >= 60  # the engines may still be loading when the Job starts
