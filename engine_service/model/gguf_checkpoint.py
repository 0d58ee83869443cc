"""A GGUF file -> ModelConfig and a LlamaForCausalLM, weights dequantized into `dtype`.

Hyper-parameters come from the `{arch}.*` metadata keys llama.cpp writes; tensor names from the one
mapping below. GGUF converters permute the rows of llama-type q/k projections into llama.cpp's
rotary layout (pairs interleaved); `unpermute` undoes it, as transformers' GGUF loading does.
Tensors are dequantized one at a time from the memory-mapped file, so peak memory is the model in
`dtype` plus one tensor in float32.
"""

from __future__ import annotations

import re

import torch

from engine_service.model.config import ModelConfig
from engine_service.model.errors import CheckpointError
from engine_service.model.gguf_reader import GGUFFile
from engine_service.model.llama import LlamaForCausalLM

# architecture -> (q/k/v biases, q/k rows permuted by the converter)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, True),  # Llama, Mistral, SmolLM, ...
    "qwen2": (True, False),
}
ROPE_SCALING_TYPES = ("none", "linear")

# The one GGUF tensor-name translation (llama.cpp's names -> ours, which are Hugging Face's).
TENSOR_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
))
UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "per-dimension rope frequency factors (llama3-style rope scaling) are not supported",
}


def model_name(gguf_name: str) -> str | None:
    for pattern, replacement in TENSOR_NAMES:
        if pattern.match(gguf_name):
            return pattern.sub(replacement, gguf_name)
    return None


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of q/k rows: (heads, 2, D/2) interleaved back to halves."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def weight_format(gguf: GGUFFile) -> str:
    """The tensor type ("Q4_1", "F32", ...) that holds most of the layers' 2-D weights: what
    `--quantize auto` serves (precision.py). A file of only 1-D tensors or no layers: "F32"."""
    elements: dict[str, int] = {}
    for name, tensor in gguf.tensors.items():
        if name.startswith("blk.") and name.endswith(".weight") and len(tensor.shape) == 2:
            kind = tensor.tensor_type.name
            elements[kind] = elements.get(kind, 0) + tensor.n_elements
    return max(sorted(elements), key=elements.__getitem__) if elements else "F32"


def architecture_of(gguf: GGUFFile) -> str:
    architecture = gguf.require("general.architecture", str)
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return architecture


def _rope(gguf: GGUFFile, arch: str) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    theta = float(gguf.get(f"{arch}.rope.freq_base", (int, float), 10000.0))
    kind = gguf.get(f"{arch}.rope.scaling.type", str, "none")
    if kind not in ROPE_SCALING_TYPES:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r}: metadata '{arch}.rope.scaling.type' must be one of "
            f"{', '.join(ROPE_SCALING_TYPES)}, got {kind!r}"
        )
    factor = gguf.get(f"{arch}.rope.scaling.factor", (int, float), 1.0)
    if kind == "none" or factor == 1.0:
        return theta, None
    return theta, (("factor", float(factor)), ("rope_type", "linear"))


def end_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """Every id that ends generation: EOS first, then end-of-turn and end-of-message when named."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token = gguf.get(key, int)
        if token is not None and token not in ids:
            ids.append(token)
    return tuple(ids)


def parse_config(gguf: GGUFFile) -> ModelConfig:
    arch = architecture_of(gguf)
    qkv_bias, _ = ARCHITECTURES[arch]
    hidden = gguf.require(f"{arch}.embedding_length", int)
    heads = gguf.require(f"{arch}.attention.head_count", int)
    head_dim = gguf.get(f"{arch}.attention.key_length", int) or gguf.get(f"{arch}.rope.dimension_count", int)
    if head_dim == hidden // max(heads, 1):
        head_dim = None
    embed = gguf.tensors.get("token_embd.weight")
    tokens = gguf.get("tokenizer.ggml.tokens", list, [])
    vocab = gguf.get(f"{arch}.vocab_size", int) or (int(embed.shape[1]) if embed is not None else len(tokens))
    theta, scaling = _rope(gguf, arch)
    ends = end_token_ids(gguf)
    name = gguf.get("general.name", str) or gguf.path.stem
    try:
        return ModelConfig(
            name=gguf.path.stem,
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=gguf.require(f"{arch}.block_count", int),
            num_attention_heads=heads,
            num_key_value_heads=gguf.get(f"{arch}.attention.head_count_kv", int) or heads,
            intermediate_size=gguf.require(f"{arch}.feed_forward_length", int),
            head_dim=head_dim,
            rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", (int, float), 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=gguf.get(f"{arch}.context_length", int, 2048),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias=qkv_bias,
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id", int),
            eos_token_id=ends[0] if ends else None,
            stop_token_ids=ends,
            extra=(("architecture", arch), ("gguf_name", name)),
        )
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"GGUF file {str(gguf.path)!r}: {err}") from err


def _locate(gguf: GGUFFile, model: LlamaForCausalLM, config: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the GGUF tensor name, after checking names and shapes."""
    found: dict[str, str] = {}
    for gguf_name in gguf.tensors:
        if gguf_name in UNSUPPORTED_TENSORS:
            raise CheckpointError(
                f"GGUF file {str(gguf.path)!r}: tensor {gguf_name!r}: {UNSUPPORTED_TENSORS[gguf_name]}"
            )
        ours = model_name(gguf_name)
        if ours is None:
            raise CheckpointError(
                f"GGUF file {str(gguf.path)!r} holds tensor {gguf_name!r}, which the {dict(config.extra)['architecture']} "
                f"architecture does not use"
            )
        found[ours] = gguf_name
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(found), key=lambda n: (len(n), n))
    if missing:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r} lacks tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r} holds tensor {found[unexpected[0]]!r}, which the model config does not use"
        )
    for name, param in expected.items():
        shape = [int(d) for d in reversed(gguf.tensors[found[name]].shape.tolist())]
        if shape != list(param.shape):
            raise CheckpointError(
                f"GGUF file {str(gguf.path)!r}: tensor {found[name]!r} has shape {shape}, "
                f"the model config expects {list(param.shape)}"
            )
    return found


def load_gguf_weights(gguf: GGUFFile, config: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> LlamaForCausalLM:
    """The model with every tensor dequantized into `dtype` on `device`. Raises CheckpointError."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    found = _locate(gguf, model, config)
    _, permuted = ARCHITECTURES[dict(config.extra)["architecture"]]
    state: dict[str, torch.Tensor] = {}
    for name, gguf_name in found.items():
        tensor = gguf.tensor(gguf_name, torch.float32)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute(tensor, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute(tensor, config.num_key_value_heads)
        state[name] = tensor.to(device=device, dtype=dtype)
        del tensor
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:  # assign=True gives each name its own Parameter: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
