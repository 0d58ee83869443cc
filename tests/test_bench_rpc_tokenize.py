"""The gRPC adapter's prompts as text and chat, and its tokenize, against real engine processes: the
tiny model (byte tokenizer, BOS 256, no chat template) and a small Hugging Face checkpoint with a
chat template (its post-processor prepends <s>, id 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench_client.rpc import EngineClient
from bench_client.server_api import ChatTurn, Chunk, DecodeSpec
from engine.v1 import engine_pb2 as pb
from shared.errors import InvalidField
from tests.engines import EngineProcess
from tests.test_chat import write_chat_checkpoint

pytestmark = pytest.mark.timeout(120)

ClientOf = Callable[[EngineProcess], EngineClient]
MESSAGES = (ChatTurn("system", "be brief"), ChatTurn("user", "the quick brown fox"))


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat_engine(chat_checkpoint: Path) -> Iterator[EngineProcess]:
    with EngineProcess("--model", str(chat_checkpoint), "--max-batch", "2", "--max-context", "256") as proc:
        yield proc


@pytest.fixture
async def client_of() -> AsyncIterator[ClientOf]:
    made: list[EngineClient] = []

    def make(proc: EngineProcess) -> EngineClient:
        client = EngineClient(proc.address)
        made.append(client)
        return client
    yield make
    for client in made:
        await client.close()


def spec(**prompt: object) -> DecodeSpec:
    return DecodeSpec(request_id="r", prompt_token_ids=(), max_new_tokens=3, ignore_eos=True, temperature=0.0,
                      top_p=1.0, top_k=0, seed=1, **prompt)  # type: ignore[arg-type]


async def collect(stream: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in stream]


async def test_tokenize_drops_the_bos_the_engine_prepends(engine: EngineProcess, client_of: ClientOf) -> None:
    raw = engine.stub().Tokenize(pb.TokenizeRequest(text="héllo"), timeout=10)
    assert list(raw.token_ids) == [256, *"héllo".encode()]  # the engine's answer: BOS first
    assert await client_of(engine).tokenize("héllo") == list("héllo".encode())


async def test_tokenize_with_a_checkpoint_tokenizer(chat_engine: EngineProcess, chat_checkpoint: Path,
                                                    client_of: ClientOf) -> None:
    text = "the quick brown fox jumps"
    own = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    raw = chat_engine.stub().Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    assert list(raw.token_ids) == [1, *own]
    assert await client_of(chat_engine).tokenize(text) == own


async def test_an_empty_text_is_the_engines_invalid_field(engine: EngineProcess, client_of: ClientOf) -> None:
    with pytest.raises(InvalidField) as caught:
        await client_of(engine).tokenize("")
    assert caught.value.field == "text" and caught.value.message == "text must not be empty, got ''"


async def test_a_text_prompt_is_the_engines_prompt_text(engine: EngineProcess, client_of: ClientOf) -> None:
    chunks = await collect(client_of(engine).decode(spec(prompt_text="hello"), timeout=30))
    assert sum(c.num_tokens for c in chunks) == 3 and chunks[-1].finish_reason == "LENGTH"
    assert chunks[-1].prompt_tokens == 6  # BOS and the five bytes: the engine tokenized the text


async def test_messages_are_the_engines_chat(chat_engine: EngineProcess, client_of: ClientOf) -> None:
    rendered = chat_engine.stub().Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[
        pb.ChatMessage(role=m.role, content=m.content) for m in MESSAGES])), timeout=10)
    chunks = await collect(client_of(chat_engine).decode(spec(messages=MESSAGES), timeout=30))
    assert sum(c.num_tokens for c in chunks) == 3 and chunks[-1].finish_reason == "LENGTH"
    assert chunks[-1].prompt_tokens == len(rendered.token_ids)  # the template's rendering, tokenized


async def test_messages_to_a_model_without_a_chat_template(engine: EngineProcess, client_of: ClientOf) -> None:
    with pytest.raises(InvalidField) as caught:
        await collect(client_of(engine).decode(spec(messages=MESSAGES), timeout=30))
    assert caught.value.field == "chat"
    assert caught.value.message == ("chat needs a model with a chat template, and the engine's model has none "
                                    "(ServerInfo.has_chat_template is false); send prompt_text or prompt_token_ids")
