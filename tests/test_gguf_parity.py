"""GGUF files load as transformers loads them: the packaged SmolLM2 (Q4_1 + Q8_0, llama, tied) and
files the tests write in other types and architectures. float32 logits within 1e-4, identical
greedy ids over gRPC for concurrent prompts, the same tokens for a varied corpus, and the K-quant
types dequantized as transformers dequantizes them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import gguf
import grpc
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.loader import LoadedModel, load_model
from tests.checkpoints import PROMPTS, engine_greedy, hf_greedy, make_checkpoint
from tests.engines import EngineProcess
from tests.gguf_files import SMOLLM2, hf_gguf_model, hf_gguf_tokenizer, write_gguf

CPU = torch.device("cpu")
LOGIT_TOLERANCE = 1e-4
CORPUS = [
    "Hello world",
    "What is the capital of France?",
    "naïve café, déjà vu — über schön! Ça coûte 12,50 €.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "emoji: 🙂👍🏽🇫🇷 and a family 👨‍👩‍👧 ",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\n",
    "   leading spaces, trailing spaces   \n\n  \t tabs\t\tand runs      of spaces",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "numbers 1234567 3.14159 1e-10 0x1F and URLs https://example.com/a?b=c&d=e",
    "",
    " ",
    "Ünïcödé ẞ ﬁ ligatures ½ ⅞ and combining é (e\u0301)",
]
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
]


@pytest.fixture(scope="module")
def smollm2_ours() -> LoadedModel:
    return load_model("smollm2", CPU, torch.float32)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' own GGUF loading, without its repeats: it parses the whole file (SmolLM2's 49,152
    tokens and merges, field by field) once for the tokenizer, once for the config and once for the
    tensors, and builds the same tensor-name map once per module (397 times for SmolLM2). Here the
    file is parsed once and the map built once: the same reader's fields and tensors, the same map,
    so the same model (about 9 s less of the fixture's 15)."""
    real_reader = gguf.GGUFReader
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: str | Path, mode: str = "r") -> gguf.GGUFReader:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:  # transformers imports both from gguf as it loads
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_engine_starting):  # type: ignore[no-untyped-def]
    with _gguf_parsed_once():
        return hf_gguf_tokenizer(SMOLLM2), hf_gguf_model(SMOLLM2)


def _logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    model = loaded.model
    model.pack_projections()
    model.setup_rope(len(prompt) + 1, CPU)
    from engine_service.model.kv_cache import KVCache

    cache = KVCache(loaded.config, 1, len(prompt) + 1, torch.float32, CPU)
    return model.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, 0, all_logits=True)[0]


