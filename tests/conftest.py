from __future__ import annotations

import pytest

from tests.engines import EngineProcess


@pytest.fixture(scope="module")
def engine():
    """A tiny engine shared by a module's tests: max_batch 8, context 256, queue 64."""
    with EngineProcess("--model", "tiny", "--max-batch", "8", "--max-context", "256", "--max-new-tokens", "200",
                       "--queue-capacity", "64") as proc:
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
