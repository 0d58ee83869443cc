"""The sweep over TLS, mutual TLS and with a bearer token, against real engines; wrong or
missing credentials stop the sweep (resumable) before any point is recorded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench_client.credentials import ChannelSecurity, TlsConfig
from bench_client.rpc import EngineClient
from bench_client.sweep import SweepEnd
from shared.engine_channel import channel_options
from tests.bench_helpers import managed_engine, run_in_process, sweep_raw
from tests.certs import CertSet, make_certs

SECRET = "s3cret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_table(certs: CertSet, *, client_cert: bool = False, **extra: str) -> dict[str, str]:
    table = {"ca_file": str(certs.ca)}
    if client_cert:
        table |= {"cert_file": str(certs.client_cert), "key_file": str(certs.client_key)}
    return table | extra


def secured(target: str, *, tls: dict[str, str] | None = None, auth: dict[str, str] | None = None,
            health_wait_s: float = 30.0) -> dict[str, Any]:
    raw = sweep_raw(target, requests_per_point=3, policy={"health_wait_s": health_wait_s})
    if tls is not None:
        raw["tls"] = tls
    if auth is not None:
        raw["auth"] = auth
    return raw


def wait_serving(target: str, certs: CertSet, client_cert: bool) -> None:
    """tests/engines.py polls health in plaintext; a TLS engine is polled over TLS (health is open)."""
    tls = TlsConfig(ca_pem=certs.ca.read_bytes(),
                    cert_pem=certs.client_cert.read_bytes() if client_cert else None,
                    key_pem=certs.client_key.read_bytes() if client_cert else None)

    async def poll() -> bool:
        client = EngineClient(target, ChannelSecurity(tls=tls))
        try:
            return await client.wait_until_serving(60.0)
        finally:
            await client.close()

    assert asyncio.run(poll()), f"the TLS engine at {target} was not SERVING within 60 s"


def start_tls_engine(start_engine, certs: CertSet, *, mutual: bool, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    args = ["--model", "tiny", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    if mutual:
        args += ["--tls-client-ca", str(certs.ca)]
    engine = start_engine(*args, wait_serving=False, env=env)
    wait_serving(engine.address, certs, client_cert=mutual)
    return engine


async def completes(raw: dict[str, Any], out: Path) -> None:
    result, results = await run_in_process(raw, out)
    assert result.end is SweepEnd.COMPLETED, result.message
    [record] = results.records
    assert record["status"] == "ok" and record["requests"]["completed"] == 3


async def stops(raw: dict[str, Any], out: Path) -> str:
    result, results = await run_in_process(raw, out)
    assert result.end is SweepEnd.STOPPED
    assert results.records == []
    return result.message


def test_a_sweep_over_tls(start_engine, certs: CertSet, tmp_path: Path) -> None:
    engine = start_tls_engine(start_engine, certs, mutual=False)
    asyncio.run(completes(secured(engine.address, tls=tls_table(certs)), tmp_path / "tls"))
    # the name override is what the certificate is checked against: a wrong one fails the handshake
    message = asyncio.run(stops(secured(engine.address, tls=tls_table(certs, server_name="wrong.example"),
                                        health_wait_s=1.0), tmp_path / "wrong-name"))
    assert "was not SERVING" in message
    asyncio.run(completes(secured(engine.address, tls=tls_table(certs, server_name="localhost")),
                          tmp_path / "name"))
    # a plaintext client is refused by a TLS engine
    assert "was not SERVING" in asyncio.run(stops(secured(engine.address, health_wait_s=1.0), tmp_path / "plain"))


def test_a_sweep_over_mutual_tls_with_a_token(start_engine, certs: CertSet, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = start_tls_engine(start_engine, certs, mutual=True, env={"ENGINE_AUTH_TOKEN": SECRET})
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    monkeypatch.setenv("BENCH_TEST_TOKEN", SECRET)
    monkeypatch.setenv("BENCH_TEST_WRONG_TOKEN", "not-the-token")
    with_cert = tls_table(certs, client_cert=True)
    # without a client certificate the handshake fails: the engine never answers
    message = asyncio.run(stops(secured(engine.address, tls=tls_table(certs), auth={"token_file": str(token_file)},
                                        health_wait_s=1.0), tmp_path / "no-cert"))
    assert "was not SERVING" in message
    # with a certificate but no or a wrong token: UNAUTHENTICATED stops the sweep
    for name, auth in (("no-token", None), ("wrong-token", {"token_env": "BENCH_TEST_WRONG_TOKEN"})):
        message = asyncio.run(stops(secured(engine.address, tls=with_cert, auth=auth), tmp_path / name))
        assert "UNAUTHENTICATED" in message and "not-the-token" not in message
    asyncio.run(completes(secured(engine.address, tls=with_cert, auth={"token_file": str(token_file)}),
                          tmp_path / "token-file"))
    asyncio.run(completes(secured(engine.address, tls=with_cert, auth={"token_env": "BENCH_TEST_TOKEN"}),
                          tmp_path / "token-env"))


def test_a_token_over_plaintext_and_a_dns_target(start_engine, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`dns:///localhost:PORT` is accepted and resolved by gRPC's resolver (round_robin over what it
    returns; here one engine)."""
    engine = start_engine("--model", "tiny", env={"ENGINE_AUTH_TOKEN": SECRET})
    monkeypatch.setenv("BENCH_TEST_TOKEN", SECRET)
    asyncio.run(completes(secured(f"dns:///localhost:{engine.port}", auth={"token_env": "BENCH_TEST_TOKEN"}),
                          tmp_path / "dns"))
    service_config = json.loads(dict(channel_options())["grpc.service_config"])
    assert service_config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert service_config["healthCheckConfig"] == {"serviceName": "engine.v1.EngineService"}


def test_a_managed_engine_over_mutual_tls(certs: CertSet, tmp_path: Path) -> None:
    """The client starts the engine with TLS flags and polls its health over TLS itself."""
    flags = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca",
             str(certs.ca)]
    raw = sweep_raw(requests_per_point=3, engine=managed_engine(*flags))
    raw["tls"] = tls_table(certs, client_cert=True)
    asyncio.run(completes(raw, tmp_path / "managed"))
