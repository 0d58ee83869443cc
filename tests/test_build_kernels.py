"""`python -m engine_service.runtime.build_kernels` (`make setup`'s last step): every kernel of the
engine built into the compile cache, each named; one already there left alone; one the compiler
cannot build named with its reason while the step still succeeds (the engine serves with torch's
kernel in its place); no compiler, nothing to do. The real compile of every kernel is `make setup`'s
(about 40 s on 2 cores); here the cache is given the libraries' names, or the compiler fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine_service.machine.precision import find_cpp_compiler
from engine_service.model import native_build
from engine_service.runtime import build_kernels


def test_every_kernel_of_the_engine_is_built() -> None:
    names = {kernel.name for kernel in build_kernels.KERNELS}
    assert names == {"float32", "int16", "int8", "amx", "decode_attention", "decode_attention_avx512_bf16",
                     "prompt_attention", "layer_ops"}
    # decode attention's two builds share one source, as the int16 and int8 kernels do
    assert len({kernel.source for kernel in build_kernels.KERNELS}) == 6


def test_kernels_in_the_cache_are_left_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    compiler = find_cpp_compiler() or "g++"
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    for kernel in build_kernels.KERNELS:
        native_build.library_path(tmp_path, shutil.which(compiler) or compiler, kernel).write_bytes(b"built before")
    assert build_kernels.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["float32", "int16", "int8", "amx", "decode_attention",
                                                      "decode_attention_avx512_bf16", "prompt_attention", "layer_ops"]
    assert all(": in the cache (" in line for line in lines), lines
    assert {p.read_bytes() for p in tmp_path.iterdir()} == {b"built before"}


def test_a_kernel_the_compiler_cannot_build_is_named_and_the_step_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CXX", "false")  # on the PATH, exits 1
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    assert build_kernels.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8, lines
    assert lines[0].startswith("float32: not built, the engine will use torch's in its place: ")
    assert "exited 1 building q4_matmul.cpp" in lines[0]
    assert "exited 1 building q4_int16.cpp" in lines[1] and "exited 1 building q4_int16.cpp" in lines[2]
    assert "exited 1 building decode_attention.cpp" in lines[4] and "exited 1 building decode_attention.cpp" in lines[5]
    assert "exited 1 building prompt_attention.cpp" in lines[6]
    assert "exited 1 building layer_ops.cpp" in lines[7]
    assert list(tmp_path.iterdir()) == []  # no half-written library


def test_without_a_compiler_nothing_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("ENGINE_COMPILE_CACHE", str(tmp_path))
    assert build_kernels.main() == 0
    assert capsys.readouterr().out.startswith("no C++ compiler (g++, or $CXX): nothing to build")
    assert list(tmp_path.iterdir()) == []
