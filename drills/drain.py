"""Drain under load: SIGTERM with a full batch in flight. Within the grace period the streams in
flight complete OK, new calls get UNAVAILABLE/ENGINE_DRAINING with RetryInfo, health turns
NOT_SERVING and the process exits 0 in time. Past a short grace period the streams still running
end UNAVAILABLE/ENGINE_DRAINING and the process still exits 0."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

from drills.common import CallResult, EngineProcess, collect, note
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb

NAME = "drain"
GRACE_S = 20.0
SHORT_GRACE_S = 1.0
EXIT_SLACK_S = 4.0  # after the grace period: stop the loop, the server, flush logs


def start_full_batch(engine: EngineProcess, pool: ThreadPoolExecutor, batch: int, max_new: int) -> list:  # type: ignore[type-arg]
    stub = engine.stub()
    futures = [pool.submit(lambda i=i: collect(stub.Decode(pb.DecodeRequest(
        request_id=f"inflight-{i}", prompt_text=f"in flight {i}", max_new_tokens=max_new, ignore_eos=True),
        timeout=120))) for i in range(batch)]
    engine.wait_load(lambda x: x.running_sequences == batch, timeout=30)
    return futures


def within_grace(batch: int, checks: Checks) -> tuple[int, dict[str, object]]:
    max_new = 1500
    with EngineProcess("--model", "tiny", "--max-batch", str(batch), "--max-context", "4096", "--max-new-tokens",
                       "4000", "--grace-seconds", f"{GRACE_S:g}") as engine, ThreadPoolExecutor(batch) as pool:
        futures = start_full_batch(engine, pool, batch, max_new)
        running = engine.load().running_sequences
        engine.signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.2)
        late = [collect(engine.stub().Decode(pb.DecodeRequest(prompt_text="late", max_new_tokens=4), timeout=10))
                for _ in range(5)]
        health = engine.health()
        in_flight: list[CallResult] = [f.result(timeout=120) for f in futures]
        code = engine.wait(GRACE_S + EXIT_SLACK_S)
        exited_after = time.monotonic() - signalled
    checks.expect(running == batch, f"only {running} of {batch} rows running at SIGTERM")
    bad_late = [a.short() for a in late if not (a.is_("UNAVAILABLE", "ENGINE_DRAINING") and (a.retry_delay or 0) > 0)]
    checks.expect(not bad_late, f"new calls while draining got {bad_late[:3]}")
    checks.expect(health == 2, f"health {health} while draining (NOT_SERVING is 2)")
    checks.expect(code == 0 and exited_after <= GRACE_S, f"exit {code} after {exited_after:.1f} s (grace {GRACE_S:g} s)")
    incomplete = [a for a in in_flight if not (a.ok and len(a.tokens) == max_new)]
    return len(incomplete), {"in flight completed": f"{batch - len(incomplete)}/{batch}",
                             "late calls ENGINE_DRAINING": f"{len(late) - len(bad_late)}/{len(late)}",
                             "exit": f"{code} after {exited_after:.1f} s"}


def past_grace(batch: int, checks: Checks) -> tuple[int, dict[str, object]]:
    with EngineProcess("--model", "tiny", "--max-batch", str(batch), "--max-context", "8192", "--max-new-tokens",
                       "8000", "--grace-seconds", f"{SHORT_GRACE_S:g}") as engine, ThreadPoolExecutor(batch) as pool:
        futures = start_full_batch(engine, pool, batch, 8000)
        engine.signal(signal.SIGTERM)
        signalled = time.monotonic()
        cut: list[CallResult] = [f.result(timeout=60) for f in futures]
        code = engine.wait(SHORT_GRACE_S + EXIT_SLACK_S + 10)
        exited_after = time.monotonic() - signalled
    wrong = [a.short() for a in cut if not a.is_("UNAVAILABLE", "ENGINE_DRAINING")]
    checks.expect(not wrong, f"streams past the grace period ended {wrong[:3]}")
    checks.expect(code == 0 and exited_after <= SHORT_GRACE_S + EXIT_SLACK_S,
                  f"exit {code} after {exited_after:.1f} s (grace {SHORT_GRACE_S:g} s + {EXIT_SLACK_S:g} s)")
    return len(wrong), {"cut ENGINE_DRAINING": f"{batch - len(wrong)}/{batch}",
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
        done=f"SIGTERM with a full batch of {batch} in flight (1500 tokens each, grace {GRACE_S:g} s), 5 new calls "
             f"while draining; again with 8000-token streams and a grace of {SHORT_GRACE_S:g} s",
        expected="in-flight streams complete OK; new calls UNAVAILABLE/ENGINE_DRAINING + RetryInfo; health NOT_SERVING; "
                 "exit 0 within the grace; past it the streams end UNAVAILABLE/ENGINE_DRAINING and exit is still 0",
        lost=lost_in + lost_past,
        figures={**figures_in, **figures_past},
    )
