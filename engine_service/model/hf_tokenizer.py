"""A checkpoint's `tokenizer.json` (the `tokenizers` library) behind the ByteTokenizer interface,
and the choice between it and the byte-level fallback."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine_service.model.byte_tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
from engine_service.model.byte_tokenizer import ByteTokenizer
from engine_service.model.checkpoint_config import read_json
from engine_service.model.config import ModelConfig
from engine_service.model.errors import CheckpointError

log = structlog.get_logger()

TOKENIZER_FILE = "tokenizer.json"


class HFTokenizer:
    """`encode` applies the tokenizer's own post-processor (which adds BOS where the model expects
    it); `decode` and the stream decoder skip special tokens, as ByteTokenizer does."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None, kind: str = "tokenizer.json") -> None:
        self.kind = kind  # where it came from: "tokenizer.json", or "gguf" for a GGUF file's metadata
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._pieces: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self._tokenizer)

    def piece(self, token_id: int) -> str:
        """One id's own text, special tokens included (a part of a character decodes to U+FFFD);
        "" for an id past the tokenizer's vocabulary (a model's padding rows)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @property
    def json(self) -> str:
        """The tokenizer as tokenizer.json text (for the constrained-decoding compiler)."""
        return self._tokenizer.to_str()


class HFStreamDecoder:
    """Incremental detokenizer: text of an incomplete character (or word piece) is held back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, ids: Sequence[int]) -> str:
        chunks = (self._stream.step(self._tokenizer, token) for token in ids)
        return "".join(chunk for chunk in chunks if chunk is not None)


def _special_id(tokenizer: Tokenizer, value: Any) -> int | None:
    """The id of a tokenizer_config.json special token entry ("<s>" or {"content": "<s>", ...})."""
    content = value.get("content") if isinstance(value, dict) else value
    return tokenizer.token_to_id(content) if isinstance(content, str) else None


def load_tokenizer(directory: Path, config: ModelConfig) -> HFTokenizer | ByteTokenizer:
    """`directory/tokenizer.json`, or the byte tokenizer (logging `tokenizer_fallback`) when the
    directory has none and the model's vocabulary holds its 258 ids. BOS/EOS come from config.json,
    else from tokenizer_config.json."""
    path = directory / TOKENIZER_FILE
    if not path.exists():
        if config.vocab_size < BYTE_VOCAB_SIZE:
            raise CheckpointError(
                f"checkpoint directory {str(directory)!r} has no {TOKENIZER_FILE}, and its vocab_size "
                f"{config.vocab_size} is too small for the byte tokenizer's {BYTE_VOCAB_SIZE} ids"
            )
        log.warning("tokenizer_fallback", directory=str(directory), missing=TOKENIZER_FILE, tokenizer="byte",
                    vocab_size=config.vocab_size)
        return ByteTokenizer()
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every bad file; re-raised, named
        raise CheckpointError(f"checkpoint file {str(path)!r} is not a valid tokenizer: {err}") from err
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} has {size} tokens, more than the model's vocab_size {config.vocab_size}"
        )
    bos, eos = config.bos_token_id, config.eos_token_id
    config_path = directory / "tokenizer_config.json"
    if (bos is None or eos is None) and config_path.exists():
        tokenizer_config = read_json(config_path)
        bos = bos if bos is not None else _special_id(tokenizer, tokenizer_config.get("bos_token"))
        eos = eos if eos is not None else _special_id(tokenizer, tokenizer_config.get("eos_token"))
    return HFTokenizer(tokenizer, config.vocab_size, bos, eos)
