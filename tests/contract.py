"""Helpers to call the engine and read errors as the contract describes them."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from engine.v1 import engine_pb2 as pb


def decode(stub, timeout: float = 30, **fields) -> list[pb.DecodeResponse]:  # type: ignore[no-untyped-def]
    return list(stub.Decode(pb.DecodeRequest(**fields), timeout=timeout))


def tokens_of(responses: list[pb.DecodeResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def details(err: grpc.RpcError) -> dict:
    """code, message, ErrorInfo, BadRequest field and RetryInfo delay of a failed call."""
    status = rpc_status.from_call(err)
    out: dict = {"code": err.code(), "message": err.details(), "status": status}
    if status is None:
        return out
    for any_ in status.details:
        for cls, key in ((error_details_pb2.ErrorInfo, "info"), (error_details_pb2.BadRequest, "bad_request"),
                         (error_details_pb2.RetryInfo, "retry")):
            if any_.Is(cls.DESCRIPTOR):
                msg = cls()
                any_.Unpack(msg)
                out[key] = msg
    return out


def expect_error(fn, *args, **kwargs) -> dict:  # type: ignore[no-untyped-def]
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as err:
        return details(err)
    raise AssertionError("the call succeeded; an error was expected")
