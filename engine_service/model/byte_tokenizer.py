"""The built-in byte-level tokenizer: ids 0..255 are bytes, then BOS and EOS."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """UTF-8 bytes as tokens. Special tokens detokenize to nothing."""

    kind = "byte"
    vocab_size = VOCAB_SIZE
    bos_token_id: int | None = BOS_ID
    eos_token_id: int | None = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes, after BOS unless `add_special_tokens` is False."""
        return [BOS_ID, *text.encode("utf-8")] if add_special_tokens else list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()

    def piece(self, token_id: int) -> str:
        """One id's own text: its byte (U+FFFD when it is part of a character), "<s>" and "</s>"
        for BOS and EOS."""
        if token_id < 256:
            return bytes([token_id]).decode("utf-8", errors="replace")
        return {BOS_ID: "<s>", EOS_ID: "</s>"}.get(token_id, "")


class ByteStreamDecoder:
    """Incremental detokenizer: bytes of an incomplete UTF-8 character are held back."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if i < 256))
