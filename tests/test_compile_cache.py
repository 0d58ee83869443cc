"""The compile cache's retention (engine_service/model/compile_cache.py): a compiled step's library
no engine has loaded for 30 days is removed, one used since stays, and so do the files that are not
compiled steps' (the kernels' libraries, anything else); loading a library marks it used. The
compile itself, which prunes, is a minute or two (tests/test_compiled_decode.py, `-m compile`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from structlog.testing import capture_logs

from engine_service.model import compile_cache

DAY = 86400


def _file(directory: Path, name: str, age_days: float, now: float, size: int = 10) -> Path:
    path = directory / name
    path.write_bytes(b"x" * size)
    os.utime(path, (now - age_days * DAY, now - age_days * DAY))
    return path


def test_libraries_unused_for_30_days_are_removed_and_the_rest_stay(tmp_path: Path) -> None:
    now = 1_700_000_000  # the clock given, not the machine's: every age below is counted from it
    old = [_file(tmp_path, "decode-aaaa.pt2", 31, now, 100), _file(tmp_path, "decode-gggg.999-partial.pt2", 31, now, 1),
           _file(tmp_path, "verify-bbbb.pt2", 30 + 10 / DAY, now, 50)]  # and a killed compile's leftover
    kept = [_file(tmp_path, "decode-cccc.pt2", 29, now), _file(tmp_path, "verify-dddd.pt2", 0, now),
            _file(tmp_path, "verify-eeee.pt2", 30, now),  # last loaded 30 days ago to the second: not yet
            _file(tmp_path, "q4_int16-eeee.so", 400, now), _file(tmp_path, "notes.txt", 400, now),
            _file(tmp_path, "decode-ffff.1234-partial.pt2", 29.9, now)]
    with capture_logs() as logs:
        removed = compile_cache.prune(tmp_path, now=now)
    assert removed == old
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    [event] = [e for e in logs if e["event"] == "compile_cache_pruned"]
    assert event["libraries"] == ["decode-aaaa.pt2", "decode-gggg.999-partial.pt2", "verify-bbbb.pt2"]
    assert (event["directory"], event["bytes"], event["unused_days"]) == (str(tmp_path), 151, 30)


def test_nothing_to_remove_logs_nothing(tmp_path: Path) -> None:
    now = time.time()
    _file(tmp_path, "decode-aaaa.pt2", 1, now)
    with capture_logs() as logs:
        assert compile_cache.prune(tmp_path, now=now) == []
    assert logs == []


def test_loading_a_library_marks_it_used(tmp_path: Path) -> None:
    now = time.time()
    library = _file(tmp_path, "decode-aaaa.pt2", 45, now)
    compile_cache.touch(library)
    assert compile_cache.prune(tmp_path) == []
    assert library.exists() and library.stat().st_mtime > now - 60


def test_a_library_that_cannot_be_removed_stays_and_is_named(tmp_path: Path) -> None:
    now = time.time()
    stuck = tmp_path / "decode-aaaa.pt2"  # a directory of a library's name: unlink refuses it, root or not
    stuck.mkdir()
    os.utime(stuck, (now - 45 * DAY, now - 45 * DAY))
    gone = tmp_path / "decode-0000.pt2"  # removed by another engine between the listing and the look
    gone.symlink_to(tmp_path / "nothing")
    after = _file(tmp_path, "decode-bbbb.pt2", 45, now)
    with capture_logs() as logs:
        assert compile_cache.prune(tmp_path, now=now) == [after]
    assert stuck.exists()
    [event] = [e for e in logs if e["event"] == "compile_cache_prune_failed"]
    assert (event["library"], event["error_type"]) == (str(stuck), "IsADirectoryError")
    assert "Is a directory" in event["error"]
