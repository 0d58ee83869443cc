"""Drain under load: SIGTERM with a full batch in flight, gRPC streams and an SSE stream of the
HTTP front (--http-port) among them. Within the grace period the streams in flight complete OK (the
HTTP one to its finish_reason, its usage and `data: [DONE]`), new calls get
UNAVAILABLE/ENGINE_DRAINING with RetryInfo (over HTTP 503 ENGINE_DRAINING with Retry-After), health
turns NOT_SERVING (/health 503 "draining") and the process exits 0 in time. Past a short grace
period the streams still running end UNAVAILABLE/ENGINE_DRAINING (the HTTP one in an error frame of
type ENGINE_DRAINING, then `data: [DONE]`) and the process still exits 0."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

from drills import raw_http
from drills.common import CallResult, EngineProcess, collect, note
from drills.raw_http import StreamEnd
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb

NAME = "drain"
GRACE_S = 20.0
SHORT_GRACE_S = 1.0
EXIT_SLACK_S = 4.0  # after the grace period: stop the loop, the server, flush logs


def start_full_batch(engine: EngineProcess, pool: ThreadPoolExecutor, batch: int, max_new: int
                     ) -> tuple[list, Future[StreamEnd]]:  # type: ignore[type-arg]
    """`batch` gRPC streams and one HTTP SSE stream of `max_new` tokens each, all decoding."""
    stub = engine.stub()
    futures = [pool.submit(lambda i=i: collect(stub.Decode(pb.DecodeRequest(
        request_id=f"inflight-{i}", prompt_text=f"in flight {i}", max_new_tokens=max_new, ignore_eos=True),
        timeout=120))) for i in range(batch)]
    http = pool.submit(raw_http.completion_stream, raw_http.http_port(engine), "in flight over HTTP", max_new, 120.0)
    engine.wait_load(lambda x: x.running_sequences == batch + 1, timeout=30)
    return futures, http


def late_http(port: int) -> list[str]:
    """New HTTP requests while draining: what is wrong with each answer (503 ENGINE_DRAINING with
    Retry-After, for a stream as for a whole answer, is right)."""
    wrong = []
    for stream in (False, True, False):
        body = json.dumps({"prompt": "late", "max_tokens": 4, "stream": stream}).encode()
        reply = raw_http.exchange(port, raw_http.request("/v1/completions", body), limit=10)
        try:
            kind = json.loads(reply.body)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            kind = None
        if not (reply.status == 503 and kind == "ENGINE_DRAINING" and int(reply.headers.get("retry-after", "0")) >= 1):
            wrong.append(f"HTTP {reply.short()} Retry-After {reply.headers.get('retry-after')}")
    return wrong


def within_grace(batch: int, checks: Checks) -> tuple[int, dict[str, object]]:
    max_new = 1500
    with EngineProcess("--model", "tiny", "--max-batch", str(batch + 1), "--max-context", "4096", "--max-new-tokens",
                       "4000", "--grace-seconds", f"{GRACE_S:g}", "--http-port", "0") as engine, \
            ThreadPoolExecutor(batch + 1) as pool:
        port = raw_http.http_port(engine)
        futures, http_future = start_full_batch(engine, pool, batch, max_new)
        running = engine.load().running_sequences
        engine.signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.2)
        late = [collect(engine.stub().Decode(pb.DecodeRequest(prompt_text="late", max_new_tokens=4), timeout=10))
                for _ in range(5)]
        health = engine.health()
        http_health = raw_http.exchange(port, raw_http.request("/health", None, method="GET"), limit=10)
        bad_late_http = late_http(port)
        in_flight: list[CallResult] = [f.result(timeout=120) for f in futures]
        http: StreamEnd = http_future.result(timeout=120)
        code = engine.wait(GRACE_S + EXIT_SLACK_S)
        exited_after = time.monotonic() - signalled
    checks.expect(running == batch + 1, f"only {running} of {batch + 1} rows running at SIGTERM")
    bad_late = [a.short() for a in late if not (a.is_("UNAVAILABLE", "ENGINE_DRAINING") and (a.retry_delay or 0) > 0)]
    checks.expect(not bad_late, f"new calls while draining got {bad_late[:3]}")
    checks.expect(not bad_late_http, f"new HTTP requests while draining got {bad_late_http[:2]}")
    checks.expect(health == 2, f"health {health} while draining (NOT_SERVING is 2)")
    checks.expect(http_health.status == 503 and json.loads(http_health.body or b"{}").get("status") == "draining",
                  f"/health while draining: {http_health.short()} (503 draining is due)")
    checks.expect(code == 0 and exited_after <= GRACE_S, f"exit {code} after {exited_after:.1f} s (grace {GRACE_S:g} s)")
    incomplete = [a for a in in_flight if not (a.ok and len(a.tokens) == max_new)]
    http_whole = (http.status == 200 and http.finish == "length" and http.completion_tokens == max_new
                  and http.error is None and http.done and http.complete)
    checks.expect(http_whole, f"the HTTP stream in flight did not complete within the grace: {http.short()}")
    return len(incomplete) + (not http_whole), {
        "in flight completed": f"{batch - len(incomplete)}/{batch} gRPC, {int(http_whole)}/1 HTTP",
        "late calls ENGINE_DRAINING": f"{len(late) - len(bad_late)}/{len(late)} gRPC, "
                                      f"{3 - len(bad_late_http)}/3 HTTP 503",
        "exit": f"{code} after {exited_after:.1f} s"}


def past_grace(batch: int, checks: Checks) -> tuple[int, dict[str, object]]:
    with EngineProcess("--model", "tiny", "--max-batch", str(batch + 1), "--max-context", "8192", "--max-new-tokens",
                       "8000", "--grace-seconds", f"{SHORT_GRACE_S:g}", "--http-port", "0") as engine, \
            ThreadPoolExecutor(batch + 1) as pool:
        futures, http_future = start_full_batch(engine, pool, batch, 8000)
        engine.signal(signal.SIGTERM)
        signalled = time.monotonic()
        cut: list[CallResult] = [f.result(timeout=60) for f in futures]
        http: StreamEnd = http_future.result(timeout=60)
        code = engine.wait(SHORT_GRACE_S + EXIT_SLACK_S + 10)
        exited_after = time.monotonic() - signalled
    wrong = [a.short() for a in cut if not a.is_("UNAVAILABLE", "ENGINE_DRAINING")]
    checks.expect(not wrong, f"streams past the grace period ended {wrong[:3]}")
    # the HTTP stream's end says why: an error frame of type ENGINE_DRAINING, then [DONE], no finish_reason
    http_told = (http.status == 200 and http.error is not None and http.error.get("type") == "ENGINE_DRAINING"
                 and http.error.get("code") == 503 and http.done and http.finish is None and http.complete)
    checks.expect(http_told, f"the HTTP stream past the grace period ended {http.short()}")
    checks.expect(code == 0 and exited_after <= SHORT_GRACE_S + EXIT_SLACK_S,
                  f"exit {code} after {exited_after:.1f} s (grace {SHORT_GRACE_S:g} s + {EXIT_SLACK_S:g} s)")
    return len(wrong) + (not http_told), {"cut ENGINE_DRAINING": f"{batch - len(wrong)}/{batch} gRPC, "
                                                                 f"{int(http_told)}/1 HTTP error frame",
                                          "exit past grace": f"{code} after {exited_after:.1f} s"}


def run(quick: bool) -> DrillRow:
    batch = 4 if quick else 8
    checks = Checks()
    note(NAME, f"SIGTERM at a full batch of {batch}, grace {GRACE_S:g} s")
    lost_in, figures_in = within_grace(batch, checks)
    note(NAME, f"SIGTERM at a full batch of {batch} that outlasts a grace of {SHORT_GRACE_S:g} s")
    lost_past, figures_past = past_grace(batch, checks)
    return checks.row(
        NAME,
        done=f"SIGTERM with a full batch of {batch} gRPC streams and 1 HTTP SSE stream in flight (1500 tokens each, "
             f"grace {GRACE_S:g} s), 5 new gRPC calls and 3 HTTP requests while draining; again with 8000-token "
             f"streams and a grace of {SHORT_GRACE_S:g} s",
        expected="in-flight streams complete OK (HTTP: finish_reason, usage, [DONE]); new calls "
                 "UNAVAILABLE/ENGINE_DRAINING + RetryInfo, HTTP 503 ENGINE_DRAINING + Retry-After; health NOT_SERVING, "
                 "/health 503 draining; exit 0 within the grace; past it the streams end UNAVAILABLE/ENGINE_DRAINING "
                 "(HTTP: an ENGINE_DRAINING error frame, then [DONE]) and exit is still 0",
        lost=lost_in + lost_past,
        figures={**figures_in, **figures_past},
    )
