"""``sparkdl.fit``'s mode keywords, made from the options the modes declare: its signature and its docstring's list."""

from __future__ import annotations

import inspect
import textwrap

from sparkdl.modes.registry import declared_options


def with_mode_options(function):
    """``function``'s signature and docstring with each declared mode option as a keyword (``None``: left out), so
    that ``help(sparkdl.fit)`` and notebooks' completion show them; the options come from the modes themselves."""
    declared = declared_options()
    lines = []
    for name, entry in declared.items():
        option = entry.option
        default = (
            " Required." if option.required else "" if option.default is None else f" Default: {option.default!r}."
        )
        text = f"{name} ({option.expected()}): {entry.described()}.{default}"
        lines.append(textwrap.fill(text, 110, initial_indent=" " * 8, subsequent_indent=" " * 12))
    function.__doc__ = function.__doc__.replace("{mode_options}", "\n".join(lines).lstrip())  # the line's indent stays
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in declared]
    function.__signature__ = signature.replace(parameters=[*parameters[:-1], *keywords, parameters[-1]])
    return function
