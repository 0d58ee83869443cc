"""The layers' bfloat16 weights prepacked for oneDNN (llama.Packed.pack_onednn, which ModelRunner
does when machine/precision.choose_onednn_weights says so: bfloat16 where oneDNN runs it): the same bits as F.linear for every row count, bias or not, so
prefills and mixed steps give the logits they gave before; traces keep F.linear."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_service.machine.cpu import detect
from engine_service.machine.precision import choose_onednn_weights, onednn_bfloat16, onednn_layout_rows
from engine_service.model.kv_cache import PromptChunk
from engine_service.model.llama import LlamaForCausalLM, Packed
from engine_service.model.presets import PRESETS
from engine_service.runtime.model_runner import ModelRunner

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_bfloat16(), reason="oneDNN does not run bfloat16 on this CPU")


@pytest.mark.parametrize("layout_rows", [1, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_projection_gives_f_linears_bits_at_every_row_count(bias: bool, layout_rows: int) -> None:
    generator = torch.Generator().manual_seed(0)
    parts = [nn.Linear(96, 64, bias=bias), nn.Linear(96, 32, bias=bias)]
    for part in parts:
        part.weight.data = torch.randn(part.weight.shape, generator=generator)
        if bias:
            part.bias.data = torch.randn(part.bias.shape, generator=generator)
        part.to(torch.bfloat16)
    packed = Packed(*parts)
    packed.pack()
    packed.pack_onednn(layout_rows)
    assert packed.onednn is not None and packed.onednn.is_mkldnn
    for rows in (1, 3, 8, 40, 300):
        x = torch.randn(1, rows, 96, generator=generator).bfloat16()
        assert torch.equal(packed(x), F.linear(x, packed.weight, packed.bias)), rows
    packed.pack()  # new weights in place: the old packed copy must not serve them
    assert packed.onednn is None


@pytest.mark.skipif(onednn_layout_rows(detect()) != 64, reason="the 64-row layout is chosen where AMX runs bfloat16")
def test_the_amx_layout_gives_f_linears_bits_at_smollm2s_shapes() -> None:
    """At SmolLM2's widths the layout for 1 row did not: its products at 40-300 rows rounded apart
    from F.linear's on the Xeon 207 with AMX; the layout for 64 rows matched at 1-2,000."""
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((3072, 576), (576, 1536)):
        part = nn.Linear(in_features, out_features, bias=False)
        part.weight.data = torch.randn(part.weight.shape, generator=generator).bfloat16()
        packed = Packed(part)
        packed.pack()
        packed.pack_onednn(64)
        for rows in (1, 9, 40, 64, 300, 2000):
            x = torch.randn(1, rows, in_features, generator=generator).bfloat16()
            assert torch.equal(packed(x), F.linear(x, packed.weight)), (out_features, rows)


def _mixed_step_logits(model: LlamaForCausalLM, onednn: bool) -> torch.Tensor:
    runner = ModelRunner(model, 4, 64, CPU, torch.bfloat16, onednn_weights=choose_onednn_weights("bfloat16", "cpu"))
    assert runner.onednn_weights
    if not onednn:
        for packed in model.projections():
            packed.onednn = None
    cache = runner.cache
    prompts = torch.arange(40).view(2, 20) % 250 + 3
    first = model.prefill(prompts, torch.tensor([20, 17]), cache, 0, all_logits=True)
    # two rows decoding beside a 24-token chunk of a third prompt: 26 rows through the weights
    step = model.step(torch.tensor([5, 9]), torch.tensor([20, 17]), torch.arange(24) + 30,
                      [PromptChunk(2, 0, 24)], cache)
    return torch.cat([first.view(-1, first.shape[-1]), step])


def test_prefill_and_mixed_steps_give_the_same_logits_with_packed_weights() -> None:
    config = dataclasses.replace(PRESETS["tiny"], attention_bias=True)  # Qwen2's q/k/v biases too
    logits = []
    for onednn in (True, False):
        model = LlamaForCausalLM(config)
        model.init_random(0)
        model = model.to(torch.bfloat16).eval()
        logits.append(_mixed_step_logits(model, onednn))
    assert torch.equal(logits[0], logits[1])


def test_float32_weights_and_the_lm_head_are_not_packed() -> None:
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.init_random(0)
    runner = ModelRunner(model.eval(), 1, 16, CPU, torch.float32,
                         onednn_weights=choose_onednn_weights("float32", "cpu"))
    assert not runner.onednn_weights and all(p.onednn is None for p in model.projections())
    assert not choose_onednn_weights("bfloat16", "cuda:0")
    model = model.to(torch.bfloat16)
    ModelRunner(model, 1, 16, CPU, torch.bfloat16, onednn_weights=choose_onednn_weights("bfloat16", "cpu"))
    *layers, head = model.projections()
    assert all(p.onednn is not None for p in layers) and head.onednn is None
