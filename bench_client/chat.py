"""One question as chat messages, its answer streamed as text: `python -m bench_client chat` and the
sweep's [preview].

The engine renders the model's own chat template, so the question needs a model that has one
(ServerInfo.has_chat_template; SmolLM2 has); the answer ends at the model's end of turn or at
max_new_tokens. The engine is a target, or a managed one: started as the sweep starts its engines
(engine_process.ManagedEngine), drained once the answer is in.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from bench_client.config import EngineLaunchConfig
from bench_client.engine_process import ManagedEngine
from bench_client.rpc import EngineClient
from bench_client.server_api import ChatSpec, ChatTurn, ServerClient, TokenLogprob

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class Question:
    text: str
    system: str = ""  # an optional system message before the question
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy, the same answer every time
    seed: int = 0
    stop: tuple[str, ...] = ()  # the answer ends before the first of these that appears
    json_schema: str | None = None  # the answer is JSON that validates against this schema
    top_logprobs: int = 0  # > 0: each answer token's log-probability, and this many alternatives

    def messages(self) -> tuple[ChatTurn, ...]:
        system = (ChatTurn("system", self.system),) if self.system else ()
        return (*system, ChatTurn("user", self.text))


@dataclass(frozen=True)
class ChatAnswer:
    text: str
    # "EOS" (the model's end of turn), "LENGTH" (max_new_tokens reached), "STOP" (a stop string,
    # or the JSON Schema's value complete)
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_string: str | None = None


async def ask(client: ServerClient, question: Question, *, timeout: float, out: TextIO) -> ChatAnswer:
    """Send the question, write the answer's text to `out` as it streams in (then a newline), and
    return it; a failed call raises its EngineError (shared.errors), with the server's reason and
    message."""
    spec = ChatSpec(request_id=f"chat-{uuid.uuid4().hex[:12]}", messages=question.messages(),
                    max_new_tokens=question.max_new_tokens, temperature=question.temperature, seed=question.seed,
                    stop=question.stop, json_schema=question.json_schema, top_logprobs=question.top_logprobs)
    pieces: list[str] = []
    logprobs: list[TokenLogprob] = []
    finish_reason, tokens, stop_string = None, 0, None
    async for chunk in client.chat(spec, timeout=timeout):
        if chunk.text:
            out.write(chunk.text)
            out.flush()
            pieces.append(chunk.text)
        tokens += chunk.num_tokens
        logprobs.extend(chunk.logprobs)
        finish_reason = chunk.finish_reason or finish_reason
        stop_string = chunk.stop_string or stop_string
    out.write("\n")  # the answer's line ends now, before a managed engine's drain logs anything
    out.flush()
    return ChatAnswer("".join(pieces), finish_reason, tokens, tuple(logprobs), stop_string)


def logprob_lines(logprobs: tuple[TokenLogprob, ...]) -> list[str]:
    """One line per answer token: its text, its log-probability, then the alternatives."""
    return [f"{lp.text!r:>16} {lp.logprob:9.4f}  " + "  ".join(f"{text!r} {value:.4f}" for text, value in lp.top)
            for lp in logprobs]


# A one-question engine on loopback: a batch of one (a small KV cache); {model} from its settings.
MANAGED_LAUNCH = EngineLaunchConfig(
    command=("{python}", "-m", "engine_service", "--model", "{model}", "--host", "127.0.0.1", "--port", "{port}",
             "--max-batch", "1"),
    startup_timeout_s=120.0, drain_timeout_s=20.0, max_restarts=0)


@asynccontextmanager
async def managed_engine(model: str) -> AsyncIterator[str]:
    """Start a managed engine serving `model`, yield its target, drain it on the way out. An engine
    that does not become SERVING raises EngineStartError with its exit code and log tail."""
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as log_dir:
        engine = ManagedEngine(MANAGED_LAUNCH, {"model": model}, Path(log_dir) / "engine.log",
                               on_exit=lambda _exit: None, make_client=EngineClient)  # engine_process logs each exit already
        try:
            await engine.start()
            try:
                yield engine.target
            finally:
                await engine.stop()
        finally:
            await engine.close()


async def ask_engine(question: Question, *, target: str | None, model: str, timeout: float, out: TextIO) -> ChatAnswer:
    """Ask the engine at `target`, or a managed engine serving `model` when there is no target."""
    if target is not None:
        client = EngineClient(target)
        try:
            return await ask(client, question, timeout=timeout, out=out)
        finally:
            await client.close()
    async with managed_engine(model) as managed_target:
        return await ask_engine(question, target=managed_target, model=model, timeout=timeout, out=out)
