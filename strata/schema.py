"""Declarative TOML tables: a frozen dataclass per table, one `option(...)` per key.

A table's dataclass is its schema. `build_table` checks every key of a TOML table against it:
an unknown key names its path and the nearest valid key; a bad value names the allowed values or
range. Loan plugins declare their own `[loan.<name>]` table the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from strata.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def option(default: Any = dataclasses.MISSING, *, doc: str, key: str | None = None,
           choices: tuple | None = None, min: float | None = None, max: float | None = None,
           kind: str | None = None, unsupported: str | None = None,
           unsupported_choices: Mapping[Any, str] | None = None,
           is_supported: Callable[[Any], bool] | None = None) -> Any:
    """A dataclass field that is also a TOML key.

    :param key: the TOML key when it differs from the field name (``vram_budget`` → ``vram_budget_bytes``).
    :param kind: ``"bytes"`` for sizes written as "8GiB" or a number of bytes; ``"path"`` for files.
    :param unsupported: a feature of the reference write-up that Strata does not have, named for the
        error: any value but the default (or one ``is_supported`` accepts) is refused at load.
    :param unsupported_choices: values a user may expect (value → the feature they name) that Strata
        does not have; refused as "not supported", apart from unknown values.
    """
    metadata = {"doc": doc, "key": key, "choices": choices, "min": min, "max": max, "kind": kind,
                "unsupported": unsupported, "unsupported_choices": unsupported_choices,
                "is_supported": is_supported}
    if isinstance(default, (list, dict)):
        raise TypeError("use a tuple or mapping proxy for a mutable default")
    return dataclasses.field(default=default, metadata=metadata)


def toml_key(field: dataclasses.Field) -> str:
    return field.metadata.get("key") or field.name


def _options(cls: type) -> list[dataclasses.Field]:
    """The fields made with ``option``; other fields are not TOML keys."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def parse_size_bytes(value: Any, path: str) -> int:
    """``"8GiB"`` → 8589934592; a plain integer is a number of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f'{path} = {value!r}: expected a size such as "8GiB", "64MiB" or a number of bytes')
    if isinstance(value, int):
        num_bytes = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _SIZE_UNITS:
        num_bytes = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ConfigError(
            f'{path} = {value!r}: expected a size such as "8GiB", "64MiB" or a number of bytes '
            f"(units: {', '.join(u for u in _SIZE_UNITS if u)})"
        )
    if num_bytes < 0:
        raise ConfigError(f"{path} = {value!r}: a size cannot be negative")
    return num_bytes


def unknown_key_error(key: str, path: str, valid: list[str]) -> ConfigError:
    where = f"{path}.{key}" if path else key
    nearest = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {path + '.' if path else ''}{nearest[0]}? " if nearest else ""
    return ConfigError(f"unknown key {where}: {hint}valid keys here: {', '.join(sorted(valid))}")


def build_table(cls: type, table: Mapping[str, Any], path: str, base_dir: Path | None = None) -> Any:
    """Validate one TOML table against the dataclass ``cls`` and return the frozen instance."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path} must be a table, got {type(table).__name__}")
    fields = {toml_key(f): f for f in _options(cls)}
    for key in table:
        if key not in fields:
            raise unknown_key_error(key, path, list(fields))
    values = {}
    for key, field in fields.items():
        where = f"{path}.{key}" if path else key
        if key in table:
            values[field.name] = _check_value(field, table[key], where, base_dir)
        elif field.default is dataclasses.MISSING:
            raise ConfigError(f"{where} is required: {field.metadata['doc']}")
    return cls(**values)


def _check_value(field: dataclasses.Field, value: Any, where: str, base_dir: Path | None) -> Any:
    meta = field.metadata
    kind = meta.get("kind")
    if kind == "bytes":
        value = parse_size_bytes(value, where)
    elif kind == "path":
        value = _check_path(value, where, base_dir)
    else:
        value = _check_type(field.type, value, where)
    _refuse_unsupported(field, value, where)
    if meta.get("choices") is not None and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{where} = {value!r}: allowed values are {allowed}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{where} = {value!r}: must be in the range {_fmt_range(lo, hi)}")
    return value


def _refuse_unsupported(field: dataclasses.Field, value: Any, where: str) -> None:
    """A value asking for a feature Strata does not have is an error whatever else is configured: a
    key that is accepted and then does nothing would let a user believe the feature runs."""
    meta = field.metadata
    feature = (meta.get("unsupported_choices") or {}).get(value)
    if feature is not None:
        allowed = ", ".join(repr(c) for c in meta["choices"] or ())
        raise ConfigError(f"{where} = {value!r}: {feature} is not supported by Strata; allowed values are {allowed}")
    feature = meta.get("unsupported")
    is_supported = meta.get("is_supported") or (lambda v: v == field.default)
    if feature is not None and not is_supported(value):
        raise ConfigError(f"{where} = {short_value(value)}: {feature} is not supported by Strata; remove {where} "
                          f"(or set it to {toml_value(field.default)})")


def short_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def _check_path(value: Any, where: str, base_dir: Path | None) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where} = {value!r}: expected a file path (a string)")
    if value.startswith("package:"):
        return Path(value)  # resolved by the model layer through importlib, never a hub
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path


def _check_type(annotation: Any, value: Any, where: str) -> Any:
    expected = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    checks: dict[str, Callable[[Any], bool]] = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
        "tuple[float, ...]": lambda v: isinstance(v, (list, tuple))
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
    }
    check = checks.get(expected)
    if check is None:
        raise TypeError(f"schema field {where} has unsupported type {expected}")
    if not check(value):
        raise ConfigError(f"{where} = {value!r}: expected {_describe(expected)}")
    if expected == "float":
        return float(value)
    if expected.startswith("tuple"):
        return tuple(float(x) for x in value) if "float" in expected else tuple(value)
    return value


def _describe(expected: str) -> str:
    return {
        "bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
        "tuple[str, ...]": "a list of strings", "tuple[float, ...]": "a list of numbers",
    }[expected]


def _fmt_range(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"[{lo}, {hi}]"
