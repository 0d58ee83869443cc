"""A server subprocess: its port, its start-up wait, its stop. The one set of mechanics under every
launcher of the project: the bench client's managed engine (engine_process.py), the development
engine of the tests and drills (tools/local_engine.py), the drills' restarting supervisor
(drills/supervisor.py), and the llama-servers of the tests and benchmarks.

- `free_port()`: a port free on 127.0.0.1 now, for a server that cannot bind port 0 and report it.
- `guarded(command)`: the command run through bench_client.parent_death, so that the server gets
  SIGTERM should this process die (even by kill -9).
- `wait_until_serving(proc, is_serving, timeout)`: the shared health poll (server_api's
  `poll_until_serving`), giving up at once when the process has exited.
- `stop(proc, grace_s)`: SIGTERM (a drain), then SIGKILL once it outlasts `grace_s`.

Each has a `_blocking` form for synchronous callers; those run the same coroutine in an event loop
of their own on a worker thread, since the caller may itself be inside a running loop (a test's
async body starting an engine).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from bench_client.server_api import poll_until_serving

T = TypeVar("T")

STOP_POLL_S = 0.05  # how often a stopping process is asked whether it has exited


class _Exited(Exception):
    """Raised inside the health poll when the process has exited: there is nothing left to wait for."""


def free_port() -> int:
    """A port free on 127.0.0.1 now (another process may take it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def guarded(command: Sequence[str]) -> list[str]:
    """`command` run through bench_client.parent_death: it gets SIGTERM when this process dies."""
    return [sys.executable, "-m", "bench_client.parent_death", str(os.getpid()), *command]


async def wait_until_serving(proc: subprocess.Popen[Any] | None, is_serving: Callable[[float], Awaitable[bool]],
                             timeout: float, poll_s: float = 0.2) -> bool:
    """Poll `is_serving(per_check_timeout)` until it says yes (True) or `timeout` seconds pass, or
    `proc` (when given) exits (False: the caller reads its returncode)."""

    async def alive_and_serving(check_timeout: float) -> bool:
        if proc is not None and proc.poll() is not None:
            raise _Exited
        return await is_serving(check_timeout)

    try:
        return await poll_until_serving(alive_and_serving, timeout, poll_s)
    except _Exited:
        return False


def wait_until_serving_blocking(proc: subprocess.Popen[Any] | None, is_serving: Callable[[float], bool],
                                timeout: float, poll_s: float = 0.2) -> bool:
    """`wait_until_serving` with a synchronous check, for synchronous callers."""

    async def check(check_timeout: float) -> bool:
        return is_serving(check_timeout)

    return run_blocking(wait_until_serving(proc, check, timeout, poll_s))


async def stop(proc: subprocess.Popen[Any], grace_s: float) -> bool:
    """SIGTERM, then SIGKILL if the process is still running after `grace_s` seconds; whether it had
    to be killed. A process that has exited already is left as it is."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(STOP_POLL_S)
    if proc.poll() is not None:
        return False
    proc.kill()
    proc.wait()
    return True


def stop_blocking(proc: subprocess.Popen[Any], grace_s: float) -> bool:
    """`stop` for synchronous callers."""
    return run_blocking(stop(proc, grace_s))


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end in an event loop of its own on a worker thread; its result."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="server-process") as pool:
        return pool.submit(asyncio.run, coro).result()
