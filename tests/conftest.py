from __future__ import annotations

import pytest

from tests.engines import EngineProcess


@pytest.fixture(scope="module")
def engine():
    """A tiny engine shared by a module's tests: max_batch 8, context 256, queue 64."""
    with EngineProcess("--model", "tiny", "--max-batch", "8", "--max-context", "256", "--max-new-tokens", "200",
                       "--queue-capacity", "64") as proc:
        yield proc


@pytest.fixture(scope="session")
def smollm2_float32():
    """SmolLM2 in float32 without int4 copies, shared by the generation-control modules: the same
    greedy tokens whether a prompt came from the prefix cache or not and whatever else is batched
    (bfloat16 rounds differently in each case). max_batch 8, context 512; on every core (--threads 0:
    its modules wait on it while it decodes, 36-37 s against 45-46 with one thread, Xeon of family 6
    model 207)."""
    with EngineProcess("--model", "smollm2", "--dtype", "float32", "--quantize", "none", "--max-batch", "8",
                       "--max-context", "512", "--threads", "0") as proc:
        yield proc


@pytest.fixture
def start_engine():
    """Start engines with given flags; all are killed at the end of the test."""
    started: list[EngineProcess] = []

    def start(*args: str, wait_serving: bool = True, env: dict[str, str] | None = None) -> EngineProcess:
        proc = EngineProcess(*args, env=env)
        started.append(proc)
        return proc.start(wait_serving=wait_serving)

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture(autouse=True)
def _cli_leaves_logging_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process `bench_client.__main__.main(...)` does not configure structlog: its
    cache_logger_on_first_use would freeze every module logger first used in that test against the
    `capture_logs` of later tests (results.py's torn-line warning, first met by an export test).
    The CLI's own logging set-up is tested in subprocesses (test_observability_logs.py)."""
    import bench_client.__main__ as cli

    monkeypatch.setattr(cli, "_configure_logging", lambda: None)
