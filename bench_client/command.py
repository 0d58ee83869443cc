"""Server command templates: the placeholders a managed server's command may use, and filling them.

Builtins, filled by the runner:
- `{python}`: this interpreter (so `{python} -m engine_service` runs the engine of this install);
- `{port}`: the port the server is to listen on (see engine_process.py for how it is chosen);
- `{llama_server}`: llama.cpp's `llama-server`, as `make peers` builds it ($LLAMA_SERVER, else the
  peers cache: bench_client/peers.py);
- `{smollm2_gguf}`: the packaged SmolLM2-135M-Instruct GGUF file that the engine's `smollm2` serves.
Every key of the server's grid is a placeholder too; a grid setting the command does not mention
is appended as `--key-name value`.
"""

from __future__ import annotations

import string
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_client import peers
from bench_client.config_fields import ConfigError


def _smollm2_gguf() -> Path:
    from engine_service.model.presets import PACKAGED  # the engine's own record of the packaged file

    return PACKAGED["smollm2"].locate("smollm2")


# Placeholders that the runner fills in itself; grid keys may not reuse them. The paths are looked
# up only when a command uses them (a missing peer is an error of that server, at its start).
_LOOKUPS: dict[str, Callable[[], Path | str]] = {
    "python": lambda: sys.executable,
    "llama_server": peers.llama_server,
    "smollm2_gguf": _smollm2_gguf,
}
BUILTIN_PLACEHOLDERS = frozenset({"port", *_LOOKUPS})


def placeholders(part: str) -> list[str]:
    """The placeholder names of one command part ("{port}" -> ["port"])."""
    return [name for _, name, _, _ in string.Formatter().parse(part) if name is not None]


def check_command(name: str, command: Any, grid_keys: Sequence[str]) -> tuple[str, ...]:
    """A command template as the TOML gave it, checked: a non-empty list of strings whose
    placeholders are builtins or grid keys, with `{port}`."""
    if not isinstance(command, list) or not command or not all(isinstance(p, str) for p in command):
        raise ConfigError(f"{name} must be a non-empty list of strings, got {command!r}")
    known = BUILTIN_PLACEHOLDERS | set(grid_keys)
    for part in command:
        for placeholder in placeholders(part):
            if placeholder not in known:
                raise ConfigError(f"{name} placeholder {{{placeholder}}} is neither a builtin "
                                  f"({', '.join(sorted(BUILTIN_PLACEHOLDERS))}) nor a key of the grid, "
                                  f"got it in {part!r}")
    if not any("port" in placeholders(part) for part in command):
        raise ConfigError(f"{name} must contain the placeholder {{port}} (the runner chooses the port of each "
                          f"server), got {command!r}")
    return tuple(command)


def build_command(command: Sequence[str], settings: Mapping[str, Any], port: int) -> list[str]:
    """Fill the template; grid settings it does not mention are appended as `--key-name value`.
    A builtin path that cannot be found raises peers.PeerMissing naming how to get it."""
    used = {name for part in command for name in placeholders(part)}
    values = {"port": str(port), **{key: str(lookup()) for key, lookup in _LOOKUPS.items() if key in used},
              **{key: _flag_value(value) for key, value in settings.items()}}
    filled = [part.format(**values) for part in command]
    for key, value in settings.items():
        if key not in used:
            filled += [f"--{key.replace('_', '-')}", _flag_value(value)]
    return filled


def _flag_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
