"""Greedy decoding over gRPC equals transformers' `generate`, token for token, for concurrent
requests of different lengths, on checkpoints of each supported architecture."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.v1 import engine_pb2 as pb
from tests.checkpoints import ARCHS, PROMPTS, hf_greedy, hf_model, make_checkpoint
from tests.contract import decode, tokens_of
from tests.engines import EngineProcess

NEW_TOKENS = 16  # a request (32 before), each compared token by token; the prompts are of 2 to 51 tokens


def load_tokenizer_for(directory):  # type: ignore[no-untyped-def]
    from engine_service.model.loader import load_model

    return load_model(str(directory), torch.device("cpu"), torch.float32).tokenizer


class Served:
    """Each architecture's checkpoint (llama untied, the others tied) and the engine serving it."""

    def __init__(self, checkpoints: dict[str, Path], starting: dict[str, Future[EngineProcess]]) -> None:
        self.checkpoints = checkpoints
        self._starting = starting

    def engine(self, arch: str) -> EngineProcess:
        """The engine of `arch`'s checkpoint, once it is serving."""
        return self._starting[arch].result()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The three engines start at once, while the tests compute transformers' references, and each
    serves every test of the module that asks for its checkpoint. float32, as the reference computes
    (--dtype auto would pick bfloat16 on a CPU with native bfloat16)."""
    checkpoints = {arch: make_checkpoint(tmp_path_factory.mktemp(arch), arch, tied=arch != "llama") for arch in ARCHS}
    engines = {arch: EngineProcess("--model", str(directory), "--dtype", "float32", "--max-batch", "8",
                                   "--max-context", "256") for arch, directory in checkpoints.items()}
    with ThreadPoolExecutor(len(engines)) as pool:
        starting = {arch: pool.submit(engine.start) for arch, engine in engines.items()}
        try:
            yield Served(checkpoints, starting)
        finally:
            for future in starting.values():
                future.exception()  # each start has ended (serving, or failed and killed)
            for engine in engines.values():
                engine.kill()


@pytest.mark.parametrize("arch", ARCHS)
def test_grpc_greedy_equals_transformers_generate(arch, served):
    directory = served.checkpoints[arch]
    reference = hf_model(directory)
    prompts = [load_tokenizer_for(directory).encode(text) for text in PROMPTS]
    expected = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    proc = served.engine(arch)
    info = proc.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.tokenizer == "tokenizer.json" and info.model == directory.name

    def one(prompt: list[int]) -> list[int]:
        return tokens_of(decode(proc.stub(), prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=NEW_TOKENS,
                                ignore_eos=True))

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == expected


def test_prompt_text_goes_through_the_checkpoint_tokenizer(served):
    """On the engine of the llama checkpoint that the greedy test serves (one start for both)."""
    proc = served.engine("llama")
    responses = decode(proc.stub(), prompt_text="the quick brown fox", max_new_tokens=8, ignore_eos=True)
    assert responses[-1].usage.prompt_tokens > 1
    assert len(tokens_of(responses)) == 8
