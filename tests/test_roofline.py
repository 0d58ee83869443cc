"""benchmarks/roofline.py's pure part: the bytes one decode step reads, on the tiny preset, against
a count by hand (2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 258, untied)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.loader import load_model
from engine_service.model.presets import PRESETS
from engine_service.runtime.model_runner import ModelRunner
from tests.engines import ROOT

_spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
assert _spec is not None and _spec.loader is not None
roofline = importlib.util.module_from_spec(_spec)
sys.modules["roofline"] = roofline  # its dataclasses look their module up
_spec.loader.exec_module(roofline)

CPU = torch.device("cpu")
CONTEXT = 10
# elements of one layer's projections: q/k/v (64 + 2 * 32 rows), o (64), gate/up (2 * 128), down (64 x 128)
LAYER = (128 + 64 + 256) * 64 + 64 * 128
VOCAB, HIDDEN, HEAD_DIM = 258, 64, 16
KV_PER_TOKEN = 2 * 2 * 2 * HEAD_DIM * 4  # keys and values, 2 layers, 2 KV heads, float32
NORMS = 5 * HIDDEN * 4  # 2 a layer and the final one
ROPE = 2 * HEAD_DIM * 4


def _parts(model: LlamaForCausalLM, quantize: str) -> dict[str, int]:
    runner = ModelRunner(model, 1, 16, CPU, torch.float32, quantize)
    step = roofline.decode_step_bytes(model, runner.cache.bytes_per_token(), CONTEXT)
    parts = {p.name.split(" (")[0].split(",")[0]: p.nbytes for p in step.parts}
    assert sum(parts.values()) == step.total
    return parts


def test_float32_reads_every_weight_once_and_one_embedding_row() -> None:
    parts = _parts(load_model("tiny", CPU, torch.float32).model, "none")
    assert parts == {"layer projections": 2 * LAYER * 4, "LM head": VOCAB * HIDDEN * 4, "RMSNorm weights": NORMS,
                     "token embedding": HIDDEN * 4, "rotary cos/sin": ROPE, "KV cache": CONTEXT * KV_PER_TOKEN}


def test_int4_counts_the_packed_copy_and_its_scales_not_the_float_weights() -> None:
    parts = _parts(load_model("tiny", CPU, torch.float32).model, "int4")
    # half a byte a weight, a bfloat16 scale and offset per group of 32; the LM head int8 + a bfloat16 scale a row
    assert parts["layer projections"] == 2 * (LAYER // 2 + LAYER // 32 * 2 * 2)
    assert parts["LM head"] == VOCAB * HIDDEN + VOCAB * 2
    assert parts["token embedding"] == HIDDEN * 4  # the float32 table's row: the head reads its int8 copy


def test_a_dynamic_int8_head_counts_fbgemms_bytes_and_float32_row_scales() -> None:
    model = load_model("tiny", CPU, torch.float32).model
    ModelRunner(model, 1, 16, CPU, torch.float32, "int4", dynamic_head_bits=7)
    step = roofline.decode_step_bytes(model, 512, CONTEXT)
    head = next(p for p in step.parts if p.name.startswith("LM head"))
    assert head.nbytes == VOCAB * HIDDEN + VOCAB * 4
    assert head.held_as == "int8 (7-bit values) + float32 scales, 8-bit activations (fbgemm)"


def test_a_tied_unquantized_head_reads_the_embedding_table_whole_and_its_row_is_not_counted_again() -> None:
    model = LlamaForCausalLM(dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True))
    model.init_random(0)
    parts = _parts(model, "none")
    assert parts["LM head"] == VOCAB * HIDDEN * 4
    assert parts["token embedding"] == 0


def test_a_context_below_one_token_is_refused_by_name() -> None:
    model = load_model("tiny", CPU, torch.float32).model
    ModelRunner(model, 1, 16, CPU, torch.float32, "none")
    with pytest.raises(roofline.RooflineError, match="context must be >= 1 token, got 0"):
        roofline.decode_step_bytes(model, 512, 0)
