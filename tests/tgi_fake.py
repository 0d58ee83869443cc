"""A fake TGI (text-generation-inference 3.x's router) on 127.0.0.1, an aiohttp.web app shaped after
its source (router/src/server.rs, lib.rs, chat.rs, validation.rs, infer/mod.rs), for the client's
tests: `async with tgi_fake() as tgi:` gives a running `TgiFake` (its `url`, and the `requests` it
received); `start_tgi_fake()` returns `(url, stop)` for a caller that manages the lifetime itself.

What it answers as TGI does:

- GET /info (`model_id`, `max_input_tokens`, `max_total_tokens`, `version`...: no vocabulary),
  GET /v1/models (`{"object": "list", "data": [{"id", "object", "created", "owned_by"}]}`: no
  `max_model_len`), GET /health (200, empty);
- a body that axum's `Json` extractor refuses: 422, text/plain, `Failed to deserialize the JSON body
  into the target type: <serde_path_to_error's path>: <serde's message> at line 1 column <N>`
  (`prompt` of token ids: "prompt: data did not match any variant of untagged enum
  PromptDeserializer", for TGI's `prompt` is a string or a list of strings only; serde's wording for
  other type errors, of `messages` or `inputs`, is approximated); 400 for a body that is not JSON;
  415 without `Content-Type: application/json`;
- POST /v1/completions: a string or a list of strings (one choice per string, `index`); streamed,
  each token an event `{"object": "text_completion", "choices": [{"text", "finish_reason": "", ...}]}`,
  the last with its finish_reason ("length", "eos_token") and `usage` in the same event, then
  `data: [DONE]`. `stream_options`, `top_k` and `ignore_eos` are not TGI's fields: ignored;
- POST /v1/chat/completions: deltas `{"role": "assistant", "content": ...}`, the last with
  finish_reason ("length", "stop"), then, when `stream_options.include_usage`, an event with
  `choices: []` and the usage; then `data: [DONE]`;
- validation (validation.rs) happens inside the stream for a streamed request: a 200 answer whose
  one event is `{"error": {"message": "Input validation error: <ValidationError>",
  "http_status_code": 422}}`, then `[DONE]` (infer/mod.rs, `into_openai_event`); unstreamed: 422
  `{"error": "Input validation error: ...", "error_type": "validation"}`. The rules kept: `top_p` in
  (0, 1) exclusive ("`top_p` must be > 0.0 and < 1.0": 1.0 is refused), temperature 0 means greedy
  and a negative one is refused, `max_tokens` > 0, input + max_new_tokens <= max_total_tokens, input
  < max_input_tokens;
- POST /tokenize (a GenerateRequest: `inputs` required, other fields ignored): a list of `{"id",
  "text", "start", "stop"}` (byte offsets), BOS first with an empty span (TGI always adds special
  tokens here).

Its tokenizer: one token per UTF-8 byte (id = byte + 3), BOS (1) prepended; EOS 2. Its model writes
WORDS in turn, one token each, `token_delay_s` apart.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BOS_ID, EOS_ID, BYTE_OFFSET = 1, 2, 3
WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")
_DESERIALIZE = "Failed to deserialize the JSON body into the target type"


class _Refused(Exception):
    """A request TGI refuses: `status` and the body it answers with."""

    def __init__(self, status: int, body: str | dict[str, Any]) -> None:
        super().__init__(body)
        self.status, self.body = status, body

    def response(self) -> web.Response:
        if isinstance(self.body, str):  # axum's rejections are plain text
            return web.Response(status=self.status, text=self.body, content_type="text/plain", charset="utf-8")
        return web.json_response(self.body, status=self.status)


class _Invalid(Exception):
    """A ValidationError: its Display text."""


@dataclass
class TgiFake:
    model_id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    max_input_tokens: int = 1024
    max_total_tokens: int = 2048
    max_client_batch_size: int = 4
    version: str = "3.3.6"
    token_delay_s: float = 0.0
    requests: list[tuple[str, Any]] = field(default_factory=list)  # (path, JSON body) as received
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/info", self._info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    # -- the routes ----------------------------------------------------------------------------

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_id": self.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": 128, "max_best_of": 2, "max_stop_sequences": 4,
            "max_input_tokens": self.max_input_tokens, "max_total_tokens": self.max_total_tokens,
            "validation_workers": 2, "max_client_batch_size": self.max_client_batch_size,
            "router": "text-generation-router", "version": self.version, "sha": None, "docker_label": None})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": self.model_id}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await self._json(request)
            prompts = _prompts(raw, body)
            if body.get("suffix") is not None:
                raise _Refused(422, {"error": "Suffix is not supported and can be achieved by preprocessing the "
                                              "prompt.", "error_type": "suffix not supported"})
            if len(prompts) > self.max_client_batch_size:
                raise _Refused(422, {"error": "Number of prompts exceeds the maximum allowed batch size of "
                                              f"{self.max_client_batch_size}", "error_type": "batch size exceeded"})
        except _Refused as refused:
            return refused.response()
        return await self._answer(request, body, [self.encode(p) for p in prompts], chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            raw, body = await self._json(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise _Refused(422, _rejection("messages: invalid type: expected a sequence of messages", raw))
        except _Refused as refused:
            return refused.response()
        rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return await self._answer(request, body, [self.encode(rendered + "<|im_start|>assistant\n")], chat=True)

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            raw, body = await self._json(request)
            if not isinstance(body.get("inputs"), str):
                message = ("missing field `inputs`" if "inputs" not in body
                           else "inputs: invalid type: expected a string")
                raise _Refused(422, _rejection(message, raw, at_end="inputs" not in body))
        except _Refused as refused:
            return refused.response()
        text: str = body["inputs"]
        tokens = [{"id": BOS_ID, "text": "", "start": 0, "stop": 0}]
        for at, byte in enumerate(text.encode()):
            tokens.append({"id": byte + BYTE_OFFSET, "text": bytes([byte]).decode("utf-8", "replace"),
                           "start": at, "stop": at + 1})
        return web.json_response(tokens)

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def encode(text: str) -> list[int]:
        return [BOS_ID, *(b + BYTE_OFFSET for b in text.encode())]

    async def _json(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        if request.content_type != "application/json":
            raise _Refused(415, "Expected request with `Content-Type: application/json`")
        raw = await request.text()
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise _Refused(400, f"Failed to parse the request body as JSON: {err}") from None
        if not isinstance(body, dict):
            raise _Refused(422, _rejection("invalid type: expected a struct", raw))
        self.requests.append((request.path, body))
        return raw, body

    def _validate(self, body: dict[str, Any], input_length: int) -> int:
        """The max_new_tokens of a valid request (validation.rs); raises _Invalid."""
        temperature = body.get("temperature")
        if temperature is not None and temperature != 0.0 and temperature <= 0:
            raise _Invalid("`temperature` must be strictly positive")
        top_p = body.get("top_p")
        if top_p is not None and (top_p <= 0.0 or top_p >= 1.0):
            raise _Invalid("`top_p` must be > 0.0 and < 1.0")
        max_tokens = body.get("max_tokens")
        if max_tokens == 0:
            raise _Invalid("`max_new_tokens` must be strictly positive")
        new = min(max_tokens, 1024) if max_tokens is not None else min(self.max_total_tokens - input_length, 1024)
        if input_length + new > self.max_total_tokens:
            raise _Invalid(f"`inputs` tokens + `max_new_tokens` must be <= {self.max_total_tokens}. Given: "
                           f"{input_length} `inputs` tokens and {new} `max_new_tokens`")
        if input_length > self.max_input_tokens:
            raise _Invalid(f"`inputs` must have less than {self.max_input_tokens} tokens. Given: {input_length}")
        return max_tokens if max_tokens is not None else self.max_total_tokens - input_length

    async def _answer(self, request: web.Request, body: dict[str, Any], inputs: list[list[int]], *,
                      chat: bool) -> web.StreamResponse:
        if not body.get("stream", False):
            return await self._whole(body, inputs, chat=chat)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "x-compute-type": "gpu+optimized", "X-Accel-Buffering": "no"})
        await response.prepare(request)

        async def send(event: dict[str, Any] | str) -> None:
            await response.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for index, ids in enumerate(inputs):
            try:
                new = self._validate(body, len(ids))
            except _Invalid as invalid:
                await send({"error": {"message": f"Input validation error: {invalid}", "http_status_code": 422}})
                continue
            for step in range(new):
                await asyncio.sleep(self.token_delay_s)
                last = step == new - 1
                text = WORDS[step % len(WORDS)]
                usage = {"prompt_tokens": len(ids), "completion_tokens": new, "total_tokens": len(ids) + new}
                if chat:
                    await send(self._chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": text},
                                                  "logprobs": None, "finish_reason": "length" if last else None}]))
                    if last and include_usage:
                        await send({**self._chat_chunk([]), "usage": usage})
                else:
                    event = {"object": "text_completion", "id": "", "created": int(time.time()),
                             "model": self.model_id, "system_fingerprint": self._fingerprint(),
                             "choices": [{"index": index, "text": text, "logprobs": None,
                                          "finish_reason": "length" if last else ""}]}
                    await send({**event, "usage": usage} if last else event)
        await send("[DONE]")
        await response.write_eof()
        return response

    async def _whole(self, body: dict[str, Any], inputs: list[list[int]], *, chat: bool) -> web.Response:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, ids in enumerate(inputs):
            try:
                new = self._validate(body, len(ids))
            except _Invalid as invalid:
                return web.json_response({"error": f"Input validation error: {invalid}", "error_type": "validation"},
                                         status=422)
            text = "".join(WORDS[step % len(WORDS)] for step in range(new))
            choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": "length"} if chat else
                           {"index": index, "text": text, "logprobs": None, "finish_reason": "length"})
            prompt_tokens, completion_tokens = prompt_tokens + len(ids), completion_tokens + new
        return web.json_response({
            "object": "chat.completion" if chat else "text_completion", "id": "", "created": int(time.time()),
            "model": self.model_id, "system_fingerprint": self._fingerprint(), "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})

    def _chat_chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "id": "", "created": int(time.time()), "model": self.model_id,
                "system_fingerprint": self._fingerprint(), "choices": choices, "usage": None}

    def _fingerprint(self) -> str:
        return f"{self.version}-native"


def _prompts(raw: str, body: dict[str, Any]) -> list[str]:
    """TGI's `Prompt`: a string or a non-empty list of strings; else axum's 422 (serde's message at
    the position after the value, as serde_json reports it)."""
    if "prompt" not in body:
        raise _Refused(422, _rejection("missing field `prompt`", raw, at_end=True))
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if not prompt:
            raise _Refused(422, _rejection("prompt: Empty array detected. Do not use an empty array for the prompt.",
                                           raw, value_of="prompt"))
        return prompt
    raise _Refused(422, _rejection("prompt: data did not match any variant of untagged enum PromptDeserializer",
                                   raw, value_of="prompt"))


def _rejection(message: str, raw: str, *, value_of: str | None = None, at_end: bool = False) -> str:
    """axum's JsonDataError text: its prefix, then serde_path_to_error's message with serde_json's
    position: the column of the last byte read, the end of the value (or of the body) in a one-line body."""
    column = len(raw.encode())
    if value_of is not None and not at_end:
        key = raw.index(json.dumps(value_of)) + len(json.dumps(value_of))
        start = raw.index(":", key) + 1
        while raw[start] in " \t\r\n":
            start += 1
        _, end = json.JSONDecoder().raw_decode(raw, start)
        column = len(raw[:end].encode())
    return f"{_DESERIALIZE}: {message} at line 1 column {column}"


@asynccontextmanager
async def tgi_fake(**settings: Any) -> AsyncIterator[TgiFake]:
    """A running TgiFake on 127.0.0.1 (port 0) with `settings` (TgiFake's fields), stopped at the end."""
    url, stop, fake = await _start(**settings)
    try:
        yield fake
    finally:
        await stop()


async def start_tgi_fake(**settings: Any) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Start a TgiFake with `settings`; its base URL and the coroutine function that stops it."""
    url, stop, _ = await _start(**settings)
    return url, stop


async def _start(**settings: Any) -> tuple[str, Callable[[], Awaitable[None]], TgiFake]:
    fake = TgiFake(**settings)
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return fake.url, runner.cleanup, fake
