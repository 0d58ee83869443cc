"""The float32 int4 kernel: float32 activations times 4-bit weights in Q4_1's blocks (`q4_matmul.cpp`,
AVX2 and FMA), built at run time with the C++ compiler the compiled step uses, for a float32 model's
int4 copies (`quantize.Q4Weight`; machine/precision.choose_q4_kernel decides where).

Why: torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) computes in bfloat16, so a float32 model's
calls are cast to bfloat16 and back, and where the CPU has no bfloat16 instructions (the AVX2 class,
where `auto` serves float32) the kernel emulates them. This one widens the 4-bit values to float32
in registers and multiplies there: the file's Q4_1 values exactly, no casts. Measured on an AMD EPYC
of family 26 model 2 with torch's dispatch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, the AVX2
class's kernels), SmolLM2's 120 layer projections of 30 distinct layers (53 MB, read from memory),
2 threads, ms a pass: see `docs/decode-speed.md`, "A float32 int4 kernel".

The library is compiled once (about 10 s) into the compile cache (compiled_decode.cache_dir, a
`q4_matmul-<digest>.so` keyed on the source, torch's version and the compiler) and loaded from
there after; `load` says why when it cannot be, and the bfloat16 kernel serves then.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch
from torch.utils import cpp_extension

log = structlog.get_logger()

SOURCE = Path(__file__).with_name("q4_matmul.cpp")
BLOCK = 32  # inputs a block: a scale, a low and 16 bytes of 4-bit values
_loaded: Path | None = None


def library_path(cache: Path, compiler: str) -> Path:
    """Where the library built from this source by `compiler` for this torch is kept."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {compiler} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    return cache / f"q4_matmul-{digest.hexdigest()[:32]}.so"


def _compile(compiler: str, target: Path) -> None:
    """Compile SOURCE into `target`, by way of a temporary file in its directory (a reader never
    sees half a library). Raises RuntimeError with the compiler's output when it fails or takes
    over 10 minutes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    command = [compiler, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", partial,
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{compiler} did not finish building {SOURCE.name} in {err.timeout:.0f} s") from err
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode} building {SOURCE.name}: {done.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


def load(compiler: str, cache: Path) -> Path:
    """Build the library if it is not in `cache`, and load it (once a process): then
    `torch.ops.engine_q4.matmul` runs. Raises RuntimeError (the compiler's failure, or torch's
    refusal to load) or OSError (the cache directory's)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    target = library_path(cache, compiler)
    if not target.exists():
        log.info("q4_kernel_compile_started", library=str(target))
        _compile(compiler, target)
    torch.ops.load_library(str(target))
    # what torch.export (the compiled step) needs of the op: its output's shape and dtype
    torch.library.register_fake("engine_q4::matmul")(_matmul_shape)
    _loaded = target
    return target


def _matmul_shape(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values 0..15 -> (N, K / 2) uint8 in Q4_1's order: byte j of a block of 32 holds
    value j in its low nibble and value j + 16 in its high one."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    return (blocks[..., :BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()
