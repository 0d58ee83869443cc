"""A Hugging Face `config.json` (and `generation_config.json`) -> ModelConfig.

Both config layouts are read: transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x
(`rope_parameters` holding `rope_theta` and `rope_type`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine_service.model.config import ModelConfig
from engine_service.model.errors import CheckpointError

# architecture -> (q/k/v biases, tie_word_embeddings when config.json omits it)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
}
ROPE_TYPES = ("default", "linear", "llama3")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; CheckpointError naming the file when it is missing or malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint file {str(path)!r} is unreadable: {err}") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint file {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _field(raw: dict[str, Any], name: str, path: Path) -> Any:
    if name not in raw or raw[name] is None:
        raise CheckpointError(f"{str(path)!r}: field {name!r} is required")
    return raw[name]


def _token_ids(value: object, field: str, path: Path) -> list[int]:
    """`eos_token_id` may be one id, a list of ids, or null."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{str(path)!r}: field {field!r} must be a token id or a list of them, got {value!r}")
    return ids


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    """(rope_theta, rope_scaling as sorted items or None) from either config layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
    if not isinstance(theta, int | float) or theta <= 0:
        raise CheckpointError(f"{str(path)!r}: field 'rope_theta' must be a positive number, got {theta!r}")
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{str(path)!r}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{str(path)!r}: rope scaling type must be one of {', '.join(ROPE_TYPES)}, got {kind!r}"
        )
    if kind == "default":
        return float(theta), None
    required = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in required:
        if not isinstance(scaling.get(key), int | float):
            raise CheckpointError(
                f"{str(path)!r}: rope scaling {kind!r} needs a number in {key!r}, got {scaling.get(key)!r}"
            )
    items = {"rope_type": kind, **{key: scaling[key] for key in required}}
    return float(theta), tuple(sorted(items.items()))


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    """The attention window, when the architecture uses one (Qwen2 only with use_sliding_window)."""
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


def parse_config(directory: Path) -> ModelConfig:
    """Read `directory/config.json` (and `generation_config.json` for more stop ids) into a ModelConfig.

    eos: `eos_token_id` is the first id config.json lists; `stop_token_ids` holds every id listed
    there or in generation_config.json, in that order (Llama 3 lists several)."""
    path = directory / "config.json"
    raw = read_json(path)
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if isinstance(architectures, list) and len(architectures) == 1 else architectures
    if not isinstance(architecture, str) or architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{str(path)!r}: field 'architectures' must name one of {', '.join(ARCHITECTURES)}, got {architectures!r}"
        )
    qkv_bias, tied_default = ARCHITECTURES[architecture]
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{str(path)!r}: field 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
    if raw.get("mlp_bias", False):
        raise CheckpointError(f"{str(path)!r}: field 'mlp_bias' true is not supported, got {raw['mlp_bias']!r}")
    if not qkv_bias and raw.get("attention_bias", False):
        raise CheckpointError(
            f"{str(path)!r}: field 'attention_bias' true is not supported for {architecture}, "
            f"got {raw['attention_bias']!r}"
        )
    theta, scaling = _rope(raw, path)
    eos_ids = _token_ids(raw.get("eos_token_id"), "eos_token_id", path)
    generation_path = directory / "generation_config.json"
    if generation_path.exists():
        generation = read_json(generation_path)
        extra_ids = _token_ids(generation.get("eos_token_id"), "eos_token_id", generation_path)
        eos_ids += [i for i in extra_ids if i not in eos_ids]
    bos_ids = _token_ids(raw.get("bos_token_id"), "bos_token_id", path)
    heads = _field(raw, "num_attention_heads", path)
    try:
        return ModelConfig(
            name=directory.resolve().name,
            vocab_size=_field(raw, "vocab_size", path),
            hidden_size=_field(raw, "hidden_size", path),
            num_hidden_layers=_field(raw, "num_hidden_layers", path),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            intermediate_size=_field(raw, "intermediate_size", path),
            head_dim=raw.get("head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", tied_default)),
            attention_bias=qkv_bias,
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_id=eos_ids[0] if eos_ids else None,
            stop_token_ids=tuple(eos_ids),
            sliding_window=_sliding_window(raw, architecture),
            extra=(("architecture", architecture),),
        )
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{str(path)!r}: {err}") from err
