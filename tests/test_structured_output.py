"""Structured output over gRPC on SmolLM2 (DecodeRequest.response_format): the 20 JSON schemas of
test_constraint.py, greedy and sampled, and its regexes, all in flight at once beside requests
without a constraint. Every answer ends STOP, parses with json.loads and validates with the
jsonschema package (or fullmatches its regex); the unconstrained requests get what they get alone."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest

from engine.v1 import engine_pb2 as pb
from tests.engines import EngineProcess
from tests.test_constraint import REGEXES, SCHEMAS

MAX_NEW = 80
# Schemas whose every prefix can go on for ever (a JSON number's fraction digits): a small model may
# never end one (as in any engine: the constraint keeps the text valid, not short). Checked as valid
# so far, over UNBOUNDED_NEW tokens: SmolLM2 writes 1.000... to the end, however many it is given.
UNBOUNDED = [{"type": "number", "minimum": 0, "maximum": 1}]
UNBOUNDED_NEW = 24
FREE_PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def smollm2(smollm2_float32):  # type: ignore[no-untyped-def]
    """The session's SmolLM2 engine in float32 (conftest.py): exact greedy tokens however batched."""
    return smollm2_float32


def ask(proc: EngineProcess, fmt: pb.ResponseFormat | None, what: str, seed: int | None,
        max_new: int = MAX_NEW) -> list[pb.DecodeResponse]:
    messages = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=f"Reply with {what} only.")])
    sampling = pb.SamplingParams(temperature=1.0, top_p=0.95, seed=seed) if seed is not None else None
    return list(proc.stub().Decode(pb.DecodeRequest(chat=messages, max_new_tokens=max_new, sampling=sampling,
                                                    response_format=fmt), timeout=300))


def describe(kind: str, source: object) -> str:
    """What the prompt asks for: as users do, the schema or pattern itself (the constraint holds
    whatever the prompt says; the prompt only helps a small model end its answer early)."""
    return f"JSON that matches this JSON Schema: {json.dumps(source)}" if kind == "schema" \
        else f"text that matches the regular expression {source}"


def free(proc: EngineProcess) -> list[int]:
    responses = proc.stub().Decode(pb.DecodeRequest(prompt_text=FREE_PROMPT, max_new_tokens=24, ignore_eos=True),
                                   timeout=300)
    return [t for r in responses for t in r.token_ids]


def test_every_answer_matches_its_schema_or_regex_greedy_and_sampled_beside_free_requests(smollm2) -> None:  # type: ignore[no-untyped-def]
    alone = free(smollm2)
    # every schema and regex greedy; every other one sampled too (test_constraint.py samples all of
    # them, three seeds each, through the same masks on random logits)
    jobs = [(pb.ResponseFormat(json_schema=json.dumps(s)), ("schema", s), seed)
            for i, s in enumerate(SCHEMAS) for seed in ((None, 7) if i % 2 == 0 else (None,))]
    jobs += [(pb.ResponseFormat(regex=r), ("regex", r), seed)
             for i, r in enumerate(REGEXES) for seed in ((None, 7) if i % 2 == 0 else (None,))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, smollm2) for _ in range(3)]
        answers = list(pool.map(lambda job: (job, ask(smollm2, job[0], describe(*job[1]), job[2],
                                                      UNBOUNDED_NEW if job[1][1] in UNBOUNDED else MAX_NEW)), jobs))
        assert all(f.result() == alone for f in frees)  # batched beside constrained rows: unchanged
    for (_, (kind, source), seed), responses in answers:
        text = "".join(r.text for r in responses)
        last = responses[-1]
        if source in UNBOUNDED:  # a number's fraction has no end: SmolLM2 writes 1.000... to max_new_tokens
            assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
            assert last.usage.completion_tokens <= UNBOUNDED_NEW
            assert re.fullmatch(r"(0|1)(\.[0-9]*)?", text), text  # a number in [0, 1] so far
            continue
        assert last.finish_reason == pb.FINISH_REASON_STOP, (source, seed, text)
        assert last.usage.completion_tokens < MAX_NEW
        if kind == "schema":
            jsonschema.validate(json.loads(text), source, format_checker=jsonschema.FormatChecker())
        else:
            assert re.fullmatch(source, text), (source, text)


def test_a_schema_the_compiler_refuses_is_invalid_field_with_its_message(smollm2) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from tests.contract import expect_error

    err = expect_error(ask, smollm2, pb.ResponseFormat(json_schema=json.dumps({"type": "nope"})), "JSON", None)
    assert err["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert err["bad_request"].field_violations[0].field == "response_format.json_schema"
    assert "refused by the grammar compiler" in err["message"] and "nope" in err["message"]
    assert smollm2.load().waiting_requests == 0
