"""Config dataclasses as command-line flags and YAML keys: the one mechanism behind ``train``, ``plan`` and ``bench``.

A config is a ``@dataclass(kw_only=True)`` whose fields are declared with :func:`option` (a default and a
help text, optionally ``choices``/``metavar``). Each field becomes a flag (``seq_len`` -> ``--seq-len``; a
bool ``pack`` -> ``--pack/--no-pack``; ``bool | str`` -> ``--resume [PATH]`` / ``--no-resume``; a tuple of
ints -> ``--lens 512,1024``) and a YAML key with the field's own name; a field without a default is required.
Optional fields read ``none`` as None, and a bool-or-path field reads it as false. Precedence: field defaults
< ``--config file.yaml`` < flags given. Bad values exit with status 2 and a message naming the flag
(``argparse``'s convention).

Why not tyro or simple-parsing: ``--resume [PATH]`` (a flag that is a bool or a path), ``none`` for optional
values and the YAML-then-flags precedence with flag-named errors are what ``ulysses-sp train`` promises; the
libraries each need custom hooks for two of the three, so the ~200 lines here are the smaller thing to keep.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "build_parser",
    "check_choices",
    "coerce_mapping",
    "flag_name",
    "from_mapping",
    "option",
    "parse_config",
    "read_yaml",
    "save_yaml",
    "to_mapping",
    "unrecognized_arguments",
]

T = TypeVar("T")
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", ""}


def option(
    default: Any = MISSING,
    *,
    help: str,  # noqa: A002 (argparse's own name for it)
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    default_factory: Callable[[], Any] | Any = MISSING,
) -> Any:
    """A config field: its default (none = required), the help text shown by ``--help``, choices, metavar."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "metavar": metavar}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_name(name: str) -> str:
    """The command-line flag of a config field: ``seq_len`` -> ``--seq-len``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class _Kind:
    types: tuple[type, ...]  # the non-None types of the field
    optional: bool  # None allowed
    sequence: bool  # tuple[int, ...]


def _kinds(cls: type) -> dict[str, _Kind]:
    hints = typing.get_type_hints(cls)
    result = {}
    for f in fields(cls):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        args = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
        kinds = tuple(a for a in args if a is not type(None))
        sequence = typing.get_origin(kinds[0]) is tuple
        if sequence:
            kinds = tuple(a for a in typing.get_args(kinds[0]) if a is not Ellipsis)
        result[f.name] = _Kind(kinds, type(None) in args, sequence)
    return result


def _scalar(label: str, value: Any, kind: type) -> Any:
    def bad(expected: str) -> ValueError:
        return ValueError(f"{label} expects {expected}, got {value!r}")

    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("true or false")
    if kind is int:
        number = _integer(value)
        if number is None:
            raise bad("an integer")
        if not -(2**63) <= number < 2**63:  # what torch and numpy hold (a larger seed or length failed on the ranks)
            raise bad("an integer of 64 bits (below 2**63)")
        return number
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad("a number") from None
        raise bad("a number")
    if kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    raise TypeError(f"unsupported config field type {kind!r} for {label}")


def _integer(value: Any) -> int | None:
    """``value`` (an int, an integral float or their text) as an int; None when it is none of them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                return None
    return int(number) if isinstance(number, float) and number.is_integer() else None


def _bool_or_path(label: str, value: Any) -> bool | str:
    """``--resume [PATH]``: true, false (also ``none``/``null`` and a YAML null, as optional fields read them) or a
    path. An empty string stays a path, for the config to refuse: ``--resume "$UNSET"`` is no choice of false."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        return False if lowered in _FALSE or (lowered and lowered in _NONE) else value
    raise ValueError(f"{label} expects true, false, none or a path, got {value!r}")


def _coerce(name: str, value: Any, kind: _Kind, where: str = "") -> Any:
    """A CLI string or a YAML value -> the field's type; ValueError naming the flag."""
    label = flag_name(name) + where
    if bool in kind.types and str in kind.types and not kind.sequence:  # bool-or-path, e.g. --resume [PATH]
        return _bool_or_path(label, value)
    if value is None or (kind.optional and isinstance(value, str) and value.strip().lower() in _NONE):
        if kind.optional:
            return None
        raise ValueError(f"{label} expects a value (it cannot be null), got {value!r}")
    if kind.sequence:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise ValueError(f"{label} expects a comma-separated list, got {value!r}")
        return tuple(_scalar(label, item, kind.types[0]) for item in items)
    return _scalar(label, value, kind.types[0])


