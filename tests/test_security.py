"""TLS, mutual TLS, bearer tokens, and stalled readers."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench_client.server_process import wait_until_serving_blocking
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from tests.certs import make_certs
from tests.contract import decode, expect_error, tokens_of


def tls_credentials(ca, cert=None, key=None) -> grpc.ChannelCredentials:  # type: ignore[no-untyped-def]
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def tls_stub(address: str, ca, cert=None, key=None) -> engine_pb2_grpc.EngineServiceStub:  # type: ignore[no-untyped-def]
    return engine_pb2_grpc.EngineServiceStub(grpc.secure_channel(address, tls_credentials(ca, cert, key)))


def ok(stub) -> bool:  # type: ignore[no-untyped-def]
    return len(tokens_of(decode(stub, timeout=10, prompt_text="tls", max_new_tokens=3, ignore_eos=True))) == 3


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def start_tls(start_engine, certs, mutual: bool):  # type: ignore[no-untyped-def]
    args = ["--model", "tiny", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    if mutual:
        args += ["--tls-client-ca", str(certs.ca)]
    proc = start_engine(*args, wait_serving=False)
    # the test harness polls health in plaintext, which TLS refuses: polled here over TLS (with the
    # client's certificate, which mutual TLS asks for), until the model has loaded
    creds = tls_credentials(certs.ca, certs.client_cert, certs.client_key)

    def serving(timeout: float) -> bool:
        try:
            with grpc.secure_channel(proc.address, creds) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    assert wait_until_serving_blocking(proc.proc, serving, 60.0, poll_s=0.05), "the TLS engine never served"
    return proc


def test_tls_refuses_plaintext_and_serves_tls(start_engine, certs):
    proc = start_tls(start_engine, certs, mutual=False)
    got = expect_error(decode, proc.stub(), timeout=5, prompt_text="x", max_new_tokens=1)
    assert got["code"] == grpc.StatusCode.UNAVAILABLE
    assert ok(tls_stub(proc.address, certs.ca))


def test_mutual_tls_requires_a_client_certificate(start_engine, certs):
    proc = start_tls(start_engine, certs, mutual=True)
    got = expect_error(decode, tls_stub(proc.address, certs.ca), timeout=5, prompt_text="x", max_new_tokens=1)
    assert got["code"] == grpc.StatusCode.UNAVAILABLE
    assert ok(tls_stub(proc.address, certs.ca, certs.client_cert, certs.client_key))


@pytest.mark.parametrize("source", ["file", "env"])
def test_bearer_token(start_engine, tmp_path, source):
    secret = "s3cret-token"
    if source == "file":
        token_file = tmp_path / "token"
        token_file.write_text(secret + "\n")
        proc = start_engine("--model", "tiny", "--auth-token-file", str(token_file))
    else:
        proc = start_engine("--model", "tiny", env={"ENGINE_AUTH_TOKEN": secret})
    assert secret not in " ".join(proc.proc.args)  # never on the command line that ps shows
    stub = proc.stub()
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        got = expect_error(lambda md=metadata: list(stub.Decode(pb.DecodeRequest(prompt_text="x", max_new_tokens=1),
                                                               metadata=md, timeout=5)))
        assert got["code"] == grpc.StatusCode.UNAUTHENTICATED and got["info"].reason == "UNAUTHENTICATED"
        got = expect_error(stub.GetLoad, pb.GetLoadRequest(), metadata=metadata, timeout=5)
        assert got["code"] == grpc.StatusCode.UNAUTHENTICATED and got["info"].reason == "UNAUTHENTICATED"
    good = (("authorization", f"Bearer {secret}"),)
    responses = list(stub.Decode(pb.DecodeRequest(prompt_text="x", max_new_tokens=2, ignore_eos=True), metadata=good,
                                 timeout=10))
    assert len(tokens_of(responses)) == 2
    with proc.channel() as ch:  # health stays open
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    # each refusal is logged, and a refused Decode is a finished request like any rejection
    refused = proc.wait_events("call_unauthenticated", count=4)
    assert sorted((e["method"].rsplit("/", 1)[1], e["credential"]) for e in refused) == [
        ("Decode", "invalid"), ("Decode", "missing"), ("GetLoad", "invalid"), ("GetLoad", "missing")]
    finished = [e for e in proc.events_named("request_finished") if e["status"] == "UNAUTHENTICATED"]
    assert len(finished) == 2 and {e["reason"] for e in finished} == {"UNAUTHENTICATED"}
    assert not any(secret in line for line in proc.raw_lines)


# The reader's stream window: 8 KiB instead of gRPC's 64 KiB, so the stream stalls after about 1,600
# tokens rather than 6,000 (7 s less decoding); the engine's stall detection is the same either way.
READER_WINDOW_BYTES = 8192


def test_stalled_reader_is_aborted_and_its_kv_freed(start_engine):
    proc = start_engine("--model", "tiny", "--max-context", "16384", "--max-new-tokens", "16000", "--stall-seconds", "1")
    channel = grpc.insecure_channel(proc.address, options=[("grpc.http2.bdp_probe", 0),
                                                           ("grpc.http2.lookahead_bytes", READER_WINDOW_BYTES)])
    call = engine_pb2_grpc.EngineServiceStub(channel).Decode(
        pb.DecodeRequest(request_id="stalls", prompt_text="x", max_new_tokens=16000, ignore_eos=True))
    started = time.monotonic()
    next(call)  # then stop reading: once gRPC's flow-control window is full, the stream stalls
    assert proc.wait_events("reader_stalled", "stalls", timeout=40)
    stalled_after = time.monotonic() - started
    # freed within a step or two of the abort, while the generation is still far from its end
    load = proc.wait_load(lambda x: x.running_sequences == 0, timeout=1.0)
    assert (load.running_sequences, load.kv_cache_used_tokens) == (0, 0), f"still running after the stall {stalled_after:.1f} s in"
    got = expect_error(lambda: list(call))
    assert got["code"] == grpc.StatusCode.ABORTED and got["info"].reason == "SEQUENCE_ABORTED"
    assert "reader stalled" in got["info"].metadata["cause"]
    end = proc.wait_events("request_finished", "stalls")[0]
    assert end["output_tokens"] < 12000, end  # about 1,600 fill the 8 KiB flow-control window here
    # the engine serves others normally afterwards
    assert ok(proc.stub())
