"""`kvrt launch --config FILE`: a node's options in a TOML (or YAML) file.

Why the file only sets defaults of the launch parser: the command line then overrides it with
no second merge rule, and every value still goes through the same checks as a flag. Keys are
the long flag names without the dashes in front, with `-` or `_` (`num-gpu-blocks`,
`num_gpu_blocks`). A key that is no option, or a value of the wrong type, is refused naming the
key, before anything starts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

YAML_SUFFIXES = (".yaml", ".yml")
NOT_IN_FILE = ("help", "config")  # options a file cannot set


class ConfigFileError(ValueError):
    """The file cannot be read, or a key or a value in it is wrong; the message names them."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's top-level table: YAML for .yaml/.yml (needs PyYAML), TOML otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read it ({e.strerror})") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        try:
            import yaml
        except ImportError:
            raise ConfigFileError(f"{path}: a YAML file needs PyYAML (pip install pyyaml); or write it as "
                                  f"TOML") from None
        try:
            table = yaml.safe_load(data)
        except yaml.YAMLError as e:
            raise ConfigFileError(f"{path}: not valid YAML: {e}") from None
        table = {} if table is None else table
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        try:
            table = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigFileError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(table, dict):
        raise ConfigFileError(f"{path}: the file must hold a table of option = value, got a "
                              f"{type(table).__name__}")
    return table


def config_defaults(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """The file's values as defaults for `parser` (dest -> value), each checked against its
    option: the key must name one, the value must have its type (and be one of its choices)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_IN_FILE}
    out: dict[str, Any] = {}
    for key, value in read_config_file(path).items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigFileError(f"{path}: unknown key {key!r}: not an option of {parser.prog} (keys are the long "
                                  f"flag names, e.g. num-gpu-blocks)")
        if dest in out:
            raise ConfigFileError(f"{path}: key {key!r} given twice (with '-' and with '_')")
        out[dest] = _checked(path, key, value, action)
    return out


def _checked(path: str | Path, key: str, value: Any, action: argparse.Action) -> Any:
    if action.nargs == 0 and action.const is True:  # a store_true flag
        want, ok = "true or false", isinstance(value, bool)
    elif action.nargs == "+" and action.type is None:  # strings: a list, or one string as its only item
        value = [value] if isinstance(value, str) else value
        want, ok = "a string or a non-empty list of strings", \
            isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
    elif action.type is int:
        want, ok = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif action.type is float:
        want, ok = "a number", isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif action.type is None:
        want, ok = "a string", isinstance(value, str)
    else:  # a flag with its own parser: give it the text, as the command line would
        want, ok = "a string or a number", isinstance(value, (str, int, float)) and not isinstance(value, bool)
        if ok:
            try:
                value = action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ConfigFileError(f"{path}: key {key!r}: {e}") from None
    if not ok:
        raise ConfigFileError(f"{path}: key {key!r} must be {want}, got {value!r} ({type(value).__name__})")
    if action.choices is not None and value not in action.choices:
        raise ConfigFileError(f"{path}: key {key!r} must be one of {', '.join(map(str, action.choices))}, "
                              f"got {value!r}")
    return value
