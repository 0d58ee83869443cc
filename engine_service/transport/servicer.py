"""The boundary: bytes in, a frozen domain request inside, protobuf responses out.

Requests are decoded here (not by gRPC, which would answer UNKNOWN with the parser's text), parsed
once into `Request`, and every failure leaves through one place: `_abort`, with the status that
`shared.errors` assigns to the exception. Each Decode's end, whatever it was, is told in one place
too: `RequestTelemetry.finish` (the `request_finished` event, the metrics, the server span).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import structlog
from google.protobuf.message import DecodeError

from engine.v1 import engine_pb2 as pb
from engine_service import __version__
from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs
from engine_service.requests import Request, loggable_request_id, parse_tokenize
from engine_service.runtime.engine import Handle
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.metrics import EngineMetrics, disabled_meter
from engine_service.transport.telemetry import RequestOutcome, RequestTelemetry, log_request_text
from shared.engine_channel import REPLICA_HEADER
from shared.errors import EngineError, InternalError, InvalidField, status_code_of, to_status
from shared.tracing import extract_context, log_ids

log = structlog.get_logger()

SERVICE_NAME = "engine.v1.EngineService"
FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
}
FINISH_REASON_NAMES = {wire: reason.value for reason, wire in FINISH_REASONS.items()}


def _parse_bytes(cls, raw: bytes):  # type: ignore[no-untyped-def]
    try:
        return cls.FromString(raw)
    except DecodeError as err:
        raise InvalidField("request", f"{len(raw)} bytes",
                           f"request must be a serialized {cls.DESCRIPTOR.full_name}, got {len(raw)} undecodable bytes ({err})") from None


async def _abort(context: grpc.aio.ServicerContext, err: EngineError) -> None:
    status = to_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)


class EngineServicer:
    def __init__(self, slot: EngineSlot, telemetry: RequestTelemetry | None = None, log_text: bool = False) -> None:
        self.slot = slot  # what it serves: LOADING until the engine is built, then READY
        self.log_text = log_text  # --log-text: prompt and output text in the log (debug only)
        self.telemetry = telemetry or RequestTelemetry(EngineMetrics(disabled_meter(), slot.load, slot.waiting))
        self.replica = ""  # this server's address, sent as `engine-replica` initial metadata (set once bound)

    async def decode(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        started = time.monotonic()
        span = self.telemetry.start_span("Decode", extract_context(context.invocation_metadata()))
        ids = log_ids(span)
        msg, request_id, handle, error, finish = None, "", None, None, None
        code = grpc.StatusCode.CANCELLED  # unless the request gets further
        try:
            if self.replica:  # which replica answers: a client behind round_robin cannot see its peer
                await context.send_initial_metadata(((REPLICA_HEADER, self.replica),))
            msg = _parse_bytes(pb.DecodeRequest, raw)
            request_id = loggable_request_id(msg.request_id)  # the raw one, capped and escaped until parsed
            engine = await self.slot.engine()
            remaining = context.time_remaining()
            deadline = started + remaining if remaining is not None else None
            loaded = engine.loaded
            request = Request.parse(msg, engine.limits, loaded.tokenizer, deadline, loaded.chat_template)
            request_id = request.request_id
            constraint = await engine.compile(request.response_format, request.request_id) \
                if request.response_format else None
            handle = engine.submit(request, trace=ids, constraint=constraint)
            async for response in self._stream(handle):
                if response.finish_reason:
                    finish = FINISH_REASON_NAMES[response.finish_reason]
                yield response
            code = grpc.StatusCode.OK
        except EngineError as err:
            error = err
        except Exception:  # the boundary's contract: a bug in one request's handling answers INTERNAL
            log.exception("request_internal_error", request_id=request_id, **ids)
            error = InternalError.build(request_id or "unassigned")
        finally:
            if handle is not None:
                self.slot.ready_engine().release(handle)
            if error is not None:
                code = status_code_of(error)
            self.telemetry.finish(span, RequestOutcome.of(request_id, code, error, started, handle, finish,
                                                          self.slot.model))
            if self.log_text and handle is not None:
                log_request_text(handle, self.slot.ready_engine().loaded.tokenizer, ids)
        if error is not None:
            await _abort(context, error)

    async def _stream(self, handle: Handle) -> AsyncIterator[pb.DecodeResponse]:
        seq = handle.seq
        piece = self.slot.ready_engine().loaded.tokenizer.piece
        while True:
            update = await handle.stream.next()
            response = pb.DecodeResponse(request_id=seq.request_id, token_ids=update.tokens, text=update.text,
                                         logprobs=_logprobs(update.logprobs, piece),
                                         prompt_logprobs=_logprobs(update.prompt_logprobs, piece))
            if update.error is not None:
                if update.tokens:
                    yield response
                raise update.error
            if update.finish is not None:
                t = seq.timings
                response.finish_reason = FINISH_REASONS[update.finish]
                if seq.controls.text is not None and seq.controls.text.stop_string is not None:
                    response.stop_string = seq.controls.text.stop_string
                response.usage.prompt_tokens = len(seq.request.prompt_ids)
                response.usage.completion_tokens = len(seq.generated)
                response.usage.cached_prompt_tokens = seq.cached_tokens
                response.usage.speculative_draft_tokens = seq.controls.draft_tokens
                response.usage.speculative_accepted_tokens = seq.controls.accepted_tokens
                response.timing.queue_seconds = (t.prefill_started or t.accepted) - t.accepted
                response.timing.time_to_first_token_seconds = (t.first_token or t.accepted) - t.accepted
                response.timing.total_seconds = (t.last_token or t.accepted) - t.accepted
                yield response
                return
            if update.tokens or update.text or update.prompt_logprobs:
                yield response

    async def tokenize(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            msg = _parse_bytes(pb.TokenizeRequest, raw)
            engine = await self.slot.engine()
            loaded = engine.loaded
            ids = parse_tokenize(msg, engine.limits, loaded.tokenizer, loaded.chat_template)
            return pb.TokenizeResponse(token_ids=ids, pieces=[loaded.tokenizer.piece(i) for i in ids])
        except EngineError as err:
            error = err
        except Exception:  # the boundary's contract, as Decode's: a bug answers INTERNAL
            log.exception("tokenize_internal_error")
            error = InternalError.build("tokenize")
        await _abort(context, error)
        raise AssertionError("context.abort returned")  # it raises: grpc.aio ends the call there

    async def get_server_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        try:
            _parse_bytes(pb.GetServerInfoRequest, raw)
        except EngineError as err:
            await _abort(context, err)
        info = (await self.slot.engine()).info
        return pb.ServerInfo(
            model=info.model, max_context_tokens=info.max_context_tokens,
            max_new_tokens_limit=info.max_new_tokens_limit, max_batch_size=info.max_batch_size,
            queue_capacity=info.queue_capacity, vocab_size=info.vocab_size,
            eos_token_id=info.eos_token_id if info.eos_token_id is not None else 0,
            bos_token_id=info.bos_token_id if info.bos_token_id is not None else 0,
            device=info.device, dtype=info.dtype, tokenizer=info.tokenizer, engine_version=__version__,
            has_chat_template=info.has_chat_template, quantization=info.quantization,
            cpu_capability=info.cpu_capability, precision_reason=info.precision_reason,
        )

    async def get_load(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.Load:
        try:
            _parse_bytes(pb.GetLoadRequest, raw)
        except EngineError as err:
            await _abort(context, err)
        load = self.slot.load()
        return pb.Load(
            running_sequences=load.running_sequences, waiting_requests=self.slot.waiting(),
            kv_cache_used_tokens=load.kv_cache_used_tokens, kv_cache_capacity_tokens=load.kv_cache_capacity_tokens,
            requests_finished=load.requests_finished, draining=self.slot.draining,
            prefix_cache_used_tokens=load.prefix_cache.used_tokens,
            prefix_cache_capacity_tokens=load.prefix_cache.capacity_tokens,
        )

    def handler(self) -> grpc.GenericRpcHandler:
        """Handlers that take raw bytes, so that undecodable requests get our INVALID_ARGUMENT."""
        handlers = {
            "Decode": grpc.unary_stream_rpc_method_handler(
                self.decode, response_serializer=pb.DecodeResponse.SerializeToString),
            "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                self.get_server_info, response_serializer=pb.ServerInfo.SerializeToString),
            "GetLoad": grpc.unary_unary_rpc_method_handler(
                self.get_load, response_serializer=pb.Load.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.tokenize, response_serializer=pb.TokenizeResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)




def _logprobs(values: Sequence[TokenLogprobs], piece: Callable[[int], str]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=v.token_id, text=piece(v.token_id), logprob=v.logprob,
                            top=[pb.TopLogprob(token_id=t, text=piece(t), logprob=lp) for t, lp in v.top])
            for v in values]
