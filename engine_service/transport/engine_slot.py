"""The server's one view of its engine: LOADING while the model loads, then READY with the engine.

The gRPC server binds and answers before the model has loaded (health NOT_SERVING), so what it
serves starts empty. The servicer reads this one state, never an engine's fields: calls that need
the engine wait for READY (`engine()`), GetLoad and the metrics read zeros while LOADING. READY is
for good: draining and a fatal error are the engine's own states (`Engine.draining`, its fatal
message), which it answers itself. A load that fails or is abandoned (SIGTERM) leaves the slot
LOADING: the server stops, and stopping cancels the calls still waiting, as it always did.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine_service.runtime.engine import Engine
from engine_service.scheduling.scheduler import LoadSnapshot


@dataclass(frozen=True)
class Loading:
    """The model is loading: no engine yet."""


@dataclass(frozen=True)
class Ready:
    engine: Engine


SlotState = Loading | Ready


class EngineSlot:
    """LOADING -> READY(engine), once; filled by `serve` when `build_engine` returns."""

    def __init__(self) -> None:
        self._state: SlotState = Loading()
        self._ready = asyncio.Event()

    @classmethod
    def holding(cls, engine: Engine) -> EngineSlot:
        """A slot READY from the start, for a server built around an engine already built."""
        slot = cls()
        slot.fill(engine)
        return slot

    @property
    def state(self) -> SlotState:
        return self._state

    def fill(self, engine: Engine) -> None:
        """LOADING -> READY: the calls waiting in `engine()` go on with `engine`."""
        if isinstance(self._state, Ready):
            raise RuntimeError(f"the engine slot already holds an engine serving {self._state.engine.info.model!r}")
        self._state = Ready(engine)
        self._ready.set()

    async def engine(self) -> Engine:
        """The engine, once READY (at once when it is)."""
        await self._ready.wait()
        return self.ready_engine()

    def ready_engine(self) -> Engine:
        """The engine of a READY slot: for code that runs only after `engine()` returned (a
        submitted request's stream, drain)."""
        match self._state:
            case Ready(engine):
                return engine
            case Loading():
                raise RuntimeError("the engine slot was asked for its engine while the model loads")

    def load(self) -> LoadSnapshot:
        """The engine's load; all zeros while LOADING."""
        match self._state:
            case Ready(engine):
                return engine.load()
            case Loading():
                return LoadSnapshot()

    def waiting(self) -> int:
        """Requests queued; 0 while LOADING."""
        match self._state:
            case Ready(engine):
                return engine.waiting()
            case Loading():
                return 0

    @property
    def draining(self) -> bool:
        """Whether the engine admits nothing new; False while LOADING (a stop then ends the server
        at once, with no drain)."""
        match self._state:
            case Ready(engine):
                return engine.draining
            case Loading():
                return False

    @property
    def model(self) -> str | None:
        """The served model's name; None while LOADING."""
        match self._state:
            case Ready(engine):
                return engine.info.model
            case Loading():
                return None
