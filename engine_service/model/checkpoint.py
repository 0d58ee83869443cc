"""Load a Hugging Face checkpoint directory's safetensors weights into a LlamaForCausalLM.

The model is built on the meta device (no memory), every tensor's name and shape is checked
against it from the safetensors headers alone, and only then are tensors read, one at a time,
from the memory-mapped files, cast to the requested dtype on the requested device, and assigned
into the model. Peak memory is the weights in their final form plus one tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine_service.model.checkpoint_config import parse_config, read_json
from engine_service.model.config import ModelConfig
from engine_service.model.errors import CheckpointError
from engine_service.model.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"

# The one checkpoint-name translation: (pattern, replacement), first match wins; a replacement of
# None drops the tensor. Names that match nothing are used as they are (our module names equal
# Hugging Face's).
CHECKPOINT_NAMES: tuple[tuple[re.Pattern[str], str | None], ...] = (
    # Older Llama checkpoints store rotary inverse frequencies; setup_rope recomputes them.
    (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"), None),
)


def model_name(checkpoint_name: str) -> str | None:
    """Our parameter name for a checkpoint tensor, or None for a tensor we do not load."""
    for pattern, replacement in CHECKPOINT_NAMES:
        if pattern.match(checkpoint_name):
            return None if replacement is None else pattern.sub(replacement, checkpoint_name)
    return checkpoint_name


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files: those the index names when there is one, else every `*.safetensors`."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"checkpoint file {str(index_path)!r}: field 'weight_map' must be a non-empty object")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {str(file)!r} (named in {INDEX_FILE}) is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        hint = f"; found {', '.join(others)}, which is not supported (convert to safetensors)" if others else ""
        raise CheckpointError(f"checkpoint directory {str(directory)!r} has no *.safetensors files{hint}")
    return files


def _open(file: Path, device: torch.device):  # type: ignore[no-untyped-def]
    # safetensors names CUDA devices "cuda:N"; a bare "cuda" means the current device.
    where = str(device) if device.type != "cuda" or device.index is not None else f"cuda:{torch.cuda.current_device()}"
    try:
        return safe_open(str(file), framework="pt", device=where)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"checkpoint file {str(file)!r} is unreadable: {err}") from err


def _locate(files: list[Path], device: torch.device) -> dict[str, tuple[Path, str, list[int]]]:
    """Our parameter name -> (file, checkpoint name, shape), from the file headers only."""
    found: dict[str, tuple[Path, str, list[int]]] = {}
    for file in files:
        with _open(file, device) as handle:
            for name in handle.keys():
                ours = model_name(name)
                if ours is None:
                    continue
                if ours in found:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {str(found[ours][0])!r} and {str(file)!r}"
                    )
                found[ours] = (file, name, list(handle.get_slice(name).get_shape()))
    return found


def _check(model: LlamaForCausalLM, config: ModelConfig, found: dict[str, tuple[Path, str, list[int]]],
           directory: Path) -> list[str]:
    """The names to load, after checking that every parameter is present with its shape, and no
    tensor is left over. With tied embeddings an `lm_head.weight` in the checkpoint is ignored."""
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        found = {name: where for name, where in found.items() if name != "lm_head.weight"}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} lacks tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}...)" if len(missing) > 1 else "")
        )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        file, name, _ = found[unexpected[0]]
        raise CheckpointError(
            f"checkpoint file {str(file)!r} holds tensor {name!r}, which the model config does not use"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    for name, tensor in expected.items():
        file, checkpoint_name, shape = found[name]
        if list(tensor.shape) != shape:
            raise CheckpointError(
                f"checkpoint file {str(file)!r}: tensor {checkpoint_name!r} has shape {shape}, "
                f"the model config expects {list(tensor.shape)}"
            )
    return list(expected)


def load_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype) -> tuple[ModelConfig, LlamaForCausalLM]:
    """The config and the model of a checkpoint directory, weights in `dtype` on `device`.
    Raises CheckpointError (a ValueError) naming the file, tensor or field that is wrong."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    config = parse_config(directory)
    files = weight_files(directory)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    found = _locate(files, device)
    names = _check(model, config, found, directory)
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(found[name][0], []).append(name)
    for file, file_names in by_file.items():
        with _open(file, device) as handle:
            for name in file_names:
                tensor = handle.get_tensor(found[name][1])
                if not tensor.is_floating_point():
                    raise CheckpointError(
                        f"checkpoint file {str(file)!r}: tensor {found[name][1]!r} has dtype {tensor.dtype}, "
                        f"expected a floating-point dtype"
                    )
                state[name] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:  # assign=True gives each name its own Parameter: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return config, model.eval()
