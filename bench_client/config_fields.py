"""Typed readers of a parsed TOML table: each names the key and the value it rejects (ConfigError)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key and the value."""


def check_keys(prefix: str, raw: Mapping[str, Any], allowed: set[str]) -> None:
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"unknown key {prefix}{key} (value {raw[key]!r}); known keys: "
                              f"{', '.join(prefix + k for k in sorted(allowed))}")


def read_table(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table, got {value!r}")
    return value


def read_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def read_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def read_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def read_float(name: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def read_int_list(name: str, value: Any, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a non-empty list of integers, got {value!r}")
    items = tuple(read_int(f"{name}[{i}]", item, minimum=minimum) for i, item in enumerate(value))
    if len(set(items)) != len(items):
        raise ConfigError(f"{name} must not repeat a value, got {value!r}")
    return items


def read_rate_list(name: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a non-empty list of numbers or \"inf\", got {value!r}")
    rates: list[float] = []
    for i, item in enumerate(value):
        if item == "inf":
            rates.append(math.inf)
        elif isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) or item <= 0:
            raise ConfigError(f"{name}[{i}] must be a positive number of requests/s or \"inf\", got {item!r}")
        else:
            rates.append(float(item))
    if len(set(rates)) != len(rates):
        raise ConfigError(f"{name} must not repeat a value, got {value!r}")
    return tuple(rates)
