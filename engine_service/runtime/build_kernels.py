"""`python -m engine_service.runtime.build_kernels`: build the engine's C++ kernels (the int4 kernels
of q4_matmul.py, decode attention's two builds of decode_attention.py, prompt attention of
prompt_attention.py, a layer's small operators of layer_ops.py) into the compile cache now, as
`make setup` does, rather than at the first engine start that needs each (about 10 s a kernel on 2 cores, one compiler a core here). Each is compiled
for its own instruction sets, whatever this CPU has: the engine decides at start-up which it runs.
A kernel already in the cache is left as it is.

The step is optional: a kernel that cannot be built is named with the compiler's reason and the
others are still built (exit 0), since the engine serves with torch's kernel in that one's place
and says so in `engine_ready`; without a C++ compiler there is nothing to build."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine_service.machine.precision import find_cpp_compiler
from engine_service.model import decode_attention, layer_ops, native_build, prompt_attention, q4_matmul
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.native_build import Kernel

KERNELS: tuple[Kernel, ...] = (*q4_matmul.KERNELS.values(), *decode_attention.KERNELS.values(),
                               prompt_attention.KERNEL, layer_ops.KERNEL)


def build(compiler: str, cache: Path, kernel: Kernel) -> str:
    """Build `kernel`'s library into `cache` unless it is there; a line saying what happened."""
    target = native_build.library_path(cache, compiler, kernel)
    if target.exists():
        return f"{kernel.name}: in the cache ({target})"
    started = time.monotonic()
    try:
        native_build.compile_library(compiler, target, kernel)
    except (RuntimeError, OSError) as err:
        # the compiler's failure or the cache directory's: an engine that would run this kernel tries
        # the build again at its start-up, says why it failed, and serves with torch's in its place
        return f"{kernel.name}: not built, the engine will use torch's in its place: {err}"
    return f"{kernel.name}: built in {time.monotonic() - started:.1f} s ({target})"


def main() -> int:
    compiler = find_cpp_compiler()
    if compiler is None:
        print("no C++ compiler (g++, or $CXX): nothing to build; the engine serves with torch's kernels")
        return 0
    cache = cache_dir()
    with ThreadPoolExecutor(max_workers=2) as pool:  # one compiler a core on the 2-core machines we run on
        for line in pool.map(lambda kernel: build(compiler, cache, kernel), KERNELS):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
