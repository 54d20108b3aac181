"""Settings declared once, read from four places.

A settings class is a dataclass whose fields are declared with `setting(...)`: a default, a
help text and an optional check. From that one declaration come:
- the command-line flags (`add_flags`): `--chunk-size`, a repeatable flag for a list,
  `--x/--no-x` for a boolean;
- the environment (`LMCACHE_MP_CHUNK_SIZE`; list items separated by whitespace);
- a TOML file (`chunk_size = 256`), and `to_toml`, which writes one back;
- the settings tables of docs/configuration.md (`markdown_table`).

Precedence, for every setting: flag > environment > file > default (`resolve`). A value of the
wrong type, an unknown key in the file or a failed check (`check`) raises `SettingError`, whose
message is one line naming the setting and what to change.

The vLLM connector's settings are declared the same way but come from one place, a dict of
prefixed keys (`kv_connector_extra_config`'s `lmcache.mp.*`): `from_keys` reads them, and
`markdown_table(cls, prefix)` writes docs/configuration.md's table of those keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "LMCACHE_MP_"

Check = Callable[[Any], str | None]  # a message saying what is wrong, or None


class SettingError(ValueError):
    """A setting that cannot be used; the message names it and says what to change."""


def positive(value: float) -> str | None:
    """A check for `setting(check=...)`: above zero (NaN is not)."""
    return None if value > 0 else "must be positive"


def setting(default: Any, help: str, *, check: Check | None = None, metavar: str | None = None,
            choices: tuple[str, ...] | None = None, default_text: str | None = None) -> Any:
    """A dataclass field declared as a setting. `default` may be a callable (evaluated when the
    settings are built, e.g. a path under the runtime directory); `default_text` describes a
    default that is not a plain value."""
    meta = {"help": help, "check": check, "metavar": metavar, "choices": choices,
            "default_text": default_text}
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    kind: type  # int, float, str, bool or list (of str)
    optional: bool  # None allowed: "not set"
    field: dataclasses.Field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    def default_text(self) -> str:
        text = self.field.metadata["default_text"]
        if text is not None:
            return text
        default = self.field.default
        if self.field.default_factory is not dataclasses.MISSING:
            default = self.field.default_factory()
        return _show(default)


def _specs(cls: type) -> list[_Spec]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = False
        if isinstance(hint, types.UnionType):  # X | None
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint, optional = args[0], True
        kind = typing.get_origin(hint) or hint
        specs.append(_Spec(f.name, kind, optional, f))
    return specs


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


# ---- the four sources -------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting. Flags default to 'not given' so `resolve` can tell them apart."""
    for spec in _specs(cls):
        meta = spec.field.metadata
        text = f"{spec.help} (default: {spec.default_text()}; env {spec.env})".replace("%", "%%")
        common: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": text}
        if spec.kind is bool:
            parser.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **common)
        elif spec.kind is list:
            parser.add_argument(spec.flag, action="append", metavar=meta["metavar"] or "VALUE", **common)
        else:
            parser.add_argument(spec.flag, type=_parser_of(spec), metavar=meta["metavar"],
                                choices=meta["choices"], **common)


def resolve(cls: type, flags: argparse.Namespace, environ: Mapping[str, str] | None = None,
            config_file: Path | None = None) -> Any:
    """Build `cls` from flags > environment > file > defaults. Values of the wrong type are
    refused here; the settings' own checks run in `check` (a config printed for another
    machine need not pass them here)."""
    environ = os.environ if environ is None else environ
    from_file = _read_toml(cls, config_file) if config_file is not None else {}
    values: dict[str, Any] = {}
    for spec in _specs(cls):
        if hasattr(flags, spec.name):
            values[spec.name] = getattr(flags, spec.name)
        elif spec.env in environ:
            values[spec.name] = _from_text(spec, environ[spec.env], f"environment variable {spec.env}")
        elif spec.name in from_file:
            values[spec.name] = from_file[spec.name]
    return cls(**values)


def check(settings: Any) -> None:
    """Run each setting's own check; the first failure raises."""
    for spec in _specs(type(settings)):
        value = getattr(settings, spec.name)
        if value is None:
            continue
        choices = spec.field.metadata["choices"]
        if choices and value not in choices:
            raise SettingError(f"{spec.name} ({spec.flag}) is {value!r}: use one of {', '.join(choices)}")
        run = spec.field.metadata["check"]
        problem = run(value) if run else None
        if problem:
            raise SettingError(f"{spec.name} ({spec.flag}) is {_show(value)}: {problem}")


