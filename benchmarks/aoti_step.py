"""The engine's compiled one-row decode step (engine_service/model/compiled_decode.py) against its
traced step, in one process.

    python benchmarks/aoti_step.py [--model smollm2] [--context 512] [--position 100] [--rounds 200]

Builds the runner as `--compile-decode auto` does (AOTInductor compiles the library into
$ENGINE_COMPILE_CACHE, else ~/.cache/engine-bench/compiled/, unless it is there: a minute or two on
2 cores), then prints the CPU, whether the two steps pick the same token and write the same keys
(to bfloat16's rounding), and both steps' median and 10th percentile, timed in alternation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_service.machine.cpu import detect
from engine_service.machine.precision import (
    choose_dtype,
    choose_dynamic_head,
    choose_onednn_weights,
    choose_quantize,
)
from engine_service.model.compiled_decode import CompiledDecode
from engine_service.model.loader import load_model
from engine_service.runtime.build import DTYPES
from engine_service.runtime.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=512, help="the cache's positions a row (--max-context)")
    parser.add_argument("--position", type=int, default=100, help="the row's position (it attends position + 1)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if not 1 <= args.position < args.context - 1:
        parser.error(f"--position {args.position}: must be 1..{args.context - 2} (--context {args.context})")
    cpu = detect()
    dtype_name, _ = choose_dtype("auto", "cpu", cpu)
    device = torch.device("cpu")
    loaded = load_model(args.model, device, DTYPES[dtype_name])
    quantize, _ = choose_quantize("auto", "cpu", loaded.weight_format)
    if quantize == "none":
        parser.error(f"--model {args.model}: its weights ({loaded.weight_format}) are served unquantized, and "
                     "--compile-decode auto compiles quantized models only")
    head, _ = choose_dynamic_head(quantize, "cpu", cpu)
    runner = ModelRunner(loaded.model, 1, args.context, device, DTYPES[dtype_name], quantize, True, head,
                         choose_onednn_weights(dtype_name, "cpu"), compile_decode=True)
    compiled = runner._decode
    if not isinstance(compiled, CompiledDecode):
        raise SystemExit(f"the step was not compiled: {runner.compiled_decode}")
    print(f"{loaded.name} in {dtype_name}, quantization {quantize}; CPU {cpu.describe()}; "
          f"{torch.get_num_threads()} threads", flush=True)
    tokens, positions = torch.full((1,), 100, dtype=torch.long), torch.full((1,), args.position, dtype=torch.long)
    steps = {"traced": compiled._fallback, "compiled": compiled}
    picks, keys = {}, {}
    for name, step in steps.items():
        runner.cache.k.zero_()
        picks[name] = int(step(tokens, positions).argmax(-1))
        keys[name] = runner.cache.k[:, 0, :, args.position].clone()
    print(f"token {'the same' if picks['traced'] == picks['compiled'] else 'DIFFERS'} {picks}; keys written: "
          f"largest difference {float((keys['traced'] - keys['compiled']).abs().max()):.4f} "
          f"(largest key {float(keys['traced'].abs().max()):.2f})", flush=True)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(5):
        for step in steps.values():
            step(tokens, positions)
    for _ in range(args.rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            step(tokens, positions)
            times[name].append(time.perf_counter() - started)
    tenth = max(args.rounds // 10, 1)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    for name, t in times.items():
        print(f"{name}: median {med[name]:.3f} ms, p10 {sorted(t)[tenth - 1] * 1e3:.3f} ms")
    print(f"compiled / traced median: {med['compiled'] / med['traced']:.3f}")


if __name__ == "__main__":
    main()
