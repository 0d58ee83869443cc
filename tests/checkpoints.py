"""Small random Hugging Face checkpoints for tests, written with `transformers` (a test-only
dependency), and the reference/engine helpers that compare against them.

`make_checkpoint(tmp_path, arch, tied)` is the fixture builder other tests import.
"""

from __future__ import annotations

import os
from pathlib import Path

# Tests never reach the Hub; huggingface_hub reads this when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine_service.model.kv_cache import KVCache
from engine_service.model.llama import LlamaForCausalLM

ARCHS = ("llama", "mistral", "qwen2")
_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}
VOCAB_SIZE = 320  # the model's; the tokenizer uses 300 of them (a padded vocabulary, as real models have)
TOKENIZER_VOCAB = 300
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# Weights drawn wider than Hugging Face's std 0.02 so the logits are peaked (std ~1): greedy
# choices are then not decided by rounding noise, which is what a trained model looks like too.
INIT_STD = 0.12
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a decode engine streams tokens over grpc to many concurrent clients",
    "naïve café, déjà vu — über schön! 東京 and 🙂 emoji",
    "rotary embeddings rotate query and key pairs by position",
] * 20
PROMPTS = [
    "the quick brown fox",
    "a",
    "rotary embeddings rotate query and key pairs by position, then the engine streams",
    "déjà vu 東京",
    "tokens over grpc to many concurrent clients and the lazy dog",
]


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE trained in-process; its post-processor prepends <s> as Llama's does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tokenizer


def hf_config(arch: str, tied: bool, rope_scaling: dict[str, object] | None = None,
              vocab_size: int = VOCAB_SIZE) -> transformers.PretrainedConfig:
    kwargs: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        initializer_range=INIT_STD,
    )
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 500000.0, **rope_scaling}
    else:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0 if arch != "qwen2" else 1000000.0, "rope_type": "default"}
    return _CONFIGS[arch](**kwargs)


def make_checkpoint(tmp_path: Path, arch: str, tied: bool, *, sharded: bool = False,
                    rope_scaling: dict[str, object] | None = None, tokenizer: bool = True, seed: int | None = None,
                    vocab_size: int = VOCAB_SIZE) -> Path:
    """Write a tiny random `arch` ("llama", "mistral", "qwen2") checkpoint under `tmp_path` and
    return its directory: config.json, safetensors (sharded with an index when `sharded`), and a
    tokenizer.json unless `tokenizer` is False. Qwen2's q/k/v biases and every norm weight are
    random, so a dropped bias or norm shows up in the logits. The seed defaults to one per arch."""
    config = hf_config(arch, tied, rope_scaling, vocab_size)
    torch.manual_seed(ARCHS.index(arch) if seed is None else seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_STD)
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    parts = [arch, "tied" if tied else "untied", "sharded" if sharded else "", (rope_scaling or {}).get("rope_type", "")]
    directory = tmp_path / "-".join(str(p) for p in parts if p)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB" if sharded else "2GB")
    if tokenizer:
        build_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """The reference: transformers' own model from the same directory (eager attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager").eval()


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, one prompt (no padding), EOS ignored."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=PAD_ID)
    return out[0, len(prompt):].tolist()


def pad_batch(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) tokens and (B,) lengths, as LlamaForCausalLM.prefill takes them."""
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    return tokens.to(device), torch.tensor([len(p) for p in prompts], device=device)


def engine_greedy(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                  device: torch.device) -> list[list[int]]:
    """Greedy decoding of all `prompts` as one batch through our prefill + decode, EOS ignored."""
    dtype = model.model.embed_tokens.weight.dtype
    context = max(len(p) for p in prompts) + max_new_tokens
    model.pack_projections()
    model.setup_rope(context, device)
    cache = KVCache(model.config, len(prompts), context, dtype, device)
    tokens, lengths = pad_batch(prompts, device)
    next_tokens = model.prefill(tokens, lengths, cache, first_row=0).argmax(-1)
    generated = [next_tokens]
    positions = lengths.clone()
    for _ in range(max_new_tokens - 1):
        next_tokens = model.decode(next_tokens, positions, cache).argmax(-1)
        generated.append(next_tokens)
        positions += 1
    return torch.stack(generated, dim=1).tolist()