def _read_toml(cls: type, path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise SettingError(f"cannot read the config file {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingError(f"the config file {path} is not valid TOML: {err}") from None
    specs = {spec.name: spec for spec in _specs(cls)}
    for key, value in data.items():
        spec = specs.get(key)
        if spec is None:
            raise SettingError(f"the config file {path} has an unknown setting {key!r} "
                               f"(known: {', '.join(specs)})")
        if not _has_kind(spec, value):
            raise SettingError(f"{key} in {path} is {value!r}: expected {_kind_name(spec)}")
    return data


def _has_kind(spec: _Spec, value: Any) -> bool:
    if spec.kind is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if spec.kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if spec.kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, spec.kind)


def _kind_name(spec: _Spec) -> str:
    return {list: "a list of strings", float: "a number", int: "an integer", bool: "true or false",
            str: "a string"}[spec.kind]


def _parser_of(spec: _Spec) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return spec.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_kind_name(spec)}") from None
    return parse


def _from_text(spec: _Spec, text: str, where: str) -> Any:
    if spec.kind is list:
        return text.split()
    if spec.kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
    else:
        try:
            return spec.kind(text)
        except ValueError:
            pass
    raise SettingError(f"{where} is {text!r}: expected {_kind_name(spec)}")


# ---- prefixed keys (the vLLM connector's) ----------------------------------------------------


def from_keys(cls: type, values: Mapping[str, Any], prefix: str, where: str) -> Any:
    """Build `cls` from the keys of `values` that start with `prefix` (the others are someone
    else's), each `prefix` + a setting's name; a missing one, or one that is None, takes its
    default. Values are converted to the setting's kind (JSON gives typed values, a command line
    strings: "false" is False) and checked (`choices`, `check`). An unknown key (a typo would
    otherwise fall back to a default unnoticed), a value that does not convert or a failed check
    raises `SettingError` naming the key; `where` names `values` in the message."""
    ours = {key.removeprefix(prefix): value for key, value in values.items() if key.startswith(prefix)}
    specs = _specs(cls)
    unknown = sorted(set(ours) - {spec.name for spec in specs})
    if unknown:
        raise SettingError(f"unknown {where} keys: {[prefix + name for name in unknown]}")
    given: dict[str, Any] = {}
    for spec in specs:
        if ours.get(spec.name) is None:
            continue
        value = given[spec.name] = _from_value(spec, ours[spec.name], prefix + spec.name)
        choices = spec.field.metadata["choices"]
        run = spec.field.metadata["check"]
        problem = f"must be one of {', '.join(choices)}" if choices and value not in choices else None
        problem = problem or (run(value) if run else None)
        if problem:
            raise SettingError(f"{prefix}{spec.name} {problem}, not {value!r}")
    return cls(**given)


def _from_value(spec: _Spec, value: Any, key: str) -> Any:
    """A typed value (JSON) as the setting's kind, or a string read as on a command line
    (`_from_text`); anything else (3.7 for an integer, "flase" for a flag) is refused."""
    if isinstance(value, str):
        return _from_text(spec, value, key)
    if spec.kind is bool and value in (0, 1):
        return bool(value)
    if not _has_kind(spec, value):
        raise SettingError(f"{key} is {value!r}: expected {_kind_name(spec)}")
    return float(value) if spec.kind is float else value


# ---- derived documents ------------------------------------------------------------------------


def to_toml(settings: Any) -> str:
    """The settings as a config file that `resolve` reads back to the same values; a setting
    that is None (not set) is written as a comment."""
    lines = []
    for spec in _specs(type(settings)):
        value = getattr(settings, spec.name)
        lines.append(f"# {spec.help}")
        if value is None:
            lines.append(f"# {spec.name} =  (default: {spec.default_text()})")
        else:
            lines.append(f"{spec.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def markdown_table(cls: type, prefix: str | None = None) -> str:
    """docs/configuration.md's settings table; with `prefix`, the table of the keys `from_keys` reads."""
    if prefix is None:
        rows = ["| setting (file) | flag | environment | default | meaning |", "|---|---|---|---|---|"]
    else:
        rows = ["| key | default | meaning |", "|---|---|---|"]
    for spec in _specs(cls):
        meaning = spec.help.replace("|", "\\|")
        if prefix is None:
            names = f"`{spec.name}` | `{spec.flag}` | `{spec.env}`"
        else:
            names = f"`{prefix}{spec.name}`"
        rows.append(f"| {names} | {spec.default_text()} | {meaning} |")
    return "\n".join(rows)
