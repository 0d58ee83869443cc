"""The sweep's tokenizer: what builds text prompts of exact token lengths and counts their tokens.

The sweep TOML names it (`tokenizer = ...`); without one the sweep asks the server.
- `load_tokenizer(spec, base_dir=...)` -> a `LocalTokenizer` (the `tokenizers` library, in process):
  `spec` is "smollm2" (the packaged GGUF the engine serves), a `tokenizer.json`, a Hugging Face
  checkpoint folder (its `tokenizer.json`) or a `.gguf` file (its `tokenizer.ggml.*` metadata, built
  by the engine's own builder, so client and engine tokenize alike). A relative path is relative to
  `base_dir` (the sweep file's folder). Anything else: ConfigError naming the key and the value.
- `ServerTokenizer(client, name)`: the server's tokenize endpoint (vLLM's and llama-server's
  `POST /tokenize`) behind the same interface; it cannot decode and knows no vocabulary size, and it
  remembers the answer for each text it has asked about (the last `CACHE_SIZE` texts).

Both encode without special tokens (no BOS): a prompt's length is the tokens of its text alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

from bench_client.config_fields import ConfigError

TOKENIZER_FILE = "tokenizer.json"
PACKAGED_NAME = "smollm2"
CACHE_SIZE = 4096


class PromptTokenizer(Protocol):
    name: str  # what it is, for the records and the log
    vocab_size: int | None  # None when unknown (a server's endpoint)
    special_ids: frozenset[int]  # ids never to sample into a random prompt (BOS, EOS, added special tokens)
    can_decode: bool

    async def encode(self, text: str) -> list[int]:
        """The text's ids, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The ids' text (special tokens spelled out); only where `can_decode`."""
        ...


class LocalTokenizer:
    """A `tokenizers.Tokenizer` in process. `special_ids` are its added special tokens (for a GGUF:
    its control tokens, BOS and EOS among them); `vocab_size` counts added tokens too."""

    can_decode = True

    def __init__(self, tokenizer: Tokenizer, name: str) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self.vocab_size: int | None = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    async def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class TokenizeClient(Protocol):
    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        """The server's ids for `text`; raises bench_client.server_api.NoTokenizeEndpoint where it has none."""
        ...


class ServerTokenizer:
    """The server's tokenize endpoint, through any object with `async tokenize(text, timeout)` (the
    adapters). Its errors (NoTokenizeEndpoint, the adapter's EngineError) reach the caller as they are."""

    can_decode = False
    vocab_size: int | None = None
    special_ids: frozenset[int] = frozenset()

    def __init__(self, client: TokenizeClient, name: str) -> None:
        self.name = name
        self._client = client
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.calls = 0  # how many times the server was asked (cache misses)

    async def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            self.calls += 1
            ids = tuple(await self._client.tokenize(text))
            self._cache[text] = ids
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        raise TypeError(f"{self.name} cannot decode token ids (it only tokenizes)")


def _refuse(spec: str, why: str) -> ConfigError:
    return ConfigError(f'tokenizer {spec!r} is not a tokenizer.json, a checkpoint folder with one, a .gguf file '
                       f'or "{PACKAGED_NAME}": {why}')


def _from_json(spec: str, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except OSError as err:
        raise _refuse(spec, f"{str(path)!r} cannot be read: {err}") from err
    except Exception as err:
        # tokenizers raises a bare Exception for every file it cannot parse; only that is renamed
        if type(err) is not Exception:
            raise
        raise _refuse(spec, f"{str(path)!r} is not a tokenizers file: {err}") from err


def _from_gguf(spec: str, path: Path) -> Tokenizer:
    # the engine's GGUF reader imports torch: only a GGUF tokenizer pays for it
    from engine_service.model.errors import CheckpointError
    from engine_service.model.gguf_reader import read_gguf
    from engine_service.model.gguf_tokenizer import build_gguf_tokenizer

    try:
        return build_gguf_tokenizer(read_gguf(path))
    except CheckpointError as err:
        raise _refuse(spec, str(err)) from err


def load_tokenizer(spec: str, *, base_dir: Path) -> LocalTokenizer:
    """The tokenizer `spec` names (see the module docstring); ConfigError naming `spec` and why not."""
    if spec == PACKAGED_NAME:
        from engine_service.model.errors import CheckpointError
        from engine_service.model.presets import PACKAGED

        try:
            path = PACKAGED[PACKAGED_NAME].locate(PACKAGED_NAME)
        except CheckpointError as err:
            raise _refuse(spec, str(err)) from err
        return LocalTokenizer(_from_gguf(spec, path), f"{PACKAGED_NAME} (GGUF {path})")
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise _refuse(spec, f"the folder {str(path)!r} has no {TOKENIZER_FILE}")
        return LocalTokenizer(_from_json(spec, file), f"{TOKENIZER_FILE} {file}")
    if not path.exists():
        raise _refuse(spec, f"{str(path)!r} does not exist")
    if path.suffix.lower() == ".gguf":
        return LocalTokenizer(_from_gguf(spec, path), f"GGUF {path}")
    return LocalTokenizer(_from_json(spec, path), f"{TOKENIZER_FILE} {path}")
