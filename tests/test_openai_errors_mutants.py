"""The exact values bench_client.openai_errors reads and builds, pinned inside each test.

test_openai_errors.py checks the class, the code and the policy of each server's wording; these pin
what a record or a log line carries: each body shape's message, type, code and fields, the fallbacks
when a body says less, the metadata of every class, the exact wording of a malformed event and of a
transport failure, and the Retry-After corners (found by `make mutate`, docs/mutation-testing.md).
"""

from __future__ import annotations

import datetime
import json
import os

import grpc
import pytest

from bench_client.openai_errors import (
    ErrorBody,
    _dump,
    code_for_status,
    from_error_frame,
    from_first_error_frame,
    from_http_response,
    json_int,
    json_str,
    malformed_answer,
    malformed_event,
    read_error_body,
    retry_after,
    transport_failure,
)
from shared.errors import (
    EngineUnavailable,
    InvalidRequest,
    PermissionDenied,
    StreamError,
    TransportError,
    Unauthenticated,
    wire_code,
)

URL = "http://127.0.0.1:9/v1/completions"


def test_each_body_shape_gives_message_type_code_and_fields() -> None:
    openai = {"error": {"message": "m1", "type": "BadRequestError", "code": 400, "param": None}}
    assert read_error_body(json.dumps(openai)) == ErrorBody("m1", "BadRequestError", 400, openai["error"])
    tgi = {"error": "m2", "error_type": "generation", "code": "503"}  # a code as digits is read as a number
    assert read_error_body(json.dumps(tgi).encode()) == ErrorBody("m2", "generation", 503, tgi)
    old = {"object": "error", "message": "m3", "type": "BadRequestError", "code": 400}
    assert read_error_body(old) == ErrorBody("m3", "BadRequestError", 400, old)
    fastapi = {"detail": "Not Found"}
    assert read_error_body(json.dumps(fastapi)) == ErrorBody("Not Found", None, None, fastapi)
    other = {"weird": 1}
    assert read_error_body(json.dumps(other)) == ErrorBody('{"weird": 1}', None, None, other)
    assert read_error_body(None) == ErrorBody("(empty body)")
    assert read_error_body("  plain text \n") == ErrorBody("plain text")


def test_an_empty_message_falls_back_to_the_whole_body() -> None:
    for body in ({"error": {"code": 500}}, {"error": {"message": "", "code": 500}},
                 {"error": {"message": None, "code": 500}}, {"object": "error", "message": "", "type": "t"},
                 {"detail": None}, {"detail": ""}):
        text = json.dumps(body)
        assert read_error_body(text).message == text, body
        assert read_error_body(body).message == text, body  # a frame's payload: its JSON
    assert from_error_frame({"error": {"code": 500}}).message == '{"error": {"code": 500}}'
    assert read_error_body({"object": "error", "message": "", "type": "t"}).type == "t"


def test_a_message_that_is_not_a_string() -> None:
    assert read_error_body({"error": {"message": {"reason": "x"}}}).message == '{"reason": "x"}'
    assert read_error_body({"error": {"message": 42}}).message == "42"
    # FastAPI's list: each item's msg, else the item itself, joined with "; "
    detail = {"detail": [{"loc": ["body", "max_tokens"], "msg": "a"}, "plain", {"loc": ["q"]}]}
    assert read_error_body(json.dumps(detail)).message == "a; plain; {'loc': ['q']}"
    # a frame built in-process may hold what JSON cannot say: str() of it, inside the JSON
    dated = read_error_body({"error": {"message": {"at": datetime.date(2026, 1, 2)}}})
    assert dated.message == '{"at": "2026-01-02"}'
    looped: dict[str, object] = {}
    looped["self"] = looped
    assert read_error_body({"error": {"message": looped}}).message == "{'self': {...}}"


def test_type_and_code_are_kept_only_when_they_are_what_they_should_be() -> None:
    assert read_error_body({"error": {"message": "m", "type": ""}}).type is None
    assert read_error_body({"error": {"message": "m", "type": 5}}).type is None
    for code, expected in ((400, 400), ("400", 400), (400.0, 400), (400.5, None), (True, None), ("abc", None),
                           ("4.5", None), (None, None), ("²", None), ("①", None)):  # str.isdigit is true for these, and int() refuses them
        assert read_error_body({"error": {"message": "m", "code": code}}).code == expected, code
    # so an odd code in an error frame still gives a StreamError, never a ValueError
    odd = from_error_frame({"error": {"message": "m", "code": "²"}})
    assert type(odd) is StreamError and odd.http_status is None and odd.metadata == {}
    assert json_int(7.0) == 7 and type(json_int(7.0)) is int and json_int(False) is None
    assert (json_str("x"), json_str(""), json_str(3)) == ("x", None, None)


def test_messages_are_cut_at_500_characters() -> None:
    assert from_http_response(500, {}, "y" * 500).message == "y" * 500
    assert from_http_response(500, {}, "y" * 501).message == "y" * 497 + "..."


