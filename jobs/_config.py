"""Job options from a TOML file (``--config FILE``), overridden by the flags given on the command line.

    spark-submit jobs/train.py --config conf/jobs/train-async.toml --epochs 5

A key is an option's flag in snake_case (``num_workers`` for ``--num-workers``) and its value must
have the option's type. The file's values become the parser's defaults, so a flag always wins. An
unknown key or a wrong type stops the job before any Spark session starts, naming the file and key.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence

import tomllib


def column_spec(text: str):
    """A columns option on the command line: a column, ``a,b,c`` (a list), or a JSON object mapping the model's
    input (or output) names to those: ``'{"numeric": "x", "user": "user_id"}'``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        return _columns(value)
    return text.split(",") if "," in text else text


def _columns(value):
    """A TOML or JSON columns value, checked: a string, a list of strings, or a table of either."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return value
    if isinstance(value, dict) and value and all(isinstance(v, (str, list)) for v in value.values()):
        return {key: _columns(v) for key, v in value.items()}
    raise ValueError(f"expected a column name, a list of them, or a table of either. Received: {value!r}")


def names(text: str) -> list[str]:
    """A mode option that takes a list of strings, on the command line: ``a,b,c``."""
    return [part.strip() for part in text.split(",")]


def import_paths(text: str) -> dict:
    """``--custom-objects``: comma-separated import paths (``my_layers.Scale``) of the custom classes and functions a
    model uses, imported here: ``{"Scale": <the class>}``."""
    objects = {}
    for path in filter(None, (part.strip() for part in text.split(","))):
        module, _, name = path.rpartition(".")
        try:
            objects[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise argparse.ArgumentTypeError(
                f"{path!r} is not an importable module.Name ({type(e).__name__}: {e}); the module must be importable "
                "by the job (on PYTHONPATH, or given to spark-submit with --py-files)"
            ) from None
    return objects


# What a TOML value may be for an option of each argparse type (None: argparse's default, str).
# bool is excluded on purpose: TOML's `true` is not an integer, although Python's bool is an int.
_ACCEPTED_TYPES = {
    int: (int,),
    float: (int, float),
    str: (str,),
    None: (str,),
    column_spec: (str, list, dict),
    import_paths: (str,),
    names: (str, list),
}
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    None: "a string",
    import_paths: "a string of comma-separated import paths",
    names: "a list of strings (or one string of comma-separated ones)",
    column_spec: "a column name, a list of column names, or a table from the model's input (output) names to those",
}


def add_mode_options(parser: argparse.ArgumentParser, declared: dict) -> None:
    """A flag for each option the modes declare (``sparkdl.modes.registry.declared_options``): ``--push-every N``,
    ``--overlap``/``--no-overlap``, ``--compression {bf16,fp16}``, ``--cut-points dense_2,dense_4``; left out (None)
    unless given."""
    for entry in declared.values():
        option = entry.option
        help_text = entry.described() + (" (required)" if option.required else "")
        if option.kind is bool:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif option.kind is list:
            parser.add_argument(option.flag, type=names, metavar="NAME,...", help=help_text)
        else:
            parser.add_argument(option.flag, type=option.kind, choices=option.choices or None, help=help_text)


def job_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the ``--config`` option every job takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file of option values (keys in snake_case); flags override them"
    )
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses ``argv`` with the ``--config`` file's values as defaults; a bad file exits like a bad flag."""
    config_only = argparse.ArgumentParser(add_help=False)
    config_only.add_argument("--config")
    path = config_only.parse_known_args(argv)[0].config
    if path is not None:
        try:
            parser.set_defaults(**load_config(path, parser))
        except (OSError, ValueError) as e:
            parser.error(str(e))
    return parser.parse_args(argv)


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The file's values, each checked against the parser's option of the same name."""
    with open(path, "rb") as f:
        try:
            values = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path} is not valid TOML: {e}") from None
    options = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    unknown = sorted(set(values) - set(options))
    if unknown:
        raise ValueError(
            f"Unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in {path}. "
            f"Expected keys among: {', '.join(sorted(options))}"
        )
    return {key: _checked_value(path, key, value, options[key]) for key, value in values.items()}


def _checked_value(path: str, key: str, value, option: argparse.Action):
    """The value as the option's type would give it (a TOML integer for a float option becomes a float)."""
    if isinstance(option, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(
                f"Expected {key!r} in {path} to be true or false (as {option.option_strings[0]}). Received: {value!r}"
            )
        return value
    accepted = _ACCEPTED_TYPES[option.type]
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise ValueError(
            f"Expected {key!r} in {path} to be {_TYPE_NAMES[option.type]} "
            f"(as {option.option_strings[0]}). Received: {value!r}"
        )
    if option.choices is not None and value not in option.choices:
        raise ValueError(f"Expected {key!r} in {path} to be one of {list(option.choices)}. Received: {value!r}")
    if option.type is column_spec:
        try:
            return column_spec(value) if isinstance(value, str) else _columns(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"Expected {key!r} in {path} to be {_TYPE_NAMES[column_spec]}: {e}") from None
    if option.type is names and isinstance(value, list) and not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"Expected {key!r} in {path} to be {_TYPE_NAMES[names]}. Received: {value!r}")
    return float(value) if option.type is float else value
