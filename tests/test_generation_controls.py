"""The generation controls over gRPC on SmolLM2 (its real tokenizer and chat template): stop
strings, log-probabilities' shape, penalties, logit_bias and min_new_tokens, Tokenize, and the new
fields' INVALID_FIELD refusals. Parity of the log-probabilities with transformers is in
test_gguf_parity.py, the processors against transformers' in test_logits_processors.py, the
structured output in test_structured_output.py."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from engine.v1 import engine_pb2 as pb
from tests.contract import details, expect_error, tokens_of
from tests.engines import EngineProcess

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def smollm2(smollm2_float32):  # type: ignore[no-untyped-def]
    """The session's SmolLM2 engine in float32 (conftest.py): exact greedy tokens however batched."""
    return smollm2_float32


def decode(proc: EngineProcess, **fields) -> list[pb.DecodeResponse]:  # type: ignore[no-untyped-def]
    return list(proc.stub().Decode(pb.DecodeRequest(**fields), timeout=60))


def text_of(responses: list[pb.DecodeResponse]) -> str:
    return "".join(r.text for r in responses)


def test_a_stop_string_ends_generation_and_is_never_streamed(smollm2) -> None:  # type: ignore[no-untyped-def]
    free = decode(smollm2, prompt_text=STORY, max_new_tokens=24, top_logprobs=1)
    full, tokens = text_of(free), tokens_of(free)
    pieces = [lp.text for r in free for lp in r.logprobs]
    assert "".join(pieces) == full and len(tokens) == len(pieces) == 24
    # a stop string that starts inside token k's text and ends inside token k + 2's
    k = next(k for k in range(1, 20) if len(pieces[k]) >= 2 and len(pieces[k + 2]) >= 2
             and full.find(full[len("".join(pieces[:k])) + 1:len("".join(pieces[:k + 2])) + 1])
             == len("".join(pieces[:k])) + 1)
    begin = len("".join(pieces[:k])) + 1
    stop = full[begin:len("".join(pieces[:k + 2])) + 1]
    stopped = decode(smollm2, prompt_text=STORY, max_new_tokens=24, stop=["never there", stop])
    last = stopped[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_string == stop
    assert text_of(stopped) == full[:begin] and stop not in text_of(stopped)
    # every token up to and including the one whose text completed the match (k + 2), none after
    assert tokens_of(stopped) == tokens[:k + 3] and last.usage.completion_tokens == k + 3


def test_without_a_match_the_held_back_text_is_released_at_the_end(smollm2) -> None:  # type: ignore[no-untyped-def]
    free = decode(smollm2, prompt_text=PROMPT, max_new_tokens=12, ignore_eos=True)
    full = text_of(free)
    # the stop string's start is the output's end: held back to the last message, then released
    stopped = decode(smollm2, prompt_text=PROMPT, max_new_tokens=12, ignore_eos=True, stop=[full[-1:] + "\x00"])
    assert text_of(stopped) == full and stopped[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert stopped[-1].stop_string == ""
    assert stopped[-1].text.endswith(full[-1:])


def test_logprobs_come_one_per_token_with_the_alternatives_most_likely_first(smollm2) -> None:  # type: ignore[no-untyped-def]
    responses = decode(smollm2, prompt_text=PROMPT, max_new_tokens=6, top_logprobs=3, ignore_eos=True)
    for r in responses:
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
        for lp in r.logprobs:
            values = [t.logprob for t in lp.top]
            assert len(lp.top) == 3 and values == sorted(values, reverse=True) and values[0] <= 0.0
            assert lp.logprob <= values[0] + 1e-6
            assert lp.top[0].token_id == lp.token_id  # greedy: the chosen token is the most likely
            assert lp.text == lp.top[0].text and lp.text
    plain = decode(smollm2, prompt_text=PROMPT, max_new_tokens=6, ignore_eos=True)
    assert tokens_of(plain) == tokens_of(responses) and not any(r.logprobs for r in plain)


def test_tokenize_gives_exactly_the_ids_decode_uses(smollm2) -> None:  # type: ignore[no-untyped-def]
    stub = smollm2.stub()
    text = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=10)
    assert len(text.token_ids) == len(text.pieces) and "".join(text.pieces) == PROMPT
    echoed = decode(smollm2, prompt_text=PROMPT, max_new_tokens=1, echo_prompt_logprobs=True)
    assert [lp.token_id for lp in echoed[0].prompt_logprobs] == list(text.token_ids[1:])
    assert echoed[-1].usage.prompt_tokens == len(text.token_ids)
    messages = [pb.ChatMessage(role="user", content="What is 2 + 2?")]
    chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=messages)), timeout=10)
    joined = "".join(chat.pieces)
    assert joined.startswith("<|im_start|>") and joined.endswith("<|im_start|>assistant\n")
    by_chat = decode(smollm2, chat=pb.ChatPrompt(messages=messages), max_new_tokens=1, echo_prompt_logprobs=True)
    assert [chat.token_ids[0]] + [lp.token_id for lp in by_chat[0].prompt_logprobs] == list(chat.token_ids)
    # longer than the context: tokenized all the same, so that the caller can trim it
    long = stub.Tokenize(pb.TokenizeRequest(text="word " * 600), timeout=10)
    assert len(long.token_ids) > 512


