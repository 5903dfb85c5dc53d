"""Configuration of the recipes: dataclass sections, TOML presets, ``key=value`` overrides.

Each recipe's ``config.py`` declares a ``Config`` dataclass whose fields are section dataclasses
(``data``, ``model``, ``optim``, ``train``) with a docstring per field, and a ``presets/`` folder of
TOML files. This module loads one: the defaults, then the preset's values, then overrides from the
command line as ``section.key=value`` (``key=value`` when only one section has that key, and
``data=DIR`` for ``data.path``). Values are read as TOML (``0.1``, ``true``, ``[0.9, 0.98]``);
anything TOML cannot read is taken as a string. Unknown presets, sections and keys and values of
the wrong type raise :class:`ConfigError` naming them and what is expected. :func:`dump` writes the
effective configuration as TOML, which :func:`load` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Generic, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "Presets",
    "check_choice",
    "check_positive",
    "dump",
    "load",
    "parse_override",
    "preset_names",
]

C = TypeVar("C")


class ConfigError(ValueError):
    """An unknown preset, section or key, or a value of the wrong type; the message says what is expected."""


def preset_names(presets: Path) -> list[str]:
    return sorted(p.stem for p in presets.glob("*.toml"))


class Presets(Generic[C]):
    """A recipe's ``Config`` type and preset folder: ``load(preset, overrides)`` and ``names()``."""

    def __init__(self, config_type: type[C], presets: Path) -> None:
        self.config_type, self.presets = config_type, presets

    def names(self) -> list[str]:
        return preset_names(self.presets)

    def load(self, preset: str | None, overrides: list[str] | None = None) -> C:
        """The default config, updated by the preset file and then by ``key=value`` overrides."""
        return load(self.config_type, self.presets, preset, overrides)


def load(config_type: type[C], presets: Path, preset: str | None, overrides: list[str] | None = None) -> C:
    """``config_type()``, updated by the preset (a name in ``presets``, or a .toml path), then overrides."""
    config = config_type()
    if preset:
        path = _preset_path(presets, preset)
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path} is not valid TOML: {error}") from None
        sections = _sections(config_type)
        for section, entries in values.items():
            if section not in sections or not isinstance(entries, dict):
                raise ConfigError(f"{path}: unknown section [{section}]; expected {', '.join(sections)}")
            for key, value in entries.items():
                _set(config, section, key, value, where=f"{path}")
    for item in overrides or []:
        section, key, value = parse_override(config_type, item)
        _set(config, section, key, value, where="command line")
    return config


def parse_override(config_type: type[Any], item: str) -> tuple[str, str, Any]:
    """``section.key=value`` (or ``key=value`` for a unique field name) -> (section, key, parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=100)")
    name, text = item.split("=", 1)
    name = name.strip()
    sections = _sections(config_type)
    if name == "data":
        section, key = "data", "path"
    elif "." in name:
        section, key = name.split(".", 1)
    else:
        owners = [s for s in sections if name in _fields(config_type, s)]
        if len(owners) != 1:
            known = ", ".join(f"{s}.{k}" for s in sections for k in _fields(config_type, s))
            raise ConfigError(f"unknown config key {name!r}: expected section.key, one of {known}")
        section, key = owners[0], name
    try:
        value: Any = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key, value


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` (of the setting ``name``) is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{name} = {value!r}: expected one of {', '.join(allowed)}")


def check_positive(section: Any, prefix: str, names: tuple[str, ...], *, zero: bool = False) -> None:
    """Raise ConfigError unless each of ``names`` in ``section`` is positive (or 0, with ``zero``)."""
    for name in names:
        value = getattr(section, name)
        if value < 0 or (value == 0 and not zero):
            expected = "0 or a positive integer" if zero else "a positive integer"
            raise ConfigError(f"{prefix}.{name} = {value}: expected {expected}")


def dump(config: Any) -> str:
    """The configuration as TOML (what :func:`load` reads back; a field that is None, unset, is left
    out: TOML has no null)."""
    lines: list[str] = []
    for section in _sections(type(config)):
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            if value is not None:
                lines.append(f"{key} = {json.dumps(list(value) if isinstance(value, tuple) else value)}")
        lines.append("")
    return "\n".join(lines)


def _preset_path(presets: Path, name: str) -> Path:
    """``presets/NAME.toml``, or ``name`` itself when it is a path to a TOML file."""
    candidate = Path(name)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    path = presets / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset {name!r}: expected one of {', '.join(preset_names(presets))} or a .toml file"
        )
    return path


def _sections(config_type: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(config_type)]


def _fields(config_type: type[Any], section: str) -> dict[str, Any]:
    """The fields of ``section`` and their types."""
    return typing.get_type_hints(typing.get_type_hints(config_type)[section])


def _set(config: Any, section: str, key: str, value: Any, where: str) -> None:
    sections = _sections(type(config))
    if section not in sections:
        raise ConfigError(
            f"{where}: unknown config section {section!r} in {section}.{key}; expected {', '.join(sections)}"
        )
    kinds = _fields(type(config), section)
    if key not in kinds:
        raise ConfigError(f"{where}: unknown config key {section}.{key}; [{section}] has {', '.join(kinds)}")
    setattr(getattr(config, section), key, _coerce(kinds[key], value, f"{where}: {section}.{key}"))


def _coerce(kind: Any, value: Any, name: str) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: a field that may be unset
        (given,) = [k for k in typing.get_args(kind) if k is not type(None)]
        return _coerce(given, value, name)
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str:
        return value if isinstance(value, str) else json.dumps(value)
    if typing.get_origin(kind) is tuple:
        items = typing.get_args(kind)
        if isinstance(value, (list, tuple)) and len(value) == len(items):
            return tuple(_coerce(k, v, name) for k, v in zip(items, value, strict=True))
        raise ConfigError(f"{name} = {value!r}: expected a list of {len(items)} values")
    raise ConfigError(f"{name} = {value!r}: expected {getattr(kind, '__name__', kind)}")
