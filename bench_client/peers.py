"""Where the heavy peers live: llama.cpp's binaries, built once by `make peers`
(benchmarks/llamacpp.py) from the source that the `llama-cpp-python` sdist vendors.

The cache is `$LLAMACPP_CACHE`, else ~/.cache/engine-bench/llamacpp-<version>/; the binaries are in
its build/bin/. `$LLAMA_SERVER` names a llama-server of your own instead.
"""

from __future__ import annotations

import os
from pathlib import Path

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp


class PeerMissing(FileNotFoundError):
    """A peer server is not built (or not where it was said to be); the message says how to get it."""


def llamacpp_cache() -> Path:
    env = os.environ.get("LLAMACPP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "engine-bench" / f"llamacpp-{LLAMACPP_VERSION}"


def llamacpp_bin_dir() -> Path:
    return llamacpp_cache() / "build" / "bin"


def llama_server() -> Path:
    """The llama-server binary: $LLAMA_SERVER, else the one `make peers` built."""
    env = os.environ.get("LLAMA_SERVER")
    path = Path(env) if env else llamacpp_bin_dir() / "llama-server"
    if not path.is_file() or not os.access(path, os.X_OK):
        source = f"$LLAMA_SERVER={env!r}" if env else f"the peers cache ({path})"
        raise PeerMissing(f"llama-server is not an executable file at {source}: run `make peers` to build it "
                          "(about 15-20 minutes on 2 cores), or set LLAMA_SERVER to a llama-server binary")
    return path