def _hf_logits(model, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_smollm2_tokenizer_matches_transformers(smollm2_ours: LoadedModel, smollm2_hf) -> None:  # type: ignore[no-untyped-def]
    hf_tokenizer, _ = smollm2_hf
    ours = smollm2_ours.tokenizer
    assert ours.encode("Hello world") == [19556, 905]
    for text in CORPUS:
        expected = hf_tokenizer(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True), text


def test_smollm2_stream_detokenization_is_utf8_safe(smollm2_ours: LoadedModel) -> None:
    """Token by token, the streamed text never holds a broken character and adds up to the whole."""
    tokenizer = smollm2_ours.tokenizer
    for text in CORPUS:
        ids = tokenizer.encode(text)
        decoder = tokenizer.stream_decoder()
        pieces = [decoder.step([token]) for token in ids]
        assert all("\ufffd" not in piece for piece in pieces), (text, pieces)
        assert "".join(pieces) == tokenizer.decode(ids), text


def test_smollm2_chat_template_matches_transformers(smollm2_ours: LoadedModel, smollm2_hf) -> None:  # type: ignore[no-untyped-def]
    from engine_service.model.chat_template import ChatMessage

    hf_tokenizer, _ = smollm2_hf
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Japan?"}],
        [{"role": "user", "content": "Hi 🙂"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Écris un haïku."}],
    ]
    template = smollm2_ours.chat_template
    assert template is not None
    for messages in conversations:
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        text = template.render([ChatMessage(m["role"], m["content"]) for m in messages])
        assert smollm2_ours.tokenizer.encode(text, add_special_tokens=False) == list(expected)
    first = conversations[0]
    assert len(hf_tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)) == 37


def test_smollm2_config_from_metadata(smollm2_ours: LoadedModel) -> None:
    config = smollm2_ours.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192 and abs(config.rms_norm_eps - 1e-5) < 1e-9
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_smollm2_float32_logits_match_transformers(smollm2_ours: LoadedModel, smollm2_hf) -> None:  # type: ignore[no-untyped-def]
    hf_tokenizer, hf = smollm2_hf
    for text in SMOLLM2_PROMPTS[:2]:
        prompt = hf_tokenizer(text)["input_ids"]
        diff = (_logits(smollm2_ours, prompt) - _hf_logits(hf, prompt)).abs().max().item()
        assert diff < LOGIT_TOLERANCE, (text, diff)


@pytest.fixture(scope="module")
def smollm2_engine_starting() -> Iterator[Future[EngineProcess]]:
    """The file dequantized into float32, as transformers does (no int4 copies: --quantize auto would
    serve them); chunks of 16 prompt tokens beside decoding rows, and the prefix cache on. It starts
    in the background when transformers' model is first asked for (smollm2_hf), and so loads while
    transformers loads the file: the tests that use it use that model too."""
    engine = EngineProcess("--model", "smollm2", "--dtype", "float32", "--quantize", "none", "--max-batch", "4",
                           "--max-context", "256", "--max-prefill-tokens", "16", "--prefix-cache-tokens", "128")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(engine.start)
        try:
            yield starting
        finally:
            starting.exception()  # the start has ended (serving, or failed and killed)
            engine.kill()


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_engine_starting: Future[EngineProcess]) -> EngineProcess:
    return smollm2_engine_starting.result()


def test_smollm2_greedy_over_grpc_matches_transformers(smollm2_hf, smollm2_engine) -> None:  # type: ignore[no-untyped-def]
    hf_tokenizer, hf = smollm2_hf
    prompts = [hf_tokenizer(text)["input_ids"] for text in SMOLLM2_PROMPTS]
    # 6 new tokens: the 4 prompts' 24 tokens still take more than one prefill step of at most 16, the
    # later beside decoding rows
    expected = [hf_greedy(hf, prompt, 6) for prompt in prompts]
    assert _concurrent_greedy(smollm2_engine.port, prompts, 6) == expected


def _concurrent_greedy(port: int | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        def one(prompt: list[int]) -> list[int]:
            request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new_tokens,
                                       ignore_eos=True)
            return [t for response in stub.Decode(request, timeout=120) for t in response.token_ids]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


# Files the tests write: another architecture (qwen2, with q/k/v biases) and other tensor types.
WRITTEN = [
    ("qwen2", False, GGMLQuantizationType.Q8_0),
    ("llama", True, GGMLQuantizationType.Q4_0),
    ("llama", False, GGMLQuantizationType.BF16),
    ("llama", True, GGMLQuantizationType.F16),
]


@pytest.mark.parametrize(("arch", "tied", "qtype"), WRITTEN, ids=[f"{a}-{q.name}" for a, _, q in WRITTEN])
def test_written_gguf_float32_logits_match_transformers(tmp_path: Path, arch: str, tied: bool,
                                                        qtype: GGMLQuantizationType) -> None:
    path = write_gguf(make_checkpoint(tmp_path, arch, tied), tmp_path / f"model-{qtype.name}.gguf", qtype)
    ours = load_model(str(path), CPU, torch.float32)
    hf = hf_gguf_model(path)
    assert ours.tokenizer.kind == "gguf" and ours.config.tie_word_embeddings == tied
    tokenizer = hf_gguf_tokenizer(path)
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        assert ours.tokenizer.encode(text) == prompt, text
        diff = (_logits(ours, prompt) - _hf_logits(hf, prompt)).abs().max().item()
        assert diff < LOGIT_TOLERANCE, (text, diff)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert engine_greedy(ours.model, prompts, 8, CPU) == [hf_greedy(hf, p, 8) for p in prompts]