def test_tokenize_refuses_as_decode_does(smollm2) -> None:  # type: ignore[no-untyped-def]
    stub = smollm2.stub()
    for request, field in ((pb.TokenizeRequest(), "prompt"), (pb.TokenizeRequest(text=""), "text"),
                           (pb.TokenizeRequest(chat=pb.ChatPrompt()), "chat.messages"),
                           (pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(content="x")])),
                            "chat.messages[0].role")):
        err = expect_error(stub.Tokenize, request, timeout=10)
        assert err["code"] == grpc.StatusCode.INVALID_ARGUMENT and err["bad_request"].field_violations[0].field == field
    err = expect_error(stub.Tokenize, pb.TokenizeRequest(text="x" * (64 * 512 + 1)), timeout=10)
    assert err["info"].reason == "CONTEXT_LENGTH_EXCEEDED"


def test_logit_bias_min_new_tokens_and_penalties_change_what_is_generated(smollm2) -> None:  # type: ignore[no-untyped-def]
    free = tokens_of(decode(smollm2, prompt_text=PROMPT, max_new_tokens=8, ignore_eos=True))
    # a stop token (and EOS) cannot come before min_new_tokens
    assert tokens_of(decode(smollm2, prompt_text=PROMPT, max_new_tokens=8, stop_token_ids=[free[0]])) == free[:1]
    held = decode(smollm2, prompt_text=PROMPT, max_new_tokens=8, stop_token_ids=[free[0]],
                  sampling=pb.SamplingParams(min_new_tokens=5))
    assert len(tokens_of(held)) >= 5 and free[0] not in tokens_of(held)[:5]
    banned = decode(smollm2, prompt_text=PROMPT, max_new_tokens=8, ignore_eos=True,
                    sampling=pb.SamplingParams(logit_bias={free[0]: -100.0}))
    assert free[0] not in tokens_of(banned)
    forced = decode(smollm2, prompt_text=PROMPT, max_new_tokens=3, ignore_eos=True,
                    sampling=pb.SamplingParams(logit_bias={30: 100.0}))
    assert tokens_of(forced) == [30, 30, 30]
    repeated = decode(smollm2, prompt_text="a a a a a a a a", max_new_tokens=16, ignore_eos=True)
    penalized = decode(smollm2, prompt_text="a a a a a a a a", max_new_tokens=16, ignore_eos=True,
                       sampling=pb.SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0))
    assert len(set(tokens_of(penalized))) > len(set(tokens_of(repeated)))


def test_a_batch_mixing_controls_gives_each_request_what_it_gets_alone(smollm2) -> None:  # type: ignore[no-untyped-def]
    kinds = [dict(stop=["Madrid"]), dict(top_logprobs=2), dict(sampling=pb.SamplingParams(repetition_penalty=1.5)),
             dict()]
    alone = [tokens_of(decode(smollm2, prompt_text=PROMPT, max_new_tokens=10, ignore_eos=True, **k)) for k in kinds]
    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(lambda k: tokens_of(decode(smollm2, prompt_text=PROMPT, max_new_tokens=10,
                                                            ignore_eos=True, **k)), kinds))
    assert together == alone


INVALID = [
    ("stop", dict(stop=["a"] * 9)),
    ("stop[1]", dict(stop=["ok", ""])),
    ("stop[0]", dict(stop=["x" * 257])),
    ("top_logprobs", dict(top_logprobs=21)),
    ("sampling.repetition_penalty", dict(sampling=pb.SamplingParams(repetition_penalty=-1.0))),
    ("sampling.repetition_penalty", dict(sampling=pb.SamplingParams(repetition_penalty=float("nan")))),
    ("sampling.presence_penalty", dict(sampling=pb.SamplingParams(presence_penalty=2.5))),
    ("sampling.frequency_penalty", dict(sampling=pb.SamplingParams(frequency_penalty=float("-inf")))),
    ("sampling.min_p", dict(sampling=pb.SamplingParams(min_p=1.5))),
    ("sampling.min_new_tokens", dict(sampling=pb.SamplingParams(min_new_tokens=9))),
    ("sampling.logit_bias", dict(sampling=pb.SamplingParams(logit_bias={10**6: 1.0}))),
    ("sampling.logit_bias", dict(sampling=pb.SamplingParams(logit_bias={5: 101.0}))),
    ("sampling.logit_bias", dict(sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(301)}))),
    ("response_format", dict(response_format=pb.ResponseFormat())),
    ("response_format.json_schema", dict(response_format=pb.ResponseFormat(json_schema="{not json"))),
    ("response_format.regex", dict(response_format=pb.ResponseFormat(regex="(unclosed"))),
    ("response_format.lark_grammar", dict(response_format=pb.ResponseFormat(lark_grammar="start: nothing_defined"))),
]


@pytest.mark.parametrize(("field", "fields"), INVALID, ids=[f for f, _ in INVALID])
def test_new_fields_are_refused_with_invalid_field_before_anything_is_queued(smollm2, field, fields) -> None:  # type: ignore[no-untyped-def]
    err = expect_error(decode, smollm2, prompt_text="hello", max_new_tokens=8, **fields)
    assert err["code"] == grpc.StatusCode.INVALID_ARGUMENT and err["info"].reason == "INVALID_FIELD", err
    assert err["bad_request"].field_violations[0].field == field
    assert field in err["message"]
    assert smollm2.load().waiting_requests == 0


def test_a_refused_request_id_is_echoed_capped_and_escaped(smollm2) -> None:  # type: ignore[no-untyped-def]
    raw = "\x1b[31m" + "é" * 5000
    try:
        decode(smollm2, request_id=raw, prompt_text="hello", max_new_tokens=8)
    except grpc.RpcError as rpc_error:
        err = details(rpc_error)
    assert err["bad_request"].field_violations[0].field == "request_id"
    finished = smollm2.wait_events("request_finished", count=1)
    logged = [e for e in finished if e.get("status") == "INVALID_ARGUMENT"][-1]["request_id"]
    assert len(logged) <= 72 and "\x1b" not in logged and logged.isascii()
