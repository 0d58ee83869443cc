"""HTTP/1.1 over a raw socket, for the drills that must say exactly what goes on the wire and what
came back (drills/fuzz_front.py, drain.py, crash.py): the request's bytes, the answer read to the
connection's end (what came before a reset kept), its status, headers and body (de-chunked) and
whether its framing was complete, the events of an SSE stream, and JSON as a standard parser reads it."""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tools.local_engine import EngineProcess

READ_TIMEOUT_S = 20.0


def http_port(engine: EngineProcess) -> int:
    """The HTTP front's port (--http-port 0: any free one), as `server_started` logged it."""
    return int(engine.events_named("server_started")[0]["http_port"])


@dataclass(frozen=True)
class Reply:
    """What came back on one connection: the status (None: none came before the connection closed),
    the headers (names lower-cased), the body (de-chunked) and whether its framing was complete."""

    status: int | None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    note: str = ""  # how the connection ended when it did not end cleanly

    def short(self) -> str:
        return f"{self.status} {self.body[:160]!r}" + (f" ({self.note})" if self.note else "")


def request(path: str, body: bytes | None, *, method: str = "POST", auth: bytes | None = None,
            headers: tuple[tuple[bytes, bytes], ...] = (), close: bool = True) -> bytes:
    """An HTTP/1.1 request's bytes: a JSON body when given, `Authorization: <auth>` when given, and
    `Connection: close` unless told (the answer then ends with the connection)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    if auth is not None:
        lines.append(b"Authorization: " + auth)
    if body is not None:
        lines += [b"Content-Type: application/json", b"Content-Length: " + str(len(body)).encode()]
    if close:
        lines.append(b"Connection: close")
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def receive(sock: socket.socket, limit: float, answer_only: bool = False) -> tuple[bytes, str]:
    """Bytes until the server closes (or resets: what came before is kept), or `limit` seconds;
    `answer_only`: until one whole answer has come (a server that lingers, reading the rest of a
    body it refused, keeps the connection open a while after it)."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + limit
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return b"".join(chunks), "reset by the engine"
        except TimeoutError:
            return b"".join(chunks), f"no end within {limit:g} s"
        if not chunk:
            return b"".join(chunks), ""
        chunks.append(chunk)
        if answer_only and parse_reply(b"".join(chunks)).complete:
            return b"".join(chunks), ""


def parse_reply(data: bytes, ended: str = "") -> Reply:
    """The answer in `data`, after any interim 1xx (100 Continue)."""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
        if not sep or match is None:
            return Reply(None, note=ended or f"no status line in {data[:80]!r}")
        status = int(match.group(1))
        if 100 <= status < 200:
            data = rest
            continue
        break
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, complete = _dechunk(rest)
    elif "content-length" in headers:
        n = int(headers["content-length"])
        body, complete = rest[:n], len(rest) >= n
    else:
        body, complete = rest, not ended
    return Reply(status, headers, body, complete, ended)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out, at = bytearray(), 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return bytes(out), False
        size = int(data[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out), True
        out += data[end + 2:end + 2 + size]
        if len(data) < end + 4 + size:
            return bytes(out), False
        at = end + 4 + size


def abort(sock: socket.socket) -> None:
    """Close with a RST (SO_LINGER 0), as a crashed caller's kernel does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def exchange(port: int, data: bytes, *, half_close: bool = False, limit: float = READ_TIMEOUT_S,
             answer_only: bool = False) -> Reply:
    """Send `data` on a new connection and read the answer to the connection's end (`answer_only`:
    to the answer's own end)."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the engine answered (a 413) and closed, or stopped reading, before all was sent: read what it said
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received, ended = receive(sock, limit, answer_only)
    return parse_reply(received, ended)


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: "):] if e.startswith(b"data: ") else e for e in body.split(b"\n\n") if e]


def strict_json(raw: bytes | str) -> Any:
    """JSON as a standard parser reads it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not standard JSON")
    return json.loads(raw, parse_constant=refuse)


@dataclass(frozen=True)
class StreamEnd:
    """How an OpenAI-compatible SSE stream ended: its choice chunks, the last finish_reason, the
    usage's completion_tokens (with include_usage), the error frame's `error` object if one came,
    whether `data: [DONE]` came last, and whether the HTTP framing was complete."""

    status: int | None
    chunks: int = 0
    finish: str | None = None
    completion_tokens: int | None = None
    error: Mapping[str, Any] | None = None
    done: bool = False
    complete: bool = False
    note: str = ""

    def short(self) -> str:
        return (f"status {self.status}, {self.chunks} chunks, finish {self.finish}, completion_tokens "
                f"{self.completion_tokens}, error {dict(self.error) if self.error else None}, [DONE] {self.done}, "
                f"framing {'complete' if self.complete else 'cut'}" + (f" ({self.note})" if self.note else ""))


def stream_end(reply: Reply) -> StreamEnd:
    events = sse_events(reply.body)
    chunks, finish, completion, error = 0, None, None, None
    for raw in events:
        if raw == b"[DONE]":
            continue
        try:
            chunk = json.loads(raw)
        except ValueError:
            return StreamEnd(reply.status, chunks, finish, completion, error, False, reply.complete,
                             f"an event not JSON: {raw[:80]!r}")
        if "error" in chunk:
            error = chunk["error"]
        if chunk.get("usage"):
            completion = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or ():
            chunks += 1
            finish = choice.get("finish_reason") or finish
    return StreamEnd(reply.status, chunks, finish, completion, error, events[-1:] == [b"[DONE]"], reply.complete,
                     reply.note)


def completion_stream(port: int, prompt: str, max_tokens: int, limit: float = READ_TIMEOUT_S) -> StreamEnd:
    """A greedy streamed /v1/completions of exactly `max_tokens` (ignore_eos, with its usage), read to its end."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    return stream_end(exchange(port, request("/v1/completions", body), limit=limit))
