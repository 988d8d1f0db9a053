"""A job's checks of its own options, run before Spark starts, and its errors, which name the job's flags.

An error ends the job as argparse ends it for a bad flag: one line on stderr, exit status 2, no
Java or Python trace. The library's errors (raised once Spark runs) name ``sparkdl.fit``'s
arguments; ``in_flags`` rewrites them with the job's flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import NoReturn
from urllib.parse import urlparse


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Ends the job like an argparse error: ``<prog>: error: <message>`` on one line, exit status 2."""
    parser.exit(2, f"{parser.prog}: error: {' '.join(message.split())}\n")


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's flag by its name in snake_case (``max_staleness``: ``--max-staleness``), and ``mode``."""
    return {
        action.dest: action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.option_strings[0].startswith("--")
    }


def in_flags(message: str, flags: dict[str, str]) -> str:
    """A library error with the job's flags for the arguments it names (```num_workers```, ``num_workers=2``).

    The options that are not sparkdl's settings (``master``: Spark's, under spark-submit) keep their names.
    """
    flags = {name: flag for name, flag in flags.items() if name not in ("config", "master", "remote", "verbose")}
    message = re.sub(r"`(\w+)`", lambda m: flags.get(m.group(1), m.group(0)), message)
    return re.sub(r"\b(\w+)=", lambda m: f"{flags[m.group(1)]} " if m.group(1) in flags else m.group(0), message)


def check_numbers(args: argparse.Namespace, flags: dict[str, str], rules: dict[str, tuple]) -> None:
    """``rules`` maps an option to ``(test, what it must be)``; unset (None) options are skipped."""
    for name, (test, expected) in rules.items():
        value = getattr(args, name)
        if value is not None and not test(value):
            raise ValueError(f"Expected {flags[name]} to be {expected}. Received: {flags[name]} {value}")


def local_path(path: str) -> str | None:
    """The local file system path ``path`` names (a plain path or a ``file:`` URI), or None for other schemes."""
    parsed = urlparse(path)
    if parsed.scheme == "file":
        return parsed.path
    return path if parsed.scheme == "" or len(parsed.scheme) == 1 else None  # "c:\..." is a local path too


def check_exists(flag: str, path: str, *, remote: bool, plain_path_is_local: bool) -> None:
    """A missing input fails here rather than after Spark starts.

    Checked: ``file:`` URIs, and plain paths where Spark's default file system is this machine's
    (``plain_path_is_local``: a local master). Left to Spark: other schemes (hdfs:, s3a:, ...), plain
    paths on a cluster (``fs.defaultFS`` decides), and everything over Spark Connect (``remote``: the
    server reads the data).
    """
    local = local_path(path)
    if remote or local is None or not (plain_path_is_local or urlparse(path).scheme == "file"):
        logging.getLogger("sparkdl-job").info("%s %s: checked by Spark when it reads it", flag, path)
        return
    if not os.path.exists(local):
        raise ValueError(f"{flag} {path}: no such file or directory (looked in {os.path.abspath(local)})")


def check_custom_objects(flag: str, model_path: str, objects: dict | None) -> None:
    """Every custom class or function the ``.keras`` file at ``model_path`` uses can be found here: given with
    ``--custom-objects``, or registered with Keras by a module the job imported. A missing one stops the job before
    Spark starts, naming it (the model's weights are not read)."""
    from sparkdl.keras.shipped_objects import MissingObject, for_archive

    with open(model_path, "rb") as f:
        data = f.read()
    try:
        for_archive(data, objects)
    except MissingObject as e:
        r = e.reference
        raise ValueError(
            f"{flag} {model_path} uses the custom {r.what} {r.name!r} (module {r.module!r}), which the job cannot "
            f"find: give its import path with --custom-objects (e.g. --custom-objects my_module.{r.name}), from a "
            "module the job can import (on PYTHONPATH, or given to spark-submit with --py-files)."
        ) from None
