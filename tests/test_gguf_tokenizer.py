"""A SentencePiece-style (`llama`) GGUF tokenizer tokenizes as transformers' does for the same file:
merges recovered from the scores, byte fallback for characters outside the vocabulary, the `▁`
prefix, BOS added. (The `gpt2` kind is held to SmolLM2 in test_gguf_parity.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gguf import GGUFWriter, TokenType

from engine_service.model.errors import CheckpointError
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.gguf_tokenizer import build_gguf_tokenizer
from tests.gguf_files import hf_gguf_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "The Quick Brown Fox",
    "  two leading spaces and trailing  ",
    "naïve café 🙂 東京",  # characters outside the vocabulary: byte fallback
    "quickly, the fox; the dog!",
    "",
]


def _pieces() -> list[str]:
    words = {"▁" + w for text in TEXTS[:2] for w in text.lower().split()} | {"▁"}
    pieces = {word[i:j] for word in words for i in range(len(word)) for j in range(i + 1, min(len(word), i + 4) + 1)}
    pieces |= set("abcdefghijklmnopqrstuvwxyzTQBF,;!é") | {"▁▁"}
    return sorted(pieces)


def write_spm_gguf(path: Path, *, model: str = "llama") -> Path:
    pieces = _pieces()
    rng = random.Random(0)
    scores = rng.sample(range(-10_000, 0), len(pieces))  # distinct: the merge order is then unambiguous
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256,
             *[TokenType.NORMAL] * len(pieces)]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [float(s) for s in scores])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_gguf_tokenizes_as_transformers(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "spm.gguf")
    ours = build_gguf_tokenizer(read_gguf(path))
    theirs = hf_gguf_tokenizer(path)
    for text in TEXTS:
        expected = theirs(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected, skip_special_tokens=True) == theirs.decode(expected, skip_special_tokens=True)
    assert ours.encode("the fox").ids[0] == 1  # BOS
    assert any(3 <= t < 259 for t in ours.encode("🙂").ids)  # byte fallback


def test_an_unsupported_tokenizer_model_is_refused_by_name(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "t5.gguf", model="t5")
    with pytest.raises(CheckpointError, match=r"tokenizer model 't5' is not supported \(supported: gpt2, llama\)"):
        build_gguf_tokenizer(read_gguf(path))
