"""The house keeps its plan: engine_service's rooms import only the rooms below them, each folder
says what it owns, and the drawing's tool finds what breaks the rule (tools/import_floors.py)."""

from __future__ import annotations

import ast

import pytest

from tools import import_floors
from tools.import_floors import ROOMS, ROOT, floors, graph, violations


def test_every_import_of_the_engine_runs_down() -> None:
    g = graph()
    assert violations(g) == []
    assert {import_floors.room(m) for m in g} <= set(ROOMS)  # every room is placed


def test_each_folder_has_a_face_saying_what_it_owns() -> None:
    folders = sorted(p for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert [p.name for p in folders] == ["generation", "machine", "model", "runtime", "scheduling", "transport"]
    for folder in folders:
        face = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert face and len(face.split()) >= 30, f"{folder.name}/__init__.py: its docstring is its face"
        assert folder.name in ROOMS


def test_an_upward_import_and_a_cycle_are_named() -> None:
    g = {"engine_service.model.llama": {"engine_service.runtime.loop"}, "engine_service.runtime.loop": set()}
    assert violations(g) == ["engine_service.model.llama -> engine_service.runtime.loop: model imports runtime, "
                             "which is above it"]
    assert violations({"engine_service.attic.x": {"engine_service.model.llama"}}) == [
        "engine_service.attic.x -> engine_service.model.llama: room 'attic' is not in ROOMS"]
    with pytest.raises(ValueError, match="import cycle: a -> b -> a"):
        floors({"a": {"b"}, "b": {"a"}})
    assert floors({"a": {"b"}, "b": set()}) == {"a": 1, "b": 0}


def test_imports_under_type_checking_are_annotations_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nimport engine_service.model.llama\n"
                      "if TYPE_CHECKING:\n    from engine_service.runtime import loop\n")
    known = {"engine_service.model.llama", "engine_service.runtime.loop", "engine_service.runtime"}
    assert import_floors.imports(module, known) == {"engine_service.model.llama"}


def test_every_class_name_is_used_once_across_the_packages() -> None:
    defined: dict[str, list[str]] = {}
    for package in ("engine_service", "bench_client", "shared", "drills", "tools", "benchmarks"):
        for path in sorted((ROOT.parent / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    defined.setdefault(node.name, []).append(str(path.relative_to(ROOT.parent)))
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}
