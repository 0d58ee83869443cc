"""The one-row decode step compiled by AOTInductor against the traced step, in one process.

    python benchmarks/aoti_step.py [--model smollm2] [--context 160] [--rounds 200]

Issue 28's untried lever, measured (docs/decode-speed.md): the layers of a one-row decode step
(embedding to the final norm, the int4 copies, the KV writes) exported with `torch.export` (the
attended length dynamic) and compiled by AOTInductor into one C++ library, which fuses the small
operators a trace runs one by one; the LM head (fbgemm's packed int8 weight, a ScriptObject that
export cannot take) stays an eager call after it. Needs a C++ compiler; 60-150 s to compile on 2
cores. Prints the export and compile times, whether the argmax agrees with the traced step's,
then both steps' median and 10th percentile timed in alternation.

The KV writes go through a custom op that declares the cache it mutates (`engine::kv_write`):
written as `index_copy_` on a view of the cache, functionalization copies the whole cache
tensor per write, and the compiled step took 1.2 s (209 ms with one flat view). The compiled
library holds its own copy of the weights and of the cache buffers it was exported with, so this
is a measurement, not yet the engine's path: the engine's would pass the cache in as an input.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine_service.machine.cpu import detect
from engine_service.machine.precision import (
    choose_dtype,
    choose_dynamic_head,
    choose_onednn_weights,
    choose_quantize,
)
from engine_service.model.kv_cache import KVCache, decode_mask
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.loader import load_model
from engine_service.runtime.build import DTYPES
from engine_service.runtime.model_runner import ModelRunner

MAX_CONTEXT = 2048


@torch.library.custom_op("engine::kv_write", mutates_args=("cache",))
def kv_write(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """`new` (n, D) into one layer's `cache` seen as (rows x heads x positions, D) vectors at `slots`."""
    cache.view(-1, new.shape[-1]).index_copy_(0, slots, new)


@kv_write.register_fake
def _(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    return None


class _Layers(torch.nn.Module):
    """The model's layers and final norm over one decode step, the head left out."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache) -> None:
        super().__init__()
        self.model = model.model
        self.register_buffer("rope_cos", model.rope_cos)
        self.register_buffer("rope_signed_sin", model.rope_signed_sin)
        self.cache = cache
        self._forward = LlamaForCausalLM._forward.__get__(self)  # reads rope_cos, rope_signed_sin, model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(tokens.shape[0])
        return self.model.norm(self._forward(tokens, positions, rows, mask, (), self.cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=160, help="positions the row attends (2..2,047)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if not 2 <= args.context < MAX_CONTEXT:
        parser.error(f"--context {args.context}: must be 2..{MAX_CONTEXT - 1}")
    cpu = detect()
    dtype_name, _ = choose_dtype("auto", "cpu", cpu)
    device = torch.device("cpu")
    loaded = load_model(args.model, device, DTYPES[dtype_name])
    quantize, _ = choose_quantize("auto", "cpu", loaded.weight_format)
    head, _ = choose_dynamic_head(quantize, "cpu", cpu)
    runner = ModelRunner(loaded.model, 1, MAX_CONTEXT, device, DTYPES[dtype_name], quantize, True, head,
                         choose_onednn_weights(dtype_name, "cpu"))
    model, cache = loaded.model, runner.cache
    print(f"{loaded.name} in {dtype_name}, quantization {quantize}; CPU {cpu.describe()}", flush=True)

    def write(layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        dim = k.shape[-1]
        kv_write(cache.k[layer], slots, k.transpose(0, 1).reshape(-1, dim))
        kv_write(cache.v[layer], slots, v.transpose(0, 1).reshape(-1, dim))

    traced = runner._decode  # traced before the writes below are swapped in
    cache.write_decode = write  # type: ignore[method-assign]
    tokens = torch.full((1,), 100, dtype=torch.long)
    positions = torch.full((1,), args.context - 1, dtype=torch.long)
    layers = _Layers(model, cache)
    started = time.monotonic()
    length = torch.export.Dim("length", min=2, max=MAX_CONTEXT - 1)
    exported = torch.export.export(layers, (tokens, positions, decode_mask(positions)),
                                   dynamic_shapes=({}, {}, {3: length}), strict=False)
    print(f"export {time.monotonic() - started:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="aoti-step-") as tmp:
        started = time.monotonic()
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(Path(tmp) / "step.pt2"))
        print(f"AOTInductor compile {time.monotonic() - started:.1f} s", flush=True)
        compiled = torch._inductor.aoti_load_package(package)

    def aoti_step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.head(compiled(tokens, positions, decode_mask(positions))).float()

    same = torch.equal(traced(tokens, positions).argmax(-1), aoti_step(tokens, positions).argmax(-1))
    print(f"argmax {'the same' if same else 'DIFFERS'}", flush=True)
    times: dict[str, list[float]] = {"traced": [], "AOTInductor": []}
    steps = {"traced": traced, "AOTInductor": aoti_step}
    for _ in range(5):
        for step in steps.values():
            step(tokens, positions)
    for _ in range(args.rounds):
        for name, step in steps.items():
            started_step = time.perf_counter()
            step(tokens, positions)
            times[name].append(time.perf_counter() - started_step)
    tenth = max(args.rounds // 10, 1)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    for name, t in times.items():
        print(f"{name}: median {med[name]:.3f} ms, p10 {sorted(t)[tenth - 1] * 1e3:.3f} ms")
    print(f"AOTInductor / traced median: {med['AOTInductor'] / med['traced']:.3f}")


if __name__ == "__main__":
    main()
