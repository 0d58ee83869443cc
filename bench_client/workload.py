"""The requests of a point: what each one sends (its prompt and its output length), built before the
point's clock starts, the same for every server of the sweep.

A point's requests come from the workload's dataset (config.py `[workload]`):
- `random` as `prompt_format = "text"` (the default): text of exactly `context_tokens` tokens by the
  sweep's tokenizer (datasets.random_items: vLLM's random dataset, made exact), lengths spread by
  `range_ratio`; as `prompt_format = "token_ids"`: token ids drawn below the vocabulary (prompts.py),
  for servers that take ids.
- `sharegpt`: ShareGPT V3's first human turns, output lengths from the first answers (vLLM's
  filters; `max_new_tokens` in the grid overrides them); `jsonl:PATH`: the file's lines.
Request i of a point is the same whatever the server: the items are drawn from seeds of (workload
seed, point tag, warmup or measured) and cached for the sweep, so a server that has no tokenizer of
its own gets the text the first one's tokenizer sized. The measured requests of two points differ
(their tags differ), so no point is served from a cache by an earlier point's prompts; with
`prefix_tokens`, request i starts with the shared prefix of group i % prefix_groups.

With `endpoint = "chat"` each prompt goes as one user message (a jsonl line's own messages as
they are): the server renders its chat template, and its usage counts the prompt it really ran.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from bench_client import datasets
from bench_client.config import CHAT, JSONL_PREFIX, RANDOM, SHAREGPT, TOKEN_IDS, WorkloadConfig
from bench_client.datasets import WorkItem
from bench_client.point_spec import PointSpec
from bench_client.prompts import make_prompt
from bench_client.server_api import ChatTurn, ServerInfo
from bench_client.tokenizer import PromptTokenizer

log = structlog.get_logger()


@dataclass(frozen=True)
class PointRequest:
    """One request of a point: exactly one of token ids, text or messages, as DecodeSpec takes them."""

    index: int
    max_new_tokens: int
    prompt_tokens: int  # by the sweep's tokenizer (ids: their number); the server's usage may differ (chat)
    token_ids: tuple[int, ...] = ()
    text: str = ""
    messages: tuple[ChatTurn, ...] = ()


class NoVocabulary(Exception):
    """`prompt_format = "token_ids"` with neither a tokenizer nor a server that reports its vocabulary."""


class PointPrompts:
    """The requests of every point of a sweep, built once per (point, warmup) and kept for the sweep."""

    def __init__(self, workload: WorkloadConfig) -> None:
        self.workload = workload
        self._built: dict[tuple[str, bool, int], list[PointRequest]] = {}
        self._jsonl: list[datasets.JsonlRequest] | None = None
        self._sharegpt_logged = False

    def check(self) -> None:
        """Read what can be read before any request (a jsonl file: every line validated); raises
        DatasetError naming the file, the line and the field."""
        if self.workload.dataset.startswith(JSONL_PREFIX) and self._jsonl is None:
            self._jsonl = datasets.read_jsonl(Path(self.workload.dataset.removeprefix(JSONL_PREFIX)))

    async def requests(self, spec: PointSpec, *, warmup: bool, count: int, tokenizer: PromptTokenizer | None,
                       server_info: ServerInfo) -> list[PointRequest]:
        """`count` requests of `spec` (warmup ones differ from measured ones); `tokenizer` sizes and
        counts text (None only for token ids, with the server's vocabulary)."""
        # token ids are drawn below a vocabulary: a server of another vocabulary gets its own
        vocab = self._vocabulary(tokenizer, server_info) if self.workload.prompt_format == TOKEN_IDS else 0
        key = (spec.tag(), warmup, vocab)
        built = self._built.get(key, [])
        if len(built) < count:
            built = await self._build(spec, warmup, count, tokenizer, server_info)
            self._built[key] = built
        return built[:count]

    async def _build(self, spec: PointSpec, warmup: bool, count: int, tokenizer: PromptTokenizer | None,
                     server_info: ServerInfo) -> list[PointRequest]:
        w = self.workload
        seed = f"{w.seed}:{spec.tag()}:{'warmup' if warmup else 'measured'}"
        if w.dataset == RANDOM:
            lengths = datasets.sample_lengths(spec.context_tokens, w.range_ratio, count, random.Random(seed))
            if w.prompt_format == TOKEN_IDS:
                return self._token_ids(spec, warmup, lengths, tokenizer, server_info)
            assert tokenizer is not None, "text prompts need a tokenizer (the sweep resolves one)"
            items: list[WorkItem | None] = [None] * count
            groups = spec.prefix_groups if spec.prefix_tokens else 1
            for group in range(groups):
                indices = range(group, count, groups)
                made = await datasets.random_items(tokenizer, lengths=[lengths[i] for i in indices],
                                                   seed=f"{seed}:{group}", prefix_tokens=spec.prefix_tokens,
                                                   prefix_group=group, prefix_seed=str(w.seed))
                for i, item in zip(indices, made, strict=True):
                    items[i] = item
            made_items = [item for item in items if item is not None]
        else:
            assert tokenizer is not None, "a dataset's prompts need a tokenizer (the sweep resolves one)"
            override = spec.max_new_tokens or None
            if w.dataset == SHAREGPT:
                self._log_sharegpt()
                made_items = await datasets.sharegpt_items(tokenizer, count=count, seed=seed, output_len=override)
            else:
                self.check()
                assert self._jsonl is not None
                made_items = await datasets.jsonl_items(self._jsonl, tokenizer, count=count, seed=seed)
        return [self._request(i, item, spec) for i, item in enumerate(made_items)]

    def _log_sharegpt(self) -> None:
        if not self._sharegpt_logged:
            self._sharegpt_logged = True
            read = datasets.read_sharegpt()
            log.info("sharegpt_read", conversations=read.read, usable=len(read.conversations), torn=read.torn,
                     path=read.source)

    def _request(self, index: int, item: WorkItem, spec: PointSpec) -> PointRequest:
        new_tokens = spec.max_new_tokens or item.max_new_tokens
        if not new_tokens:
            raise datasets.DatasetError(f"dataset {self.workload.dataset!r} item {index} has no max_tokens and "
                                        "the workload sets no max_new_tokens: give one of them")
        if item.messages or self.workload.endpoint == CHAT:
            messages = item.messages or (ChatTurn("user", item.text),)
            return PointRequest(index, new_tokens, item.prompt_tokens, messages=messages)
        return PointRequest(index, new_tokens, item.prompt_tokens, text=item.text)

    @staticmethod
    def _vocabulary(tokenizer: PromptTokenizer | None, server_info: ServerInfo) -> int:
        vocab = (tokenizer.vocab_size if tokenizer is not None else None) or server_info.vocab_size
        if not vocab:
            raise NoVocabulary(f"workload.prompt_format 'token_ids' needs the vocabulary size: the server "
                               f"({server_info.model or 'unnamed'}) does not report it; name a workload.tokenizer "
                               "(or set vocab_size in the server's table), or send text (prompt_format 'text')")
        return vocab

    def _token_ids(self, spec: PointSpec, warmup: bool, lengths: Sequence[int], tokenizer: PromptTokenizer | None,
                   server_info: ServerInfo) -> list[PointRequest]:
        vocab = self._vocabulary(tokenizer, server_info)
        avoid = {server_info.eos_token_id, server_info.bos_token_id}
        if tokenizer is not None:
            avoid |= set(tokenizer.special_ids)
        out = []
        for index, length in enumerate(lengths):
            ids = make_prompt(seed=self.workload.seed, length=length, index=-1 - index if warmup else index,
                              vocab_size=vocab, avoid=avoid, prefix_tokens=min(spec.prefix_tokens, length),
                              prefix_group=index % spec.prefix_groups, point=spec.tag())
            out.append(PointRequest(index, spec.max_new_tokens, len(ids), token_ids=ids))
        return out
