"""What an OpenAI-compatible server says about itself, asked over the adapter's connections: whether
it serves (GET /health answers 200; llama-server answers 503 while it loads the model) and what it
is: llama-server's /props and /v1/models (`meta.n_vocab`), vLLM's and SGLang's /v1/models
(`max_model_len`) and /version, TGI's /info; a plain OpenAI server answers /v1/models alone, and so
does this engine's HTTP front (with `max_model_len`; its vocabulary it does not say). The
answers are read by bench_client/openai_json.py's `server_info_from`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from bench_client.openai_errors import NOT_SERVED, client_timeout, from_http_response, transport_failure
from bench_client.openai_json import server_info_from
from bench_client.openai_pool import ConnectionPool
from bench_client.openai_target import HttpTarget
from bench_client.server_api import ServerInfo
from shared.errors import EngineError, EngineUnavailable, QueueFull

INFO_ROUTES = {"props": "/props", "models": "/v1/models", "info": "/info", "version": "/version"}


async def is_serving(pool: ConnectionPool, target: HttpTarget, timeout: float) -> bool:
    """GET /health answers 200; False on any other status and on any connection failure or timeout."""
    with pool.session() as session:
        try:
            async with session.get(target.base_url + "/health", **target.request_options(timeout)) as response:
                await response.read()
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


async def server_info(pool: ConnectionPool, target: HttpTarget, timeout: float, *, model: str | None,
                      vocab_size: int | None) -> ServerInfo:
    """What the server reports on INFO_ROUTES. A route the server does not have is passed over;
    another failure raises its EngineError (a 503 while the model loads: EngineUnavailable, so that
    the sweep waits for health); a server that has none of /props, /v1/models and /info is not an
    OpenAI-compatible one. `model` and `vocab_size` stand in for what it does not report."""
    names = list(INFO_ROUTES)
    answers = await asyncio.gather(*(_get_json(pool, target, INFO_ROUTES[n], timeout) for n in names))
    reported = {name: body for name, body in zip(names, answers, strict=True) if body is not None}
    if "props" not in reported and "models" not in reported and "info" not in reported:
        raise _not_an_openai_server(target.base_url)
    return server_info_from(reported, model=model, vocab_size=vocab_size)


async def _get_json(pool: ConnectionPool, target: HttpTarget, route: str, timeout: float) -> Any:
    url = target.base_url + route
    with pool.session() as session:
        try:
            async with session.get(url, **target.request_options(timeout)) as response:
                body = await response.read()
                if response.status in NOT_SERVED:
                    return None
                if response.status != 200:
                    err = from_http_response(response.status, response.headers, body)
                    if isinstance(err, QueueFull) and response.status == 503:
                        raise _loading(err, url) from None
                    raise err
        except TimeoutError as exc:
            raise client_timeout(url, timeout) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise transport_failure(url, exc) from exc
    try:
        return json.loads(body)
    except ValueError:
        return None  # a page that is not this API's (a proxy's, a UI's)


def _loading(err: EngineError, url: str) -> EngineUnavailable:
    """A 503 before any point (llama-server loading its model): wait for health, as for a server down."""
    down = EngineUnavailable(f"{url}: {err.message}", metadata=err.metadata, retry_delay=err.retry_delay)
    down.http_status = err.http_status
    return down


def _not_an_openai_server(url: str) -> EngineError:
    return from_http_response(404, {}, f"{url} serves none of /props, /v1/models, /info: not an OpenAI-compatible "
                                       "server (or not this API)")
