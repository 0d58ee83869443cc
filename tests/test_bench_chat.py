"""`python -m bench_client chat`: a question sent as chat messages, the answer's text streamed to
stdout; against a target or a managed engine; the engine's refusals printed exactly, exit 1. And the
sweep's [preview], which asks the same way before the first point."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import jsonschema
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


def answer_of(proc: EngineProcess, messages: list[dict[str, str]], max_new_tokens: int,
              **fields: object) -> tuple[str, list[pb.DecodeResponse]]:
    """A direct Decode call's text and responses (greedy), with the extra DecodeRequest fields."""
    responses = decode(proc.stub(), chat=chat_prompt(messages), max_new_tokens=max_new_tokens, **fields)
    return "".join(r.text for r in responses), responses


def engine_text(proc: EngineProcess, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """The answer's text as the engine streams it to a direct Decode call (greedy)."""
    return answer_of(proc, messages, max_new_tokens)[0]


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


def stops_in(text: str) -> list[str]:
    """Two characters of `text` each (not at its start, not U+FFFD, not blank at either end) where
    they first occur, nearest its middle first: the text before one is what a --stop of it keeps."""
    def usable(stop: str, at: int) -> bool:
        return stop.isprintable() and "\ufffd" not in stop and stop.strip() == stop and text.index(stop) == at

    middle = len(text) // 2
    starts = sorted(range(1, len(text) - 1), key=lambda i: abs(i - middle))
    return [text[i:i + 2] for i in starts if usable(text[i:i + 2], i)]


def test_a_stop_string_ends_the_answer_before_it(chat_engine) -> None:  # type: ignore[no-untyped-def]
    text = engine_text(chat_engine, [{"role": "user", "content": "hello"}], 24)
    stops = stops_in(text)
    assert stops, f"no two characters of {text!r} make a stop string"
    stop = stops[0]
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "24", f"--stop={stop}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == text[:text.index(stop)] + "\n"
    assert f"(the answer stopped at --stop {stop!r})" in done.stderr
    assert "--max-new-tokens" not in done.stderr
    # Several: the earliest match in the text ends the answer, whichever was listed first.
    later = next((s for s in stops if text.index(s) >= text.index(stop) + len(stop)), None)
    assert later is not None, f"no stop string after {stop!r} in {text!r}"
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "24",
                   f"--stop={later}", f"--stop={stop}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == text[:text.index(stop)] + "\n"
    assert f"(the answer stopped at --stop {stop!r})" in done.stderr


def test_a_stop_string_that_never_appears_changes_nothing(chat_engine) -> None:  # type: ignore[no-untyped-def]
    hello = [{"role": "user", "content": "hello"}]
    text = engine_text(chat_engine, hello, 12)
    assert "Paris" not in text
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "12", "--stop", "Paris")
    assert done.returncode == 0, done.stderr
    assert done.stdout == text + "\n"
    assert "--stop" not in done.stderr and "(the answer stopped at --max-new-tokens 12)" in done.stderr


_REPR = r"'(?:[^'\\]|\\.)*'" + "|" + r'"(?:[^"\\]|\\.)*"'  # a str's repr, in either quotes
_VALUE = r"-?\d+\.\d{4}"
_LOGPROB_LINE = re.compile(rf"\s*({_REPR})\s+({_VALUE})((?:  (?:{_REPR}) {_VALUE})*)")
_ALTERNATIVE = re.compile(rf"  ({_REPR}) ({_VALUE})")


def parse_logprob_line(line: str) -> tuple[str, str, list[tuple[str, str]]] | None:
    """A line of `--logprobs`: the token's text, its log-probability, then the alternatives' (the
    values as printed, 4 decimals); None for any other line."""
    match = _LOGPROB_LINE.fullmatch(line)
    if match is None:
        return None
    top = [(ast.literal_eval(text), value) for text, value in _ALTERNATIVE.findall(match[3])]
    return ast.literal_eval(match[1]), match[2], top


