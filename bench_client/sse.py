"""An incremental parser of server-sent events (the WHATWG HTML "event stream" rules), without I/O.

Feed it the body's bytes as they arrive, in chunks cut anywhere (inside a line, a CRLF pair or a
multi-byte UTF-8 character); it returns the events each chunk completed:

- lines end with CRLF, LF or CR; a UTF-8 byte-order mark at the very start is dropped;
- a line starting with ":" is a comment (llama-server's pings are ":\\n\\n") and is ignored;
- `field: value` with one optional space after the colon; a line without a colon is a field with
  an empty value; the fields are `event`, `data` (several `data` lines join with "\\n"), `id` (kept
  for the following events, as the last event id; ignored when it holds NUL) and `retry` (digits
  only); any other field is ignored;
- a blank line dispatches the event; one without data is dropped, as the rules say.

At the end of the body `close()` returns the event the body left unfinished (fields seen but no
blank line after them), where the rules would drop it silently, so that a caller can tell a stream
that ended mid-event. The payloads are not interpreted: `[DONE]` is data like any other.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

_LINE_END = re.compile(r"[\r\n]")
_BOM = "\ufeff"


@dataclass(frozen=True)
class Event:
    """One dispatched event: its type ("message" unless an `event:` field named one), its data,
    and the last event id the stream had set so far (None: none)."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Feed bytes with `feed`, get the completed events; call `close` once at the end of the body."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._started = False  # the BOM check is done
        self._skip_lf = False  # the last chunk ended with CR: a LF that starts the next one belongs to it
        self._data: list[str] = []
        self._event_type = ""
        self._last_id: str | None = None
        self._pending = False  # a field was seen since the last dispatch
        self.retry_ms: int | None = None  # the last `retry:` the stream sent
        self._closed = False

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that `chunk` completed, in order (often none)."""
        if self._closed:
            raise ValueError("feed() after close()")
        return self._take(self._decoder.decode(chunk))

    def close(self) -> Event | None:
        """End of the body: the event it left unfinished (its last line may lack its end), or None
        when it ended between events."""
        if self._closed:
            return None
        self._take(self._decoder.decode(b"", final=True))  # at most U+FFFD for cut bytes: no line end
        self._closed = True
        if self._buffer:  # the last line had no line end
            self._line(self._buffer)
            self._buffer = ""
        if not self._pending:
            return None
        event = Event(data="\n".join(self._data), event=self._event_type or "message", id=self._last_id)
        self._reset()
        return event

    def _take(self, text: str) -> list[Event]:
        if not text:
            return []
        if not self._started:
            self._started = True
            text = text.removeprefix(_BOM)
        if self._skip_lf:
            self._skip_lf = False
            if text.startswith("\n"):
                text = text[1:]
        buffer = self._buffer + text
        events: list[Event] = []
        start = 0
        while True:
            match = _LINE_END.search(buffer, start)
            if match is None:
                break
            end = match.start()
            line = buffer[start:end]
            if buffer[end] == "\r":
                if end + 1 < len(buffer):
                    start = end + 2 if buffer[end + 1] == "\n" else end + 1
                else:
                    start = end + 1
                    self._skip_lf = True
            else:
                start = end + 1
            event = self._line(line)
            if event is not None:
                events.append(event)
        self._buffer = buffer[start:]
        return events

    def _line(self, line: str) -> Event | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        else:
            return None  # an unknown field is ignored
        self._pending = True
        return None

    def _dispatch(self) -> Event | None:
        if not self._data:  # the rules: an event without data is not dispatched
            self._reset()
            return None
        event = Event(data="\n".join(self._data), event=self._event_type or "message", id=self._last_id)
        self._reset()
        return event

    def _reset(self) -> None:
        self._data = []
        self._event_type = ""
        self._pending = False