def _default_text(f: dataclasses.Field) -> str:
    if f.default is MISSING and f.default_factory is MISSING:
        return "required"
    default = f.default if f.default is not MISSING else f.default_factory()
    if isinstance(default, bool):
        return flag_name(f.name) if default else "--no-" + flag_name(f.name)[2:]
    if isinstance(default, tuple):
        return ",".join(str(item) for item in default)
    return "none" if default is None else repr(default) if default == "" else str(default)


def _fields_by_class(cls: type) -> list[tuple[type, list[dataclasses.Field]]]:
    """The dataclass fields of ``cls`` grouped by the class that declares them, ``cls`` first."""
    result = []
    for owner in cls.__mro__:
        names = set(vars(owner).get("__annotations__", {}))
        own = [f for f in fields(cls) if f.name in names]
        if own and dataclasses.is_dataclass(owner):
            result.append((owner, own))
    return result


def build_parser(cls: type, *, prog: str, description: str, config_file: bool = True) -> argparse.ArgumentParser:
    """The argument parser of config class ``cls``: one flag per field, help texts and defaults from the fields.

    Defaults are suppressed in the namespace, so only flags actually given appear in it; that is what lets
    flags win over a ``--config`` YAML file.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    if config_file:
        parser.add_argument(
            "--config",
            metavar="FILE.yaml",
            help="YAML file with config keys (the flag names with underscores); flags given here win over it.",
        )
    kinds = _kinds(cls)
    for owner, own in _fields_by_class(cls):
        # the class's own flags first; inherited ones (e.g. the memory features) under their class's heading
        group = (
            parser
            if owner is cls
            else parser.add_argument_group((owner.__doc__ or owner.__name__).split("\n")[0].rstrip("."))
        )
        for f in own:
            flag, meta, kind = flag_name(f.name), f.metadata, kinds[f.name]
            help_text = f"{meta['help']} (default: {_default_text(f)})"
            if kind.types == (bool,) and not kind.sequence:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
            elif bool in kind.types:  # bool-or-path
                group.add_argument(flag, nargs="?", const=True, metavar=meta.get("metavar"), help=help_text)
                group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
            else:
                group.add_argument(flag, metavar=meta.get("metavar"), choices=meta.get("choices"), help=help_text)
    return parser


def coerce_mapping(cls: type, data: dict[str, Any], source: str) -> dict[str, Any]:
    """Check keys against the fields of ``cls`` and convert the values; ValueError on unknown keys or bad values."""
    kinds = _kinds(cls)
    values = {}
    for key, raw in data.items():
        if key not in kinds:
            close = difflib.get_close_matches(str(key), kinds, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {key!r} in {source}{hint}; valid keys: {', '.join(kinds)}")
        values[key] = _coerce(key, raw, kinds[key], where=f" (key {key!r} in {source})")
    return values


def check_choices(config: Any) -> None:
    """ValueError naming the flag when a field declared with ``choices`` holds another value (for ``validate``)."""
    for f in fields(config):
        choices, value = f.metadata.get("choices"), getattr(config, f.name)
        if choices and value is not None and value not in choices:
            raise ValueError(f"{flag_name(f.name)} must be one of {', '.join(choices)}; got {value!r}")


def _build(cls: type[T], values: dict[str, Any]) -> T:
    missing = [
        flag_name(f.name)
        for f in fields(cls)
        if f.name not in values and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def from_mapping(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """A validated ``cls`` from a YAML-style mapping (missing keys take their defaults)."""
    return _build(cls, coerce_mapping(cls, data, source))


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the plain loader keeps the last silently)."""


