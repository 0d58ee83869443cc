"""Every bad input gets INVALID_ARGUMENT with the right reason and details, is never queued,
and never disturbs other requests."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.v1 import engine_pb2 as pb
from engine_service.machine.cpu import detect
from engine_service.machine.precision import choose_dtype
from shared.errors import DOMAIN, ContextLengthExceeded, InvalidField, from_rpc_error
from tests.contract import decode, expect_error, tokens_of

GOOD = {"prompt_text": "hello", "max_new_tokens": 4}

BAD_FIELDS = [
    ({"prompt_text": "", "max_new_tokens": 4}, "prompt_text"),
    ({"max_new_tokens": 4}, "prompt"),
    ({"prompt_token_ids": pb.TokenIds(ids=[]), "max_new_tokens": 4}, "prompt_token_ids.ids"),
    ({"prompt_token_ids": pb.TokenIds(ids=[1, 258]), "max_new_tokens": 4}, "prompt_token_ids.ids"),
    ({"prompt_token_ids": pb.TokenIds(ids=[2**32 - 1]), "max_new_tokens": 4}, "prompt_token_ids.ids"),
    ({**GOOD, "max_new_tokens": 0}, "max_new_tokens"),
    ({**GOOD, "max_new_tokens": 201}, "max_new_tokens"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=-0.5)}, "sampling.temperature"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=float("nan"))}, "sampling.temperature"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=float("inf"))}, "sampling.temperature"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=1.0, top_p=1.5)}, "sampling.top_p"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=1.0, top_p=-0.1)}, "sampling.top_p"),
    ({**GOOD, "sampling": pb.SamplingParams(temperature=1.0, top_p=float("nan"))}, "sampling.top_p"),
    ({**GOOD, "sampling": pb.SamplingParams(top_k=-1)}, "sampling.top_k"),
    ({**GOOD, "request_id": "has space"}, "request_id"),
    ({**GOOD, "request_id": "x" * 129}, "request_id"),
    ({**GOOD, "request_id": "é"}, "request_id"),
    ({**GOOD, "stop_token_ids": [300]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_FIELDS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_FIELDS)])
def test_bad_field_is_invalid_argument_with_field_violation(engine, fields, field):
    before = engine.load().requests_finished
    got = expect_error(decode, engine.stub(), **fields)
    assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert got["info"].reason == "INVALID_FIELD" and got["info"].domain == DOMAIN
    assert got["info"].metadata["field"] == field
    assert got["bad_request"].field_violations[0].field == field
    assert got["bad_request"].field_violations[0].description == got["message"]
    assert field.split(".")[-1] in got["message"]
    assert engine.load().requests_finished == before, "a rejected request must never be queued"


def test_message_names_the_value(engine):
    got = expect_error(decode, engine.stub(), **{**GOOD, "max_new_tokens": 0})
    assert got["message"] == "max_new_tokens must be 1..200, got 0"
    assert got["info"].metadata["value"] == "0"


@pytest.mark.parametrize(("prompt_len", "max_new"), [(250, 10), (256, 1), (300, 1)])
def test_context_length_exceeded(engine, prompt_len, max_new):
    got = expect_error(decode, engine.stub(), prompt_token_ids=pb.TokenIds(ids=[7] * prompt_len),
                       max_new_tokens=max_new)
    assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert got["info"].reason == "CONTEXT_LENGTH_EXCEEDED"
    meta = dict(got["info"].metadata)
    assert meta["maxContextTokens"] == "256"
    assert meta["promptTokens"] == str(prompt_len)
    assert "bad_request" not in got


def test_context_exactly_full_is_served(engine):
    responses = decode(engine.stub(), prompt_token_ids=pb.TokenIds(ids=[7] * 250), max_new_tokens=6, ignore_eos=True)
    assert len(tokens_of(responses)) == 6


def test_client_side_conversion_gives_domain_exception(engine):
    try:
        decode(engine.stub(), **{**GOOD, "max_new_tokens": 0})
    except grpc.RpcError as err:
        exc = from_rpc_error(err)
    assert isinstance(exc, InvalidField) and exc.field == "max_new_tokens"
    try:
        decode(engine.stub(), prompt_token_ids=pb.TokenIds(ids=[1] * 300), max_new_tokens=1)
    except grpc.RpcError as err:
        exc = from_rpc_error(err)
    assert isinstance(exc, ContextLengthExceeded) and exc.metadata["promptTokens"] == "300"


def test_undecodable_bytes_get_invalid_argument_not_unknown(engine):
    with engine.channel() as ch:
        call = ch.unary_stream("/engine.v1.EngineService/Decode", request_serializer=None,
                               response_deserializer=pb.DecodeResponse.FromString)
        got = expect_error(lambda: list(call(b"\xff\xff\xff\xff\x0f", timeout=10)))
        unary = ch.unary_unary("/engine.v1.EngineService/GetLoad", request_serializer=None,
                               response_deserializer=pb.Load.FromString)
        got_unary = expect_error(unary, b"\x0a\xff", timeout=10)
    for g in (got, got_unary):
        assert g["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert g["info"].reason == "INVALID_FIELD" and g["info"].metadata["field"] == "request"


def test_message_over_receive_limit_is_resource_exhausted(start_engine):
    proc = start_engine("--model", "tiny", "--max-receive-bytes", "1024")
    got = expect_error(decode, proc.stub(), prompt_text="x" * 4096, max_new_tokens=1)
    assert got["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_requests_do_not_disturb_a_running_stream(engine):
    stub = engine.stub()
    alone = tokens_of(decode(stub, prompt_text="steady", max_new_tokens=60, ignore_eos=True))
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.extend(
        tokens_of(decode(stub, prompt_text="steady", max_new_tokens=60, ignore_eos=True))))
    worker.start()
    for fields, _ in BAD_FIELDS * 3:
        expect_error(decode, stub, **fields)
    worker.join(30)
    assert result == alone


def test_server_info_describes_limits(engine):
    info = engine.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert (info.model, info.max_context_tokens, info.max_new_tokens_limit) == ("tiny", 256, 200)
    assert (info.max_batch_size, info.queue_capacity, info.vocab_size) == (8, 64, 258)
    # --dtype auto and --quantize auto (the defaults): the CPU's choice, and random weights stay unquantized
    cpu = detect()
    assert (info.eos_token_id, info.bos_token_id, info.device, info.dtype, info.tokenizer) == (
        257, 256, "cpu", "bfloat16" if cpu.native_bf16 else "float32", "byte")
    assert (info.quantization, info.cpu_capability) == ("none", cpu.describe())
    assert info.precision_reason == (f"{choose_dtype('auto', 'cpu', cpu)[1]}; quantize none: auto, the weights are "
                                     "random")


def test_response_stream_shape(engine):
    responses = decode(engine.stub(), request_id="shape-1", prompt_text="abc", max_new_tokens=5, ignore_eos=True)
    assert all(r.request_id == "shape-1" for r in responses)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 5)  # BOS + 3 bytes
    assert 0 <= last.timing.queue_seconds <= last.timing.time_to_first_token_seconds <= last.timing.total_seconds
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert len(tokens_of(responses)) == 5


def test_server_assigns_a_request_id(engine):
    responses = decode(engine.stub(), prompt_text="abc", max_new_tokens=2)
    assert responses[0].request_id.startswith("req-")


def test_stop_token_ends_with_stop(engine):
    stub = engine.stub()
    free = tokens_of(decode(stub, prompt_text="stop me", max_new_tokens=20, ignore_eos=True))
    stop_at = free[3]
    responses = decode(stub, prompt_text="stop me", max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    got = tokens_of(responses)
    assert got == free[: free.index(stop_at) + 1]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


def test_health_reports_both_services_and_reflection_lists_them(engine):
    assert engine.health("") == health_pb2.HealthCheckResponse.SERVING
    assert engine.health("engine.v1.EngineService") == health_pb2.HealthCheckResponse.SERVING
    with engine.channel() as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"engine.v1.EngineService", "grpc.health.v1.Health"} <= names


def test_huge_prompt_text_is_refused_before_tokenizing(engine):
    got = expect_error(decode, engine.stub(), prompt_text="x" * (64 * 256 + 64), max_new_tokens=5)
    assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT and got["info"].reason == "CONTEXT_LENGTH_EXCEEDED"
    assert "at least 257 tokens" in got["message"]
    assert dict(got["info"].metadata) == {"promptTokens": "257", "maxNewTokens": "5", "maxContextTokens": "256"}
