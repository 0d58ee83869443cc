"""The LM head's kernels on this machine, timed as a decode step meets them: weights out of cache.

    python benchmarks/lm_head.py [--model smollm2] [--rows 1,2,4,8,16,32] [--threads 2] [--rounds 15]

The model's head (SmolLM2's 49,152 x 576, tied to the embedding) is multiplied by random rows of
its hidden size, four ways, in alternation, a 256 MB buffer written before each call so that the
weights come from memory, as they do after a step's layers:
  - float32: `F.linear` on the float32 table (113 MB a call);
  - weight-only int8: quantize.quantize_int8's copy with bfloat16 activations (quantize.kernel_dtype),
    what a float32 model's head runs without VNNI;
  - fbgemm 8-bit: quantize.quantize_dynamic_int8's copy, 8-bit activations (the head on VNNI/AMX);
  - fbgemm 7-bit: the same copy with `reduce_range` (activations cut to 7 bits).
Prints the CPU and each kernel's median ms per row count. The fbgemm rows time the kernels only:
on a CPU without VNNI the 8-bit one saturates (README, Precision), so its result is not the head's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_service.machine.cpu import detect
from engine_service.model.loader import load_model
from engine_service.model.quantize import kernel_dtype, quantize_dynamic_int8, quantize_int8

FLUSH_FLOATS = 64 * 2**20  # 256 MB, above the last-level caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not all(r > 0 for r in rows) or args.rounds < 1 or args.threads < 1:
        parser.error(f"--rows {args.rows!r}, --rounds {args.rounds} and --threads {args.threads} must be positive")
    torch.set_num_threads(args.threads)
    head = load_model(args.model, torch.device("cpu"), torch.float32).model.lm_head.weight.detach()
    weight_only = quantize_int8(head, max(rows), kernel_dtype(head.dtype))
    dynamic = quantize_dynamic_int8(head, max(rows))
    kernels = {
        "float32": lambda x: F.linear(x, head),
        "weight-only int8": weight_only.matmul,
        "fbgemm 8-bit": dynamic.matmul,
        "fbgemm 7-bit": lambda x: torch.ops.quantized.linear_dynamic(x, dynamic.packed, True),
    }
    flush = torch.empty(FLUSH_FLOATS)
    print(f"# {args.model} head {tuple(head.shape)}, {args.threads} threads, CPU {detect().describe()}")
    print(f"{'rows':>4}  " + "  ".join(f"{name:>16}" for name in kernels) + "   (median ms)")
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, head.shape[1])
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.rounds):
                for name, kernel in kernels.items():
                    flush.fill_(1.0)
                    started = time.perf_counter()
                    kernel(x)
                    times[name].append(time.perf_counter() - started)
            print(f"{n:>4}  " + "  ".join(f"{statistics.median(t) * 1e3:16.2f}" for t in times.values()), flush=True)


if __name__ == "__main__":
    main()
