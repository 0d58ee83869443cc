"""What the drills share: how an answer is read (through the one client boundary,
`shared.errors.from_rpc_error`), engine processes, RSS, progress lines."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from engine.v1 import engine_pb2 as pb
from shared.errors import from_rpc_error, status_code_of
from tools.local_engine import EngineProcess

ROOT = Path(__file__).resolve().parent.parent
DECODE_METHOD = "/engine.v1.EngineService/Decode"

__all__ = ["ROOT", "CallResult", "EngineProcess", "answer_of", "collect", "note", "rss_kib"]


@dataclass(frozen=True)
class CallResult:
    """How one call ended: "OK" or a status name, the ErrorInfo reason, the BadRequest field,
    the RetryInfo delay, the ErrorInfo metadata, and the tokens streamed before the end."""

    code: str
    reason: str = ""
    field: str | None = None
    retry_delay: float | None = None
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tokens: tuple[int, ...] = ()
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    def is_(self, code: str, reason: str) -> bool:
        return self.code == code and self.reason == reason

    def short(self) -> str:
        return f"{self.code}/{self.reason or '-'}" + (f" ({self.message[:80]})" if self.message else "")


def answer_of(err: grpc.RpcError, tokens: Iterable[int] = ()) -> CallResult:
    """Read a failed call as the contract describes it."""
    e = from_rpc_error(err)
    return CallResult(status_code_of(e).name, e.reason, e.field, e.retry_delay, dict(e.metadata), tuple(tokens),
                      e.message)


def collect(call: Iterable[pb.DecodeResponse]) -> CallResult:
    """Read a Decode stream to its end: OK with every token, or the error with the tokens before it."""
    tokens: list[int] = []
    try:
        for msg in call:
            tokens.extend(msg.token_ids)
    except grpc.RpcError as err:
        return answer_of(err, tokens)
    return CallResult("OK", tokens=tuple(tokens))


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except FileNotFoundError:
        return 0
    return 0


def note(drill: str, message: str) -> None:
    """A progress line on stderr (the table goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {drill}: {message}", file=sys.stderr, flush=True)