def test_written_qwen2_gguf_greedy_over_grpc_matches_transformers(tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(tmp_path, "qwen2", False), tmp_path / "qwen2-q8.gguf", GGMLQuantizationType.Q8_0)
    hf = hf_gguf_model(path)
    tokenizer = hf_gguf_tokenizer(path)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    expected = [hf_greedy(hf, prompt, 16) for prompt in prompts]
    with EngineProcess("--model", str(path), "--dtype", "float32", "--quantize", "none", "--max-batch", "8",
                       "--max-context", "128") as proc:
        assert _concurrent_greedy(proc.port, prompts, 16) == expected


# K-quants: the gguf package cannot write them, so random blocks are written raw (with sane f16
# scales), and dequantized both ways.
K_QUANTS = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, GGMLQuantizationType.Q6_K: 210}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda q: q.name)
def test_k_quants_dequantize_as_transformers_does(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    rows, blocks_per_row, block_bytes = 8, 2, K_QUANTS[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, size=(rows, blocks_per_row, 2)).astype(np.float16).view(np.uint8)
    blocks = raw.reshape(rows, blocks_per_row, block_bytes)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, :, -2:] = scales[:, :, :2]  # d is the block's last field
    else:
        blocks[:, :, :4] = scales  # d and dmin come first
    path = tmp_path / f"{qtype.name}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("weight", blocks.reshape(rows, -1), raw_dtype=qtype)  # shape in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_gguf(path).tensor("weight", torch.float32)
    theirs = hf_dequantize(torch.from_numpy(blocks.reshape(-1).copy()), int(qtype)).reshape(rows, -1)
    assert ours.shape == (rows, blocks_per_row * 256)
    assert torch.isfinite(ours).all() and ours.abs().max() > 0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-6)


def test_every_end_token_the_metadata_names_ends_generation(tmp_path: Path) -> None:
    """EOS, and an end-of-turn token named by `tokenizer.ggml.eot_token_id`, both finish with EOS."""
    directory = make_checkpoint(tmp_path, "llama", False)
    plain = write_gguf(directory, tmp_path / "plain.gguf", GGMLQuantizationType.F16)
    tokenizer = hf_gguf_tokenizer(plain)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    free_run = engine_greedy(load_model(str(plain), CPU, torch.float32).model, [prompt], 12, CPU)[0]
    eos = 2
    stop_at = next(i for i, token in enumerate(free_run) if token != eos and token not in free_run[:i] and i >= 2)
    path = write_gguf(directory, tmp_path / "eot.gguf", GGMLQuantizationType.F16,
                      metadata={"tokenizer.ggml.eot_token_id": free_run[stop_at]})
    assert load_model(str(path), CPU, torch.float32).config.stop_token_ids == (eos, free_run[stop_at])
    with EngineProcess("--model", str(path), "--dtype", "float32", "--max-context", "128") as proc, \
            grpc.insecure_channel(proc.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        request = pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=12)
        responses = list(stub.Decode(request, timeout=60))
        assert [t for r in responses for t in r.token_ids] == free_run[:stop_at + 1]
        assert responses[-1].finish_reason == pb.FINISH_REASON_EOS
        request.ignore_eos = True
        assert [t for r in stub.Decode(request, timeout=60) for t in r.token_ids] == free_run