def test_logprobs_print_each_answer_tokens_logprob_and_alternatives_to_stderr(chat_engine) -> None:  # type: ignore[no-untyped-def]
    hello = [{"role": "user", "content": "hello"}]
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "24", "--logprobs", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout == engine_text(chat_engine, hello, 24) + "\n"  # as without --logprobs
    text, responses = answer_of(chat_engine, hello, 24, top_logprobs=2)
    assert done.stdout == text + "\n"
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]  # not log events
    parsed = [parse_logprob_line(line) for line in lines]
    others = [line for line, p in zip(lines, parsed, strict=True) if p is None]
    assert others == ["(the answer stopped at --max-new-tokens 24)"]
    printed = [p for p in parsed if p is not None]
    assert len(printed) == responses[-1].usage.completion_tokens == 24
    assert all(len(top) == 2 for _, _, top in printed)
    expected = [(lp.text, f"{lp.logprob:.4f}", [(t.text, f"{t.logprob:.4f}") for t in lp.top])
                for r in responses for lp in r.logprobs]
    assert printed == expected


def test_a_bad_logprobs_count_is_refused_by_the_engine(chat_engine) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "4", "--logprobs", "21")
    assert done.returncode == 1
    assert "error: INVALID_ARGUMENT INVALID_FIELD: top_logprobs must be 0..20, got 21" in done.stderr
    assert done.stdout == ""


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
                 "required": ["answer"], "additionalProperties": False}


def test_a_json_schema_makes_the_answer_json_that_validates(chat_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    schema_file = tmp_path / "answer.json"
    schema_file.write_text(json.dumps(ANSWER_SCHEMA))
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "80",
                   "--json-schema", str(schema_file))
    assert done.returncode == 0, done.stderr
    # The answer ended because the value was complete, not cut at max_new_tokens.
    assert "--max-new-tokens" not in done.stderr
    text, responses = answer_of(chat_engine, [{"role": "user", "content": "hello"}], 80,
                                response_format=pb.ResponseFormat(json_schema=schema_file.read_text()))
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].usage.completion_tokens < 80
    assert done.stdout == text + "\n"
    jsonschema.validate(json.loads(done.stdout), ANSWER_SCHEMA)


@pytest.mark.parametrize("content", [None, "{not json"], ids=["missing", "not-json"])
def test_a_json_schema_file_that_is_not_json_is_a_usage_error(tmp_path: Path, content: str | None) -> None:
    schema_file = tmp_path / "schema.json"
    if content is not None:
        schema_file.write_text(content)
    # No engine there: contacting it would be UNAVAILABLE, exit 1.
    done = run_cli("chat", QUESTION, "--target", "127.0.0.1:1", "--timeout", "5", "--json-schema", str(schema_file))
    assert done.returncode == 2
    assert f"error: --json-schema {str(schema_file)!r} is not a readable JSON file" in done.stderr
    assert "UNAVAILABLE" not in done.stderr and done.stdout == ""


def test_a_schema_the_compiler_refuses_is_the_engines_invalid_field(chat_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    schema_file = tmp_path / "nope.json"
    schema_file.write_text('{"type": "nope"}')
    done = run_cli("chat", "hello", "--target", chat_engine.address, "--max-new-tokens", "8",
                   "--json-schema", str(schema_file))
    assert done.returncode == 1
    got = expect_error(decode, chat_engine.stub(), max_new_tokens=8, chat=chat_prompt([{"role": "user", "content": "hello"}]),
                       response_format=pb.ResponseFormat(json_schema=schema_file.read_text()))
    assert got["info"].reason == "INVALID_FIELD"
    assert [v.field for v in got["bad_request"].field_violations] == ["response_format.json_schema"]
    assert f"error: INVALID_ARGUMENT INVALID_FIELD: {got['message']}" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("flag", ["--logprobs", "--max-new-tokens"])
def test_a_negative_count_is_a_usage_error(flag: str) -> None:
    # Not a value a DecodeRequest's uint32 can hold; no engine there (contacting it: UNAVAILABLE, exit 1).
    done = run_cli("chat", QUESTION, "--target", "127.0.0.1:1", "--timeout", "5", f"{flag}=-1")
    assert done.returncode == 2
    assert f"argument {flag}: must be 0..4294967295, got -1" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


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
    """The default model, in a managed engine: started, asked greedily, drained. (Slow: the demo
    test asks the same question of the same model through the same managed-engine chat path.)"""
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