def _mapping_of_unique_keys(loader: _UniqueKeys, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, typing.Hashable):
            continue  # (construct_mapping refuses it)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_of_unique_keys)


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping in a ``--config`` YAML file; ValueError naming the file when it is missing or not a mapping."""
    if not os.path.isfile(path):
        raise ValueError(f"--config file not found: {path!r}")
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_UniqueKeys)  # a safe loader, refusing repeated keys
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path!r} is not valid YAML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path!r} cannot be read as UTF-8 text: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    config_file: bool = True,
    fill: Callable[[dict[str, Any]], None] | None = None,
    check_flags: Callable[[T, frozenset[str]], None] | None = None,
) -> T:
    """Parse ``argv`` into a validated ``cls``: ``--config`` YAML first, then the flags given over it.

    ``fill`` may add derived defaults to the values read (before the config is built). ``check_flags`` gets
    the built config and the field names given as flags on the command line with a value other than the YAML
    file's (not the file's keys, which a saved config holds all of): for a flag the user typed whose value would
    go unused. Any bad value exits
    with status 2 and a message naming the flag.
    """
    parser = build_parser(cls, prog=prog, description=description, config_file=config_file)
    namespace, extras = parser.parse_known_args(None if argv is None else list(argv))
    if extras:
        parser.error(unrecognized_arguments(parser, list(sys.argv[1:] if argv is None else argv), extras))
    namespace = vars(namespace)
    config_path = namespace.pop("config", None)
    try:
        values = coerce_mapping(cls, read_yaml(config_path), config_path) if config_path else {}
        kinds = _kinds(cls)
        typed = {name: _coerce(name, raw, kinds[name]) for name, raw in namespace.items()}
        # a flag typed with the value the file holds changes nothing (the original command again over its saved
        # config.yaml): it is checked as a key of the file
        given = frozenset(name for name, value in typed.items() if name not in values or values[name] != value)
        values.update(typed)
        if fill is not None:
            fill(values)
        config = _build(cls, values)
        if check_flags is not None:
            check_flags(config, given)
        return config
    except ValueError as error:
        parser.error(str(error))


def unrecognized_arguments(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> str:
    """argparse's "unrecognized arguments" line, with the fix where one is clear: the flag an unknown ``--flag`` was
    likely meant to be, and for words left after a flag's one value (an unquoted glob that the shell expanded into one
    word per file: ``--dataset data/*.jsonl`` over three files) that flag, the values it got and the quoting."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    flags = [option for action in parser._actions for option in action.option_strings]
    unknown = [word.split("=")[0] for word in extras if word.startswith("--")]
    if unknown:
        close = difflib.get_close_matches(unknown[0], flags, n=1)
        return message + (f" (did you mean {close[0]}?)" if close else "")
    # the value-taking flag that the last stray word follows (its last place: the same word may be an earlier
    # flag's value too), and every word from that flag's value up to the next flag
    last = len(argv) - 1 - argv[::-1].index(extras[-1])
    before = [i for i in range(last) if argv[i].startswith("-")]
    if not before:
        return message
    flag = argv[before[-1]].split("=")[0]
    takes_one = any(flag in action.option_strings and action.nargs is None for action in parser._actions)
    inline = argv[before[-1]].partition("=")[2]
    end = next((i for i in range(last, len(argv)) if argv[i].startswith("-")), len(argv))
    values = ([inline] if inline else []) + argv[before[-1] + 1 : end]
    if not takes_one or len(values) < 2:
        return message
    message = f"{flag} takes one value, got {len(values)}: {' '.join(values)}"
    if all(os.path.exists(value) for value in values):
        message += f". A glob the shell expanded? Quote it, e.g. {flag} {_glob_of(values)!r}"
    return message


def _glob_of(paths: list[str]) -> str:
    """A glob for ``paths`` (for the message): their common folder and, where they share one, their suffix."""
    folders = {os.path.dirname(path) for path in paths}
    suffixes = {os.path.splitext(path)[1] for path in paths}
    folder = folders.pop() if len(folders) == 1 else "FOLDER"
    return os.path.join(folder, "*" + (suffixes.pop() if len(suffixes) == 1 else ""))


def to_mapping(config: Any) -> dict[str, Any]:
    """The config as a plain mapping with the YAML key names (field order kept; tuples as lists)."""
    return {f.name: (list(v) if isinstance(v := getattr(config, f.name), tuple) else v) for f in fields(config)}


def save_yaml(config: Any, path: str | os.PathLike[str], header: str) -> Path:
    """Write the config as YAML to ``path`` (parents created) under a ``# header`` line; it loads with ``--config``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(to_mapping(config), sort_keys=False, default_flow_style=False)
    path.write_text(f"# {header}\n{text}", encoding="utf-8")
    return path
