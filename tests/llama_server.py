"""The real llama-server (llama.cpp, built by `make peers`) for tests: started on 127.0.0.1 on a free
port with the packaged SmolLM2 GGUF, ready once GET /health answers 200 (503 while the model loads),
its output collected to a log file, stopped with SIGTERM then SIGKILL.

    server = require_llama_server()           # the binary, or skip (fail under CI=true)
    with LlamaServer(server, slots=2, ctx=1024, log_path=tmp_path / "llama.log") as srv:
        srv.url                                # "http://127.0.0.1:PORT"

`-c` is the total context: each of the `-np` slots gets ctx / slots tokens (1024 / 2 = 512 here).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench_client import peers
from bench_client.server_process import free_port, guarded, stop_blocking, wait_until_serving_blocking

NOT_BUILT = "llama-server is not built: run `make peers` (about 15-20 minutes on 2 cores)"
# Weight repacking off: with it (the default), this build dies of SIGILL (exit 132) while loading the
# Q4_1 file on these machines, as llama-bench does without `--repack 0` (benchmarks/llamacpp.py).
SERVER_FLAGS = ("--no-repack",)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_llama_server() -> Path:
    """The llama-server binary (bench_client.peers.llama_server()). Missing: the test is skipped, or,
    with CI=true in the environment, failed, since .ci/run builds it before the tests."""
    try:
        return peers.llama_server()
    except peers.PeerMissing as err:
        if in_ci():
            pytest.fail(f"llama-server must be built by .ci/run (`make peers`) before the tests run: {err}",
                        pytrace=False)
        pytest.skip(NOT_BUILT)


def smollm2_gguf() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF file that the engine's `smollm2` serves."""
    from engine_service.model.presets import PACKAGED

    return PACKAGED["smollm2"].locate("smollm2")


class LlamaServerError(RuntimeError):
    """llama-server did not start (or exited); the message has its command and log tail."""


class LlamaServer:
    """One llama-server process; a context manager (start on enter, stop on exit)."""

    def __init__(self, binary: Path | None = None, *, slots: int = 2, ctx: int = 1024, threads: int = 2,
                 model: Path | None = None, extra: tuple[str, ...] = (), log_path: Path | None = None,
                 startup_timeout_s: float = 60.0) -> None:
        self.binary = binary or peers.llama_server()
        self.model = model or smollm2_gguf()
        self.slots, self.ctx, self.threads = slots, ctx, threads
        self.extra = tuple(extra)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def slot_ctx(self) -> int:
        return self.ctx // self.slots

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "-t", str(self.threads), "-np", str(self.slots),
                "-c", str(self.ctx), "--host", "127.0.0.1", "--port", str(self.port), *SERVER_FLAGS, *self.extra]

    def start(self) -> LlamaServer:
        self.port = free_port()
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Guarded: the server gets SIGTERM should this test process die without stopping it.
            self.proc = subprocess.Popen(guarded(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(cmd)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, cmd: list[str]) -> None:
        last = "no answer"

        def healthy(timeout: float) -> bool:
            nonlocal last
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as resp:
                    last = f"HTTP {resp.status}"
                    return resp.status == 200
            except urllib.error.HTTPError as err:  # 503 {"error": {"message": "Loading model", ...}}
                last = f"HTTP {err.code}"
            except OSError as err:  # not listening yet
                last = str(err)
            return False

        assert self.proc is not None
        if wait_until_serving_blocking(self.proc, healthy, self.startup_timeout_s, poll_s=0.05):
            return
        if self.proc.poll() is not None:
            raise LlamaServerError(f"llama-server exited with {self.proc.returncode} before it was ready: "
                                   f"{' '.join(cmd)}\n--- log tail ---\n{self.log_tail()}")
        raise LlamaServerError(f"llama-server not healthy after {self.startup_timeout_s} s (last: {last}): "
                               f"{' '.join(cmd)}\n--- log tail ---\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s; the exit code (None if it never started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        stop_blocking(proc, grace_s)
        return proc.returncode

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
