"""The edge: the only module of the client that touches gRPC stubs and protobuf messages.

It turns domain requests into protobuf, protobuf responses into frozen domain values, and every
failed call into the domain exception of `shared.errors` (with reason, metadata and retry delay),
so the sweep logic above it decides on domain values alone.

What it sends: `decode` of a DecodeSpec is one Decode call whose `prompt` is the spec's
`prompt_token_ids`, its `prompt_text` (the engine tokenizes it, BOS prepended where its tokenizer
has one) or its `chat` messages (the engine renders the model's chat template); `chat` (the
preview) sends a ChatSpec's messages; `tokenize` is the Tokenize call with `text`, its answer less
the leading BOS the engine prepends, so that the count is the text's own (as llama-server's and
vLLM's /tokenize give it). Unlike the HTTP adapter, this one never sends a call twice: the
channel keeps its own HTTP/2 connections and reconnects by itself.

It also owns the transport and the CLIENT span of each Decode. The channel is the one every
Python caller of the engine gets from `shared.engine_channel` (round_robin over the target's
addresses with client-side health checking, TLS, the bearer token as call metadata); each Decode
stream knows the replica that answered it (`DecodeStream.replica`). The span is
a child of the current span (the sweep's point), whose W3C traceparent travels in the call's
metadata so the engine's SERVER span continues it. With tracing off the spans are the API's no-ops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from bench_client.credentials import ChannelSecurity, TlsConfig
from bench_client.server_api import (
    ChatSpec,
    Chunk,
    DecodeSpec,
    DecodeStream,
    EngineTiming,
    ServerInfo,
    TokenLogprob,
    poll_until_serving,
)
from engine.v1 import engine_pb2, engine_pb2_grpc
from shared.engine_channel import SERVICE_NAME, EngineChannel, EngineTls, open_engine_channel, replica_of
from shared.errors import from_rpc_error, status_code_of
from shared.tracing import inject_metadata, rpc_attributes, set_rpc_outcome

tracer = trace.get_tracer("bench_client")


@dataclass(frozen=True)
class ServerLoad:
    running_sequences: int
    waiting_requests: int
    kv_cache_used_tokens: int
    kv_cache_capacity_tokens: int
    requests_finished: int
    draining: bool


class EngineClient:
    """One grpc.aio channel to the target (one engine or several replicas, round_robin with health
    checking); TLS and a bearer token as `security` says. The token goes on EngineService calls
    only (health is open)."""

    def __init__(self, target: str, security: ChannelSecurity | None = None) -> None:
        self.target = target
        security = security or ChannelSecurity()
        self._engine: EngineChannel = open_engine_channel(target, token=security.token, tls=engine_tls(security.tls))
        self._channel = self._engine.channel
        self._metadata = self._engine.metadata
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._bos_token_id: int | None = None  # GetServerInfo's, once tokenize asked for it

    async def close(self) -> None:
        await self._channel.close()

    async def server_info(self, timeout: float = 10.0) -> ServerInfo:
        try:
            info = await self._stub.GetServerInfo(engine_pb2.GetServerInfoRequest(), timeout=timeout,
                                                  metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        return ServerInfo(
            model=info.model, max_context_tokens=info.max_context_tokens,
            max_new_tokens_limit=info.max_new_tokens_limit, max_batch_size=info.max_batch_size,
            queue_capacity=info.queue_capacity, vocab_size=info.vocab_size, eos_token_id=info.eos_token_id,
            bos_token_id=info.bos_token_id, device=info.device, dtype=info.dtype, tokenizer=info.tokenizer,
            engine_version=info.engine_version, has_chat_template=info.has_chat_template,
            quantization=info.quantization, cpu_capability=info.cpu_capability,
            precision_reason=info.precision_reason,
        )

    async def load(self, timeout: float = 10.0) -> ServerLoad:
        try:
            load = await self._stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        return ServerLoad(
            running_sequences=load.running_sequences, waiting_requests=load.waiting_requests,
            kv_cache_used_tokens=load.kv_cache_used_tokens, kv_cache_capacity_tokens=load.kv_cache_capacity_tokens,
            requests_finished=load.requests_finished, draining=load.draining,
        )

    async def is_serving(self, timeout: float = 2.0) -> bool:
        """One health check of the engine service; False while it is down or not SERVING."""
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        try:
            response = await self._health.Check(request, timeout=timeout)
        except grpc.aio.AioRpcError:
            return False  # down, unreachable or NOT_FOUND: all mean "not serving yet"
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_until_serving(self, timeout: float, poll_s: float = 0.2) -> bool:
        """Poll health until SERVING or `timeout` seconds passed; returns whether it did."""
        return await poll_until_serving(self.is_serving, timeout, poll_s)

    def decode(self, spec: DecodeSpec, *, timeout: float,
               attributes: Mapping[str, AttributeValue] | None = None) -> DecodeStream:
        """Stream the chunks of one Decode call of `spec`'s prompt (ids, text or chat messages)
        inside its CLIENT span (a child of the current span, with `attributes` added); a failed call
        raises its EngineError (a model without a chat template refuses messages: InvalidRequest)."""
        request = engine_pb2.DecodeRequest(
            request_id=spec.request_id,
            max_new_tokens=spec.max_new_tokens,
            sampling=engine_pb2.SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                               seed=spec.seed),
            ignore_eos=spec.ignore_eos,
            **_prompt(spec),
        )
        span_attributes: dict[str, AttributeValue] = {
            **_DECODE_ATTRIBUTES, "gen_ai.operation.name": "chat" if spec.messages else "text_completion",
            "gen_ai.request.max_tokens": spec.max_new_tokens, "bench.request.id": spec.request_id}
        if spec.prompt_token_ids:
            span_attributes["gen_ai.usage.input_tokens"] = len(spec.prompt_token_ids)
        return self._stream(request, timeout, {**span_attributes, **(attributes or {})})

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        """The ids the engine's tokenizer gives `text` alone (the Tokenize call): the engine prepends
        BOS where its tokenizer has one, as for a Decode prompt_text; a first id equal to
        GetServerInfo's `bos_token_id` (asked once; 0, "none", is never dropped) is dropped, so that
        the count is the text's own. A failed call raises its EngineError (an empty text, or one that
        tokenizes to nothing: InvalidField)."""
        if self._bos_token_id is None:
            self._bos_token_id = (await self.server_info(timeout)).bos_token_id
        try:
            answer = await self._stub.Tokenize(engine_pb2.TokenizeRequest(text=text), timeout=timeout,
                                               metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        ids = list(answer.token_ids)
        if ids and self._bos_token_id and ids[0] == self._bos_token_id:
            del ids[0]
        return ids

    def chat(self, spec: ChatSpec, *, timeout: float) -> DecodeStream:
        """Stream the answer to chat messages (the engine renders the model's chat template), as
        `decode` streams; a model without a chat template raises InvalidRequest (INVALID_FIELD)."""
        request = engine_pb2.DecodeRequest(
            request_id=spec.request_id,
            chat=engine_pb2.ChatPrompt(messages=[engine_pb2.ChatMessage(role=m.role, content=m.content)
                                                 for m in spec.messages]),
            max_new_tokens=spec.max_new_tokens,
            sampling=engine_pb2.SamplingParams(temperature=spec.temperature, top_p=1.0, top_k=0, seed=spec.seed),
            stop=spec.stop, top_logprobs=spec.top_logprobs,
            response_format=engine_pb2.ResponseFormat(json_schema=spec.json_schema)
            if spec.json_schema is not None else None,
        )
        return self._stream(request, timeout, {
            **_DECODE_ATTRIBUTES, "gen_ai.operation.name": "chat", "gen_ai.request.max_tokens": spec.max_new_tokens,
            "bench.request.id": spec.request_id})

    def _stream(self, request: engine_pb2.DecodeRequest, timeout: float,
                attributes: Mapping[str, AttributeValue]) -> DecodeStream:
        stream = DecodeStream()
        stream._chunks = self._chunks(request, timeout, attributes, stream)  # the stream it fills in
        return stream

    async def _chunks(self, request: engine_pb2.DecodeRequest, timeout: float,
                      attributes: Mapping[str, AttributeValue], stream: DecodeStream) -> AsyncIterator[Chunk]:
        # Not made current: an async generator may be finished in another context than it started in.
        span = tracer.start_span(_DECODE_SPAN, kind=trace.SpanKind.CLIENT)
        if span.is_recording():
            span.set_attributes(attributes)
            metadata = inject_metadata(self._metadata, trace.set_span_in_context(span))
        else:
            metadata = list(self._metadata)
        call = self._stub.Decode(request, timeout=timeout, metadata=metadata)
        output_tokens, input_tokens, cached_tokens = 0, None, None
        try:
            async for message in call:
                chunk = _chunk(message, time.perf_counter())
                if stream.replica is None:
                    stream.replica = replica_of(await call.initial_metadata())
                output_tokens += chunk.num_tokens
                input_tokens = chunk.prompt_tokens or input_tokens
                if chunk.cached_prompt_tokens is not None:
                    cached_tokens = chunk.cached_prompt_tokens
                yield chunk
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err)
            if stream.replica is None:  # empty when the call never reached an engine
                stream.replica = replica_of(await call.initial_metadata())
            set_rpc_outcome(span, status_code_of(error), error.reason, error.message, server=False)
            raise error from err
        except (asyncio.CancelledError, GeneratorExit):
            # The point ended while this call was in flight (a skip, a stop): say so on the span.
            set_rpc_outcome(span, grpc.StatusCode.CANCELLED, "", "cancelled by the client", server=False)
            raise
        else:
            set_rpc_outcome(span, grpc.StatusCode.OK, server=False)
        finally:
            call.cancel()  # a no-op once the call ended; frees the engine's sequence if we stop early
            span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
            if input_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", input_tokens)  # as the engine counted them
            if cached_tokens is not None:  # of the input tokens, those served from the engine's prefix cache
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached_tokens)
            span.end()


_DECODE_SPAN = "engine.v1.EngineService/Decode"
_DECODE_ATTRIBUTES = rpc_attributes("Decode")


def _prompt(spec: DecodeSpec) -> dict[str, engine_pb2.TokenIds | engine_pb2.ChatPrompt | str]:
    """The DecodeRequest's `prompt` oneof for a DecodeSpec (it has exactly one of the three)."""
    if spec.messages:
        return {"chat": engine_pb2.ChatPrompt(messages=[engine_pb2.ChatMessage(role=m.role, content=m.content)
                                                        for m in spec.messages])}
    if spec.prompt_text:
        return {"prompt_text": spec.prompt_text}
    return {"prompt_token_ids": engine_pb2.TokenIds(ids=spec.prompt_token_ids)}


def engine_tls(tls: TlsConfig | None) -> EngineTls | None:
    """The client's TLS settings as the shared channel helper takes them (None: plaintext)."""
    if tls is None:
        return None
    return EngineTls(ca_pem=tls.ca_pem, cert_pem=tls.cert_pem, key_pem=tls.key_pem, server_name=tls.server_name)


def _chunk(message: engine_pb2.DecodeResponse, received_at: float) -> Chunk:
    last = message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
    return Chunk(
        received_at=received_at,
        num_tokens=len(message.token_ids),
        text=message.text,
        finish_reason=engine_pb2.FinishReason.Name(message.finish_reason).removeprefix("FINISH_REASON_")
        if last else None,
        prompt_tokens=message.usage.prompt_tokens if message.HasField("usage") else None,
        completion_tokens=message.usage.completion_tokens if message.HasField("usage") else None,
        cached_prompt_tokens=message.usage.cached_prompt_tokens if message.HasField("usage") else None,
        timing=EngineTiming(
            queue_seconds=message.timing.queue_seconds,
            time_to_first_token_seconds=message.timing.time_to_first_token_seconds,
            total_seconds=message.timing.total_seconds,
        ) if message.HasField("timing") else None,
        logprobs=tuple(TokenLogprob(lp.text, lp.logprob, tuple((t.text, t.logprob) for t in lp.top))
                       for lp in message.logprobs),
        stop_string=message.stop_string or None,
    )
