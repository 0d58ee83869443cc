"""The JSON of the OpenAI-compatible API, built and read (pure): the bodies the HTTP adapter
(bench_client/openai_http.py) posts, and the answers it reads about the server (/tokenize, /props,
/v1/models, /info, /version).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench_client.openai_errors import json_int, json_str, malformed_answer
from bench_client.server_api import OPENAI, ChatSpec, DecodeSpec, ServerInfo


def completion_body(spec: DecodeSpec, model: str | None) -> dict[str, Any]:
    """The JSON of POST /v1/completions for one DecodeSpec: its prompt as token ids (a list of ints)
    or as text (a string), with its sampling fields."""
    body = _model_field(model)
    body["prompt"] = list(spec.prompt_token_ids) if spec.prompt_token_ids else spec.prompt_text
    body.update(_sampling(spec))
    return body


def chat_body(spec: DecodeSpec | ChatSpec, model: str | None) -> dict[str, Any]:
    """The JSON of POST /v1/chat/completions: a DecodeSpec's messages with the sampling fields that
    `completion_body` sends, or a ChatSpec's (the preview: its temperature, and its stop strings, JSON
    schema and logprobs where it asks for them)."""
    body = _model_field(model)
    body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    if isinstance(spec, DecodeSpec):
        body.update(_sampling(spec))
        return body
    body.update({"max_tokens": spec.max_new_tokens, "temperature": spec.temperature, "seed": spec.seed,
                 "stream": True, "stream_options": {"include_usage": True}})
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.json_schema is not None:  # OpenAI's structured outputs, as vLLM and llama-server take them
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": json.loads(spec.json_schema)}}
    if spec.top_logprobs:
        body.update(logprobs=True, top_logprobs=spec.top_logprobs)
    return body


def _model_field(model: str | None) -> dict[str, Any]:
    return {"model": model} if model else {}


def _sampling(spec: DecodeSpec) -> dict[str, Any]:
    """A DecodeSpec's length, sampling and streaming fields, as both routes take them."""
    fields: dict[str, Any] = {
        "max_tokens": spec.max_new_tokens, "stream": True, "stream_options": {"include_usage": True},
        "temperature": spec.temperature, "top_p": spec.top_p, "seed": spec.seed,
    }
    if spec.top_k > 0:
        fields["top_k"] = spec.top_k
    if spec.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def tokenize_body(text: str, model: str | None) -> dict[str, Any]:
    """The JSON of POST /tokenize that each server reads its own fields of and ignores the others':
    llama-server `content` (no BOS: `add_special` is false by default), vLLM `prompt` and
    `add_special_tokens` (false: no BOS) and `model` (its pydantic models allow extra fields), TGI
    `inputs` (a GenerateRequest; it always adds its tokenizer's special tokens: `token_ids_from`
    drops them)."""
    body = _model_field(model)
    body.update({"content": text, "prompt": text, "inputs": text, "add_special_tokens": False})
    return body


def token_ids_from(body: bytes, url: str) -> list[int]:
    """The ids of a 200 answer of POST /tokenize: `{"tokens": [ids]}` (llama-server; vLLM adds
    `count` and `max_model_len`; llama-server's `with_pieces` form `{"tokens": [{"id", "piece"}]}`),
    or TGI's list of `{"id", "text", "start", "stop"}`, less the special tokens its tokenizer added
    at either end (an empty span: start == stop, the BOS or EOS that no character of the text made).
    Raises TransportError (`malformed_answer`) for any other shape."""
    try:
        answer = json.loads(body)
    except ValueError:
        raise malformed_answer(url, body, "not JSON") from None
    if isinstance(answer, list):  # TGI
        spans = [item for item in answer if isinstance(item, Mapping)]
        if len(spans) != len(answer) or not all(_is_id(t.get("id")) for t in spans):
            raise malformed_answer(url, body, "a list of tokens without ids")
        start, stop = 0, len(spans)
        while start < stop and spans[start].get("start") == spans[start].get("stop"):
            start += 1
        while stop > start and spans[stop - 1].get("start") == spans[stop - 1].get("stop"):
            stop -= 1
        return [t["id"] for t in spans[start:stop]]
    tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
    if not isinstance(tokens, list):
        raise malformed_answer(url, body, "no tokens")
    ids = [t.get("id") if isinstance(t, Mapping) else t for t in tokens]
    if not all(_is_id(i) for i in ids):
        raise malformed_answer(url, body, "a token that is not an id")
    return ids


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def server_info_from(reported: Mapping[str, Any], *, model: str | None, vocab_size: int | None) -> ServerInfo:
    """The ServerInfo of the answers of /props, /v1/models, /info and /version (those that came)."""
    props = _mapping(reported.get("props"))
    models = _mapping(reported.get("models"))
    info = _mapping(reported.get("info"))
    version = _mapping(reported.get("version"))
    data = models.get("data")
    first = _mapping(data[0]) if isinstance(data, list) and data else {}
    meta = _mapping(first.get("meta"))
    settings = _mapping(props.get("default_generation_settings"))
    name = (model or json_str(first.get("id")) or json_str(info.get("model_id")) or json_str(props.get("model_alias"))
            or Path(json_str(props.get("model_path")) or "").name)
    context = (json_int(settings.get("n_ctx")) or json_int(meta.get("n_ctx")) or json_int(first.get("max_model_len"))
               or json_int(info.get("max_total_tokens")) or 0)
    vocab = json_int(meta.get("n_vocab")) or vocab_size or 0  # 0: not reported (vLLM, SGLang, TGI)
    is_llama = bool(props) and "total_slots" in props
    return ServerInfo(
        model=name, max_context_tokens=context, max_new_tokens_limit=0,
        max_batch_size=json_int(props.get("total_slots")) or 0, queue_capacity=0, vocab_size=vocab,
        eos_token_id=-1, bos_token_id=-1, device="", dtype=json_str(props.get("model_ftype")) or "",
        tokenizer=json_str(info.get("model_id")) or "",
        engine_version=(json_str(props.get("build_info")) or json_str(info.get("version")) or json_str(version.get("version"))
                        or ""),
        # llama-server says whether it has a template; the others serve chat when the model has one
        has_chat_template=bool(props.get("chat_template")) if is_llama else True,
        api=OPENAI, reported=dict(reported),
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
