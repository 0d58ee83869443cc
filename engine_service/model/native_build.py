"""The engine's C++ kernels built at run time, with the C++ compiler the compiled step uses: the
int4 kernels (q4_matmul.py), decode attention (decode_attention.py) and a layer's small operators
(layer_ops.py). A library is compiled once (about 10 s) into the compile cache
(compiled_decode.cache_dir, a `<source>-<digest>.so` keyed on the source, torch's version, the
compiler and the flags) and loaded from there after."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch.utils import cpp_extension

log = structlog.get_logger()


@dataclass(frozen=True)
class Kernel:
    name: str  # what the engine's choice and the compiled step's key call it
    source: Path
    flags: tuple[str, ...]  # the instruction sets it is compiled for, and its defines
    op: str  # the operator it registers, "namespace::name"


_loaded: dict[str, Path] = {}


def library_path(cache: Path, compiler: str, kernel: Kernel) -> Path:
    """Where the library built from `kernel`'s source by `compiler` for this torch is kept."""
    digest = hashlib.sha256(kernel.source.read_bytes())
    digest.update(f"{torch.__version__} {compiler} {torch._C._GLIBCXX_USE_CXX11_ABI} {kernel.flags}".encode())
    return cache / f"{kernel.source.stem}-{digest.hexdigest()[:32]}.so"


def compile_library(compiler: str, target: Path, kernel: Kernel) -> None:
    """Compile `kernel`'s source into `target`, by way of a temporary file in its directory (a reader never
    sees half a library). Raises RuntimeError with the compiler's output when it fails or takes
    over 10 minutes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    source = kernel.source
    command = [compiler, "-O3", *kernel.flags, "-fopenmp", "-shared", "-fPIC", "-std=c++20",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", partial,
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{compiler} did not finish building {source.name} in {err.timeout:.0f} s") from err
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode} building {source.name}: {done.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


def load(compiler: str, cache: Path, kernel: Kernel, fake: Callable[..., torch.Tensor] | None) -> Path:
    """Build `kernel`'s library if it is not in `cache`, and load it (once a process): then its
    operator runs. `fake` gives its output's shape and dtype from its inputs' (what torch.export,
    the compiled step, needs of it; None for a library the compiled step never calls). Raises
    RuntimeError (the compiler's failure, or torch's refusal to load) or OSError (the cache
    directory's)."""
    if kernel.name in _loaded:
        return _loaded[kernel.name]
    target = library_path(cache, compiler, kernel)
    if not target.exists():
        log.info("kernel_compile_started", kernel=kernel.name, library=str(target))
        compile_library(compiler, target, kernel)
    torch.ops.load_library(str(target))
    if fake is not None:
        torch.library.register_fake(kernel.op)(fake)
    _loaded[kernel.name] = target
    return target


def operator(kernel: Kernel) -> Callable[..., torch.Tensor]:
    """`kernel`'s operator, `torch.ops.<namespace>.<name>` (its library loaded)."""
    namespace, name = kernel.op.split("::")
    return getattr(getattr(torch.ops, namespace), name)
