"""The engine's house drawn from its imports: which rooms import which, floor by floor.

    python -m tools.import_floors [--modules]

Reads every module of engine_service/ (its `import` and `from ... import` statements, those under
`if TYPE_CHECKING:` left out: annotations import nothing at run time) and prints the rooms from the
top floor down, each with what it imports; `--modules` prints the module graph instead, a floor a
line (a module's floor is one above the highest it imports). A room is a folder of engine_service/
(transport, runtime, scheduling, generation, machine, model) or one of its top-level modules.
`ROOMS` is the order the house keeps, top to bottom: a room imports only rooms below it
(tests/test_architecture.py holds it to that; `violations` says where it does not).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "engine_service"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Top to bottom. Each room may import any room after it, none before it (nor, for a folder, itself
# upward: within a folder modules import each other freely, the folder's face says how).
ROOMS: tuple[str, ...] = (
    "__main__", "cli", "healthcheck",  # the command line
    "transport",                       # the wire: gRPC server, servicer, security, telemetry
    "runtime",                         # the engine built whole, the decode loop, the model runner
    "config",                          # frozen configurations
    "faults",                          # the drills' injected faults
    "scheduling",                      # who runs where: scheduler, step plan, sequences, prefix cache
    "generation",                      # a request's controls: sampling, penalties, grammar, stop text
    "requests",                        # the frozen domain request and its parse
    "machine",                         # the CPU's capabilities and the precision chosen from them
    "model",                           # the decoder, its KV cache, checkpoints and tokenizers
)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file for every module of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that `path` imports at run time."""
    known = set(known)
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for child in node.body for n in ast.walk(child)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return out - {PACKAGE}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the package itself left out)."""
    mods = modules(root)
    return {name: imports(path, mods) - {name} for name, path in mods.items() if name != PACKAGE}


def room(module: str) -> str:
    """The room of `engine_service.X...`: X."""
    return module.split(".")[1]


def rooms(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import."""
    out: dict[str, set[str]] = {}
    for module, imported in g.items():
        out.setdefault(room(module), set()).update(room(m) for m in imported if room(m) != room(module))
    return out


def violations(g: dict[str, set[str]]) -> list[str]:
    """Each import that runs up (or sideways into a room not in ROOMS), as 'module -> module'."""
    rank = {name: i for i, name in enumerate(ROOMS)}
    out = []
    for module, imported in sorted(g.items()):
        for m in sorted(imported):
            a, b = room(module), room(m)
            if a not in rank or b not in rank:
                out.append(f"{module} -> {m}: room {a if a not in rank else b!r} is not in ROOMS")
            elif a != b and rank[b] <= rank[a]:
                out.append(f"{module} -> {m}: {a} imports {b}, which is above it")
    return out


def floors(g: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 for one that imports none of the package, else one above the highest
    it imports. Raises ValueError on an import cycle."""
    memo: dict[str, int] = {}

    def floor(m: str, path: tuple[str, ...]) -> int:
        if m in path:
            raise ValueError(f"import cycle: {' -> '.join((*path[path.index(m):], m))}")
        if m not in memo:
            memo[m] = 1 + max((floor(d, (*path, m)) for d in g.get(m, ())), default=-1)
        return memo[m]

    for m in g:
        floor(m, ())
    return memo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="the module graph, a floor a line")
    args = ap.parse_args(argv)
    g = graph()
    if args.modules:
        by_floor: dict[int, list[str]] = {}
        faces = {m for m, path in modules().items() if path.name == "__init__.py"}
        for m, f in floors(g).items():
            if m not in faces:  # a folder's face imports nothing
                by_floor.setdefault(f, []).append(m.removeprefix(f"{PACKAGE}."))
        for f in sorted(by_floor, reverse=True):
            print(f"floor {f:2d}: {', '.join(sorted(by_floor[f]))}")
    else:
        r = rooms(g)
        for name in ROOMS:
            if name in r:
                below = [x for x in ROOMS if x in r[name]]
                print(f"{name:<12} -> {', '.join(below) or '(nothing of the package)'}")
    bad = violations(g)
    for line in bad:
        print(f"UPWARD: {line}")
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} imports between them, "
          f"{max(floors(g).values()) + 1} floors; {len(bad)} imports run up")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