def test_metadata_of_each_class() -> None:
    body = json.dumps({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
    for status, cls in ((401, Unauthenticated), (403, PermissionDenied)):
        err = from_http_response(status, {}, body)
        assert type(err) is cls
        assert err.metadata == {"httpStatus": str(status), "errorType": "authentication_error"}
    plain = from_http_response(500, {}, "<html>nope</html>")
    assert type(plain) is TransportError and plain.metadata == {"httpStatus": "500"}
    typed = from_http_response(404, {}, json.dumps({"error": {"message": "no route", "type": "not_found_error"}}))
    assert typed.metadata == {"httpStatus": "404", "errorType": "not_found_error"}


def test_an_error_frame_with_a_code_names_it_in_its_metadata() -> None:
    err = from_error_frame({"error": {"code": 500, "message": "failed to decode the batch", "type": "server_error"}})
    assert err.metadata == {"errorType": "server_error", "httpStatus": "500"}
    tgi = from_error_frame({"error": "overloaded", "error_type": "overloaded", "code": 503})
    assert (tgi.http_status, tgi.metadata) == (503, {"errorType": "overloaded", "httpStatus": "503"})
    assert wire_code(tgi) == "HTTP_503"


def test_malformed_event_wording() -> None:
    err = malformed_event("x" * 200, "data is not JSON")
    assert err.message == f"malformed event in the answer stream (data is not JSON): {'x' * 200!r}"
    assert (err.metadata, err.http_status) == ({"httpStatus": "200"}, 200)
    cut = malformed_event("x" * 201, "no choices")
    assert cut.message == f"malformed event in the answer stream (no choices): {'x' * 197 + '...'!r}"


def test_transport_failure_names_url_class_and_os_error() -> None:
    refused = transport_failure(URL, ConnectionRefusedError(111, "Connection refused"))
    assert refused.message == (f"{URL}: connection failed: ConnectionRefusedError: {os.strerror(111)} (errno 111): "
                               "[Errno 111] Connection refused")
    assert type(refused) is EngineUnavailable and refused.metadata == {"url": URL}
    cut = transport_failure(URL, ConnectionResetError(), during="while streaming")
    assert cut.message == f"{URL}: connection failed while streaming: ConnectionResetError: ConnectionResetError"
    assert cut.metadata == {"url": URL}


class ConnectorError(Exception):
    """As aiohttp's ClientConnectorError: the OS error is an attribute, not the exception itself."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__("cannot connect to host")
        self.os_error = os_error


class NotAnOSError(Exception):
    errno = 5


def test_transport_failure_reads_errno_only_from_an_os_error_that_has_one() -> None:
    wrapped = transport_failure(URL, ConnectorError(ConnectionResetError(104, "Connection reset by peer")))
    assert wrapped.message == (f"{URL}: connection failed: ConnectorError: {os.strerror(104)} (errno 104): "
                               "cannot connect to host")
    perm = transport_failure(URL, OSError(1, "not allowed"))
    assert perm.message == f"{URL}: connection failed: PermissionError: {os.strerror(1)} (errno 1): [Errno 1] not allowed"
    # errno 0 is no error number; an OSError without one, or another exception, is named as it is
    assert transport_failure(URL, OSError(0, "zero")).message == f"{URL}: connection failed: OSError: [Errno 0] zero"
    assert transport_failure(URL, OSError("plain")).message == f"{URL}: connection failed: OSError: plain"
    assert transport_failure(URL, RuntimeError("boom")).message == f"{URL}: connection failed: RuntimeError: boom"
    assert transport_failure(URL, NotAnOSError("odd")).message == f"{URL}: connection failed: NotAnOSError: odd"


def test_retry_after_date_corners() -> None:
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    # "-0000" gives a naive datetime: it is UTC
    assert retry_after({"Retry-After": "Tue, 01 Dec 2026 00:00:05 -0000"}, now=now) == 5.0
    assert retry_after({"retry-after": " 3 "}) == 3.0
    assert retry_after({"RETRY-AFTER": "1.5"}) == 1.5
    # measured from the real now when none is given: a date long past is 0
    assert retry_after({"Retry-After": "Tue, 01 Dec 1998 00:00:00 GMT"}) == 0.0
    assert retry_after({"Retry-After": ""}) is None
    assert retry_after({"X-Retry-After": "3"}) is None


@pytest.mark.parametrize(("status", "code"), [
    (399, grpc.StatusCode.UNKNOWN),
    (499, grpc.StatusCode.FAILED_PRECONDITION),
    (505, grpc.StatusCode.UNKNOWN),
])
def test_codes_of_unlisted_statuses(status: int, code: grpc.StatusCode) -> None:
    assert code_for_status(status) is code


# -- found by `make mutate` once tests/test_bench_tgi.py and test_openai_http.py joined its selection --

def test_a_malformed_answer_names_the_url_and_the_body_cut_at_200_with_bad_bytes_replaced() -> None:
    err = malformed_answer(URL, b"\xff" + b"a" * 300, "no choices")
    assert str(err) == f"{URL}: unreadable answer (no choices): {chr(0xFFFD) + 'a' * 196 + '...'!r}"
    assert err.metadata == {"httpStatus": "200"} and err.http_status == 200
    assert err.status_code == grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    assert str(malformed_answer(URL, b"a" * 200, "why")).endswith(f"{'a' * 200!r}")  # 200: not cut


def test_tgis_validation_frame_by_its_type_is_the_refusal_whatever_its_wording() -> None:
    typed = from_first_error_frame({"error": {"message": "odd wording", "type": "validation", "http_status_code": 422}})
    assert isinstance(typed, InvalidRequest) and typed.http_status == 422
    # a string error is no OpenAI-shaped frame, whatever it holds: its wording decides nothing
    plain = from_first_error_frame({"error": "Input validation error: http_status_code"})
    assert isinstance(plain, StreamError) and not isinstance(plain, InvalidRequest)


def test_a_value_nested_too_deep_to_dump_is_named_by_its_type() -> None:
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert _dump(nested) == "(a list nested too deep to show)"


def test_json_int_reads_at_most_18_digits() -> None:
    assert json_int("9" * 18) == 10**18 - 1
    assert json_int("9" * 19) is None


def test_a_retry_after_of_hundreds_of_digits_is_no_delay() -> None:
    assert retry_after({"Retry-After": "9" * 400}) is None
