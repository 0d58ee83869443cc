"""`python -m bench_client chat`: a question sent as chat messages, the answer's text streamed to
stdout; against a target or a managed engine; the engine's refusals printed exactly, exit 1. And the
sweep's [preview], which asks the same way before the first point."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.v1 import engine_pb2 as pb
from tests.bench_helpers import events, managed_engine, run_cli, run_in_process, sweep_raw
from tests.contract import decode, expect_error
from tests.engines import EngineProcess
from tests.test_chat import chat_prompt, write_chat_checkpoint

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Hugging Face checkpoint with a chat template (random weights: its answers are noise)."""
    checkpoint = write_chat_checkpoint(tmp_path_factory.mktemp("chat"))
    with EngineProcess("--model", str(checkpoint), "--max-batch", "2", "--max-context", "256") as proc:
        yield proc


def engine_text(proc: EngineProcess, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """The answer's text as the engine streams it to a direct Decode call (greedy)."""
    responses = decode(proc.stub(), chat=chat_prompt(messages), max_new_tokens=max_new_tokens)
    return "".join(r.text for r in responses)


def test_the_answer_is_streamed_to_stdout_as_the_engine_sends_it(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    expected = engine_text(chat_engine, [{"role": "user", "content": "hello"}], 12)
    assert expected and done.stdout == expected + "\n"


def test_a_system_message_goes_first(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", "jumps over", "--system", "rotary embeddings", "--target", chat_engine.address,
                   "--max-new-tokens", "10")
    assert done.returncode == 0, done.stderr
    messages = [{"role": "system", "content": "rotary embeddings"}, {"role": "user", "content": "jumps over"}]
    assert done.stdout == engine_text(chat_engine, messages, 10) + "\n"
    assert done.stdout != engine_text(chat_engine, messages[1:], 10) + "\n"


def test_a_cut_answer_says_so_on_stderr(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", "the quick brown fox", "--target", chat_engine.address, "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "(the answer stopped at --max-new-tokens 3)" in done.stderr


def test_a_model_without_a_chat_template_is_refused_with_the_servers_reason_and_message(engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", QUESTION, "--target", engine.address, "--max-new-tokens", "16")
    assert done.returncode == 1
    got = expect_error(decode, engine.stub(), max_new_tokens=16,
                       chat=chat_prompt([{"role": "user", "content": QUESTION}]))
    assert got["info"].reason == "INVALID_FIELD"
    assert f"error: INVALID_ARGUMENT INVALID_FIELD: {got['message']}" in done.stderr
    assert done.stdout == ""


def test_a_bad_field_is_refused_by_the_engine_with_its_message(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", QUESTION, "--target", chat_engine.address, "--max-new-tokens", "0")
    assert done.returncode == 1
    assert "error: INVALID_ARGUMENT INVALID_FIELD: max_new_tokens must be" in done.stderr
    assert "got 0" in done.stderr


def test_an_engine_that_is_not_there_is_unavailable(tmp_path: Path) -> None:
    done = run_cli("chat", QUESTION, "--target", "127.0.0.1:1", "--timeout", "5")
    assert done.returncode == 1
    assert "error: UNAVAILABLE" in done.stderr


def test_model_and_target_together_are_a_usage_error(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", QUESTION, "--target", chat_engine.address, "--model", "tiny")
    assert done.returncode == 2
    assert "--model 'tiny'" in done.stderr and "--target" in done.stderr


def test_a_managed_engine_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    done = run_cli("chat", QUESTION, "--model", str(missing))
    assert done.returncode == 1
    assert "was not SERVING" in done.stderr and str(missing) in done.stderr


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france_with_paris() -> None:
    """The default model, in a managed engine: started, asked greedily, drained."""
    done = run_cli("chat", QUESTION, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    exits = [e for e in events(done.stderr) if e["event"] == "engine_exited"]
    assert [(e["engine"], e["how"], e["exit_code"]) for e in exits] == [({"model": "smollm2"}, "drained", 0)]


# -- the sweep's [preview] -------------------------------------------------------------------------
async def test_the_sweep_prints_the_preview_answer_before_its_first_point(chat_engine, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    raw = sweep_raw(chat_engine.address, context_tokens=[8], max_new_tokens=[4])
    raw["preview"] = {"question": "hello", "max_new_tokens": 8}
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end.value == "completed" and len(results.records) == 1
    expected = engine_text(chat_engine, [{"role": "user", "content": "hello"}], 8)
    info = chat_engine.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    out = capsys.readouterr().out  # the sweep's log lines too, in tests
    preview = f"Question to {info.model} ({info.dtype}): hello\nAnswer: {expected}\n\n"
    assert expected and preview in out
    assert out.index(preview) < out.index("point_started")


async def test_a_refused_preview_is_printed_and_the_sweep_goes_on(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    raw = sweep_raw(engine=managed_engine(), context_tokens=[8], max_new_tokens=[4])
    raw["preview"] = {"question": QUESTION}
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end.value == "completed" and [r["status"] for r in results.records] == ["ok"]
    out = capsys.readouterr().out
    assert "Answer: (none: INVALID_ARGUMENT INVALID_FIELD: chat" in out and "chat template" in out

