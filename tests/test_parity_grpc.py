"""Greedy decoding over gRPC equals transformers' `generate`, token for token, for concurrent
requests of different lengths, on checkpoints of each supported architecture."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.v1 import engine_pb2 as pb
from tests.checkpoints import ARCHS, PROMPTS, hf_greedy, hf_model, make_checkpoint
from tests.contract import decode, tokens_of

NEW_TOKENS = 32


def load_tokenizer_for(directory):  # type: ignore[no-untyped-def]
    from engine_service.model.loader import load_model

    return load_model(str(directory), torch.device("cpu"), torch.float32).tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_grpc_greedy_equals_transformers_generate(arch, tmp_path, start_engine):
    directory = make_checkpoint(tmp_path, arch, tied=arch != "llama")
    reference = hf_model(directory)
    prompts = [load_tokenizer_for(directory).encode(text) for text in PROMPTS]
    expected = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    # float32 as the reference computes (--dtype auto would pick bfloat16 on a CPU with native bfloat16)
    proc = start_engine("--model", str(directory), "--dtype", "float32", "--max-batch", "8", "--max-context", "256")
    info = proc.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.tokenizer == "tokenizer.json" and info.model == directory.name

    def one(prompt: list[int]) -> list[int]:
        return tokens_of(decode(proc.stub(), prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=NEW_TOKENS,
                                ignore_eos=True))

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == expected


def test_prompt_text_goes_through_the_checkpoint_tokenizer(tmp_path, start_engine):
    directory = make_checkpoint(tmp_path, "llama", tied=False)
    proc = start_engine("--model", str(directory), "--max-context", "256")
    responses = decode(proc.stub(), prompt_text="the quick brown fox", max_new_tokens=8, ignore_eos=True)
    assert responses[-1].usage.prompt_tokens > 1
    assert len(tokens_of(responses)) == 8
