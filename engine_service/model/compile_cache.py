"""How long the compile cache keeps a compiled step's library (compiled_decode.cache_dir).

Each library holds its own copy of the model's constants (SmolLM2's: 127 MB on disk), and is keyed
on the model, precision, context, CPU, threads and the code it was compiled from, so every change
of those leaves a new one beside the old. Nothing removed them: one developer's machine held 70
files, 5.8 GB, after two days. A library's file is touched each time an engine loads it, and when
an engine compiles a new one, libraries no engine has loaded for UNUSED_DAYS are removed (logged
`compile_cache_pruned`). One in use by a running engine is safe either way: AOTInductor loads a
package from a copy it extracts. An engine that finds its library gone compiles it again; one that
saw it a moment before it went serves with the traced step and says why (`decode_compile_failed`),
which for a library no engine had loaded for UNUSED_DAYS is a race no one should meet. The kernels'
libraries (native_build) are a few hundred kilobytes each and stay.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger()

UNUSED_DAYS = 30
PATTERNS = ("decode-*.pt2", "verify-*.pt2")  # the compiled steps' libraries (compiled_decode.py names them)


def touch(library: Path) -> None:
    """Mark `library` used now (its modification time)."""
    try:
        os.utime(library)
    except OSError:
        pass  # a cache on a read-only volume: it is never pruned from here either, so its age matters to no one


def prune(directory: Path, now: float | None = None) -> list[Path]:
    """Remove the compiled steps' libraries in `directory` not used for UNUSED_DAYS; the paths removed."""
    cutoff = (time.time() if now is None else now) - UNUSED_DAYS * 86400
    removed, freed = [], 0
    for path in sorted(p for pattern in PATTERNS for p in directory.glob(pattern)):
        try:
            stat = path.stat()
            if stat.st_mtime >= cutoff:
                continue
            path.unlink()
        except FileNotFoundError:
            continue  # another engine pruned it first
        except OSError as err:  # not ours to remove (another user's, a read-only volume): it stays
            log.warning("compile_cache_prune_failed", library=str(path), error_type=type(err).__name__, error=str(err))
            continue
        removed.append(path)
        freed += stat.st_size
    if removed:
        log.info("compile_cache_pruned", directory=str(directory), libraries=[p.name for p in removed],
                 bytes=freed, unused_days=UNUSED_DAYS)
    return removed
