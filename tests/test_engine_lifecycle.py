"""Both halves of the recovery policy, drain, and health transitions."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2

from engine.v1 import engine_pb2 as pb
from tests.contract import decode, details, expect_error, tokens_of

PROMPTS = ["first prompt", "second", "the third one is longer", "4th"]


def concurrent_decode(stub, prompts: list[str], max_new: int = 30) -> list[list[int] | dict]:  # type: ignore[no-untyped-def]
    def one(i_p: tuple[int, str]) -> list[int] | dict:
        i, p = i_p
        time.sleep(0.02 * i)  # a fixed admission order: request i is row i
        try:
            return tokens_of(decode(stub, request_id=f"r{i}", prompt_text=p, max_new_tokens=max_new, ignore_eos=True))
        except grpc.RpcError as err:
            return details(err)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, enumerate(prompts)))


def test_sequence_error_aborts_one_request_and_the_others_are_untouched(start_engine):
    # float32: the others' tokens, decoded together, are compared with each decoded alone, and in
    # bfloat16 (what --dtype auto picks on a CPU with native bfloat16) a row may round differently with the batch
    clean = start_engine("--model", "tiny", "--dtype", "float32")
    expected = [tokens_of(decode(clean.stub(), prompt_text=p, max_new_tokens=30, ignore_eos=True)) for p in PROMPTS]
    faulty = start_engine("--model", "tiny", "--dtype", "float32", "--fault", "sequence-error:step=12")
    results = concurrent_decode(faulty.stub(), PROMPTS)
    aborted = [i for i, r in enumerate(results) if isinstance(r, dict)]
    assert len(aborted) == 1
    got = results[aborted[0]]
    assert got["code"] == grpc.StatusCode.ABORTED and got["info"].reason == "SEQUENCE_ABORTED"
    meta = dict(got["info"].metadata)
    assert meta["requestId"] == f"r{aborted[0]}" and int(meta["generatedTokens"]) > 0 and "step 12" in meta["cause"]
    for i, r in enumerate(results):
        if i not in aborted:
            assert r == expected[i]
    assert faulty.health() == health_pb2.HealthCheckResponse.SERVING
    load = faulty.wait_load(lambda x: x.running_sequences == 0)
    assert load.kv_cache_used_tokens == 0
    # and the engine goes on serving
    assert tokens_of(decode(faulty.stub(), prompt_text=PROMPTS[0], max_new_tokens=30, ignore_eos=True)) == expected[0]


def test_an_aborted_sequence_frees_its_row_at_once(start_engine):
    """Aborted at step 3 of a 4000-token generation (seconds of decoding left): its row and KV are
    free by the time the caller reads the abort, not when the generation would have ended."""
    proc = start_engine("--model", "tiny", "--max-context", "4096", "--max-new-tokens", "4000",
                        "--fault", "sequence-error:step=3")
    stub = proc.stub()
    got = expect_error(decode, stub, request_id="aborted", prompt_text="x", max_new_tokens=4000, ignore_eos=True)
    assert got["code"] == grpc.StatusCode.ABORTED and got["info"].metadata["generatedTokens"] == "2"
    load = proc.wait_load(lambda x: x.running_sequences == 0, timeout=0.5)
    assert (load.running_sequences, load.kv_cache_used_tokens) == (0, 0)
    assert tokens_of(decode(stub, prompt_text="next", max_new_tokens=5, ignore_eos=True))


def test_sequence_error_rate_dooms_exactly_the_predicted_requests(start_engine):
    from engine_service.faults import FaultPlan

    plan = FaultPlan.parse(["sequence-error:rate=0.3,seed=7"])
    proc = start_engine("--model", "tiny", "--fault", "sequence-error:rate=0.3,seed=7")
    ids = [f"r{i}" for i in range(20)]
    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(lambda rid: expect_error_or_ok(proc.stub(), rid), ids))
    doomed = {rid for rid in ids if plan.dooms(rid)}
    assert doomed and len(doomed) < len(ids)
    assert {rid for rid, ok in zip(ids, outcomes, strict=True) if not ok} == doomed


def expect_error_or_ok(stub, rid: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        decode(stub, request_id=rid, prompt_text="x", max_new_tokens=8, ignore_eos=True)
        return True
    except grpc.RpcError as err:
        assert details(err)["info"].reason == "SEQUENCE_ABORTED"
        return False


def test_crash_exits_non_zero_and_in_flight_streams_get_unavailable(start_engine):
    proc = start_engine("--model", "tiny", "--max-context", "4096", "--max-new-tokens", "4000",
                        "--fault", "crash:step=50")
    started = time.monotonic()
    stub = proc.stub()
    got = expect_error(decode, stub, prompt_text="doomed", max_new_tokens=4000, ignore_eos=True, timeout=20)
    assert got["code"] == grpc.StatusCode.UNAVAILABLE and "info" not in got
    # Calls that arrive between the crash and the exit, and after it, read the same UNAVAILABLE
    # without details: never ENGINE_DRAINING (this is no drain), never CANCELLED (gRPC's answer
    # to calls caught by a server.stop()).
    late = []
    assert proc.proc is not None
    while proc.proc.poll() is None or len(late) < 3:
        late.append(expect_error(decode, stub, prompt_text="late", max_new_tokens=2, timeout=5))
    assert {(g["code"], g.get("info")) for g in late} == {(grpc.StatusCode.UNAVAILABLE, None)}, late
    code = proc.wait(timeout=10)
    assert code == 70
    assert time.monotonic() - started < 8
    fatal = proc.wait_events("engine_fatal")
    assert fatal and fatal[0]["error_type"] == "RuntimeError" and "injected crash" in str(fatal[0].get("exception"))


def test_drain_finishes_in_flight_rejects_new_and_exits_zero(start_engine):
    proc = start_engine("--model", "tiny", "--max-context", "4096", "--max-new-tokens", "4000", "--grace-seconds", "20")
    stub = proc.stub()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(
        tokens_of(decode(stub, prompt_text="in flight", max_new_tokens=1500, ignore_eos=True))))
    worker.start()
    proc.wait_load(lambda x: x.running_sequences == 1)
    proc.signal(signal.SIGTERM)
    time.sleep(0.2)
    got = expect_error(decode, stub, prompt_text="late", max_new_tokens=4)
    assert got["code"] == grpc.StatusCode.UNAVAILABLE and got["info"].reason == "ENGINE_DRAINING"
    assert got["retry"].retry_delay.ToTimedelta().total_seconds() > 0
    assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    worker.join(30)
    assert result and len(result[0]) == 1500
    assert proc.wait(timeout=20) == 0


def test_drain_past_grace_cuts_streams_with_engine_draining_and_exits_zero(start_engine):
    proc = start_engine("--model", "tiny", "--max-context", "8192", "--max-new-tokens", "8000", "--grace-seconds", "0.5")
    stub = proc.stub()
    call = stub.Decode(pb.DecodeRequest(prompt_text="too long", max_new_tokens=8000, ignore_eos=True))
    next(call)
    proc.signal(signal.SIGTERM)
    signalled = time.monotonic()
    got = expect_error(lambda: list(call))
    cut_after = time.monotonic() - signalled
    assert got["code"] == grpc.StatusCode.UNAVAILABLE and got["info"].reason == "ENGINE_DRAINING"
    assert cut_after < 0.5 + 1.0, f"cut {cut_after:.1f} s after SIGTERM, with a grace period of 0.5 s"
    assert proc.wait(timeout=15) == 0


def test_health_is_not_serving_while_the_model_loads(start_engine):
    proc = start_engine("--model", "small", "--max-batch", "1", "--max-context", "64", wait_serving=False)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status = proc.health("engine.v1.EngineService")
        except grpc.RpcError:
            continue
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]


def test_bad_model_exits_non_zero_before_serving(start_engine):
    proc = start_engine("--model", "/nonexistent/model", wait_serving=False)
    assert proc.wait(timeout=30) == 2
    assert proc.wait_events("engine_start_failed")


def test_bad_flag_exits_2_with_a_message(start_engine):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "engine_service", "--max-batch", "0"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "max_batch must be a positive integer, got 0" in out.stderr
