"""Logs: one JSON event per line, `request_id` and the trace's ids on every event about a request
(the decode loop thread's included), stdlib loggers through the same renderer, every event name
documented in docs/events.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from engine.v1 import engine_pb2 as pb
from shared.tracing import inject_metadata
from tests.engines import ROOT

EVENTS_DOC = ROOT / "docs" / "events.md"
# `log.info("name", ...)`, and `level("name", ...)` where the level is chosen at run time
LOG_CALL = re.compile(r"\b(?:log\.(?:debug|info|warning|error|exception|critical)|level)\(\s*\"([^\"]+)\"")


def test_events_about_a_request_carry_its_id_and_the_callers_trace_ids(start_engine):
    """Engine tracing off: the engine's events still name the caller's trace (and its span), so the
    logs of both sides correlate; `sequence_aborted` comes from the decode loop thread."""
    proc = start_engine("--model", "tiny", "--fault", "sequence-error:step=3")
    tracer = TracerProvider().get_tracer("tests")  # a recording client span, exported nowhere
    with tracer.start_as_current_span("client") as span:
        try:
            list(proc.stub().Decode(pb.DecodeRequest(request_id="doomed-1", prompt_text="abc", max_new_tokens=20,
                                                     ignore_eos=True), metadata=inject_metadata(), timeout=30))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.ABORTED
        ctx = span.get_span_context()
    ids = {"trace_id": trace.format_trace_id(ctx.trace_id), "span_id": trace.format_span_id(ctx.span_id)}
    finished = proc.wait_events("request_finished", "doomed-1")
    aborted = proc.wait_events("sequence_aborted")
    assert len(aborted) == 1 and len(finished) == 1
    for event in (aborted[0], finished[0]):
        assert event["request_id"] == "doomed-1"
        assert {k: event[k] for k in ids} == ids
    assert aborted[0]["logger"] == "engine_service.runtime.loop"
    assert finished[0]["status"] == "ABORTED" and finished[0]["reason"] == "SEQUENCE_ABORTED"


def test_without_a_caller_trace_events_carry_the_request_id_and_no_trace_ids(start_engine):
    proc = start_engine("--model", "tiny")
    list(proc.stub().Decode(pb.DecodeRequest(request_id="plain-1", prompt_text="abc", max_new_tokens=3), timeout=30))
    proc.signal()
    assert proc.wait(30) == 0
    finished = proc.wait_events("request_finished", "plain-1")
    assert finished and "trace_id" not in finished[0] and finished[0]["status"] == "OK"
    # every line the engine wrote to stderr is one JSON event with a snake_case name
    for line in proc.raw_lines:
        event = json.loads(line)
        assert re.fullmatch(r"[a-z][a-z0-9_]*", event["event"]) or event.get("logger", "").startswith(
            ("grpc", "asyncio", "opentelemetry")), event


def run_logging(code: str, env: dict[str, str] | None = None) -> list[dict]:
    import os

    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stderr.splitlines()]


def test_stdlib_loggers_come_out_through_the_same_renderer_with_trace_ids():
    events = run_logging(
        "import logging, structlog\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from shared.logging import configure_logging\n"
        "configure_logging('info')\n"
        "with TracerProvider().get_tracer('t').start_as_current_span('s'):\n"
        "    logging.getLogger('grpc._server').warning('from the standard library')\n"
        "    structlog.get_logger().info('inside_a_span')\n"
        "structlog.get_logger().info('outside_a_span')\n")
    stdlib, inside, outside = events
    assert stdlib["event"] == "from the standard library" and stdlib["logger"] == "grpc._server"
    assert stdlib["level"] == "warning" and len(stdlib["trace_id"]) == 32 and len(stdlib["span_id"]) == 16
    assert inside["trace_id"] == stdlib["trace_id"]
    assert "trace_id" not in outside


def test_the_level_comes_from_the_flag_or_the_environment():
    code = ("import structlog\nfrom shared.logging import configure_logging\nconfigure_logging({arg})\n"
            "log = structlog.get_logger()\nlog.debug('d_event')\nlog.info('i_event')\nlog.warning('w_event')\n")
    assert [e["event"] for e in run_logging(code.format(arg=""), {"LOG_LEVEL": "warning"})] == ["w_event"]
    assert [e["event"] for e in run_logging(code.format(arg="'debug'"), {"LOG_LEVEL": "warning"})] == [
        "d_event", "i_event", "w_event"]
    assert [e["event"] for e in run_logging(code.format(arg=""), {"LOG_LEVEL": ""})] != []


def test_the_engines_level_is_its_flag_else_engine_log_level_else_left_to_log_level(monkeypatch):
    # engine_service.cli.main passes the flag to configure_logging, which falls back to LOG_LEVEL
    # when it is None (the test above); the flag's default used to be "info", so LOG_LEVEL alone
    # never reached the engine and README's `LOG_LEVEL=debug` for prefill_step logged nothing
    from engine_service.cli import build_parser

    monkeypatch.delenv("ENGINE_LOG_LEVEL", raising=False)
    assert build_parser().parse_args([]).log_level is None
    assert build_parser().parse_args(["--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("ENGINE_LOG_LEVEL", "warning")
    assert build_parser().parse_args([]).log_level == "warning"
    assert build_parser().parse_args(["--log-level", "debug"]).log_level == "debug"


def test_every_logged_event_is_snake_case_and_documented():
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", EVENTS_DOC.read_text(), flags=re.MULTILINE))
    logged: dict[str, str] = {}
    for package in ("engine_service", "bench_client", "shared"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in LOG_CALL.findall(path.read_text()):
                logged.setdefault(name, str(path.relative_to(ROOT)))
    assert logged, "no log calls found: the pattern no longer matches the code"
    not_snake = {n: p for n, p in logged.items() if not re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", n)}
    assert not not_snake, f"event names must be snake_case: {not_snake}"
    missing = {n: p for n, p in logged.items() if n not in documented}
    assert not missing, f"document these events in docs/events.md: {missing}"


def test_text_is_logged_only_with_log_text(start_engine):
    from engine.v1 import engine_pb2 as pb

    quiet = start_engine("--model", "tiny")
    loud = start_engine("--model", "tiny", "--log-text")
    for proc in (quiet, loud):
        list(proc.stub().Decode(pb.DecodeRequest(request_id="texty", prompt_text="secret prompt", max_new_tokens=3),
                                timeout=10))
    proc_lines = {proc: "".join(proc.raw_lines) for proc in (quiet, loud)}
    assert "secret prompt" not in proc_lines[quiet]
    [event] = loud.wait_events("request_text")
    assert event["request_id"] == "texty" and event["prompt_text"] == "secret prompt"