def test_linear_rope_scaling_from_metadata_matches_the_same_model_in_transformers(tmp_path: Path) -> None:
    """transformers' GGUF loading ignores `rope.scaling.*`, so the reference is the Hugging Face
    checkpoint the file was written from, which carries the same linear scaling in config.json."""
    from tests.checkpoints import hf_model

    directory = make_checkpoint(tmp_path, "llama", False, rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write_gguf(directory, tmp_path / "linear.gguf", GGMLQuantizationType.F32,
                      metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    ours = load_model(str(path), CPU, torch.float32)
    assert ours.config.rope_scaling_dict == {"rope_type": "linear", "factor": 4.0}
    hf = hf_model(directory)
    prompt = hf_gguf_tokenizer(path)(PROMPTS[2])["input_ids"]
    diff = (_logits(ours, prompt) - _hf_logits(hf, prompt)).abs().max().item()
    assert diff < LOGIT_TOLERANCE, diff
    unscaled = load_model(str(write_gguf(directory, tmp_path / "plain.gguf", GGMLQuantizationType.F32)), CPU,
                          torch.float32)
    assert (_logits(unscaled, prompt) - _hf_logits(hf, prompt)).abs().max().item() > 100 * LOGIT_TOLERANCE


def test_yarn_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    from engine_service.model.errors import CheckpointError

    path = write_gguf(make_checkpoint(tmp_path, "llama", True), tmp_path / "yarn.gguf", GGMLQuantizationType.F16,
                      metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match=r"'llama\.rope\.scaling\.type' must be one of none, linear, got 'yarn'"):
        load_model(str(path), CPU, torch.float32)


# -- log-probabilities (DecodeRequest.top_logprobs, echo_prompt_logprobs) against transformers ------

TOP = 5


def _check_logprobs(reported, tokens: list[int], reference: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """Each reported TokenLogprob against log_softmax of transformers' logits row for its place;
    returns the largest difference."""
    assert [r.token_id for r in reported] == tokens
    worst = 0.0
    for r, row in zip(reported, torch.log_softmax(reference, dim=-1), strict=True):
        worst = max(worst, abs(r.logprob - row[r.token_id].item()))
        values, _ = torch.topk(row, TOP)
        assert len(r.top) == TOP
        for alternative, value in zip(r.top, values.tolist(), strict=True):  # most likely first
            worst = max(worst, abs(alternative.logprob - value), abs(alternative.logprob - row[alternative.token_id].item()))
    return worst


def test_smollm2_logprobs_equal_transformers_log_softmax(smollm2_hf, smollm2_engine) -> None:  # type: ignore[no-untyped-def]
    """Greedy and sampled outputs' log-probabilities, and a prompt's echoed ones computed in chunks
    beside a decoding row with the prefix cache on (holding that very prompt): all within 1e-4 of
    transformers' float32 log_softmax for the same prefix."""
    hf_tokenizer, hf = smollm2_hf
    prompt = hf_tokenizer(" ".join(SMOLLM2_PROMPTS * 2) + " The answer is")["input_ids"]
    assert len(prompt) > 32
    with grpc.insecure_channel(f"127.0.0.1:{smollm2_engine.port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        def run(**fields) -> list[pb.DecodeResponse]:  # type: ignore[no-untyped-def]
            return list(stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), ignore_eos=True,
                                                     top_logprobs=TOP, **fields), timeout=120))

        greedy = run(max_new_tokens=8)
        sampled = run(max_new_tokens=8, sampling=pb.SamplingParams(temperature=1.5, top_k=20, seed=3,
                                                                   repetition_penalty=1.3))
        # a row decoding while the prompt is echoed: its first token came before the echo was asked
        # for, and it is cancelled after, short of its 48 tokens (the engine's log says so, below)
        busy = stub.Decode(pb.DecodeRequest(request_id="busy-beside-echo", prompt_text="Count: one two three",
                                            max_new_tokens=48, ignore_eos=True), timeout=120)
        next(busy)
        echoed = run(max_new_tokens=1, echo_prompt_logprobs=True)
        busy.cancel()
    beside = smollm2_engine.wait_events("request_finished", "busy-beside-echo")
    assert beside and beside[0]["status"] == "CANCELLED" and beside[0]["output_tokens"] < 48, beside
    worst = 0.0
    for responses in (greedy, sampled):
        tokens = [t for r in responses for t in r.token_ids]
        reported = [lp for r in responses for lp in r.logprobs]
        assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
        assert not any(r.prompt_logprobs for r in responses)
        reference = _hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]
        worst = max(worst, _check_logprobs(reported, tokens, reference))
    assert [t for r in greedy for t in r.token_ids] != [t for r in sampled for t in r.token_ids]
    assert len(echoed[0].prompt_logprobs) == len(prompt) - 1
    assert not any(r.prompt_logprobs for r in echoed[1:])
    assert echoed[-1].usage.cached_prompt_tokens == 0  # computed whole, though the cache holds it
    echo = _check_logprobs(echoed[0].prompt_logprobs, prompt[1:], _hf_logits(hf, prompt)[:-1])
    print(f"logprobs vs transformers: outputs {worst:.1e}, echoed prompt of {len(prompt)} tokens {echo:.1e}")
    assert max(worst, echo) < LOGIT_TOLERANCE, (worst, echo)
