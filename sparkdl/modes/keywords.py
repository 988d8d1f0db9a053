"""``sparkdl.fit``'s modes and mode keywords, made from the registry: its signature and its docstring's lists."""

from __future__ import annotations

import inspect
import textwrap

from sparkdl.modes.registry import MODES, declared_options, on_change


def with_mode_options(function):
    """``function`` with its docstring's ``{modes}`` and ``{mode_options}`` filled from the registry (every mode name
    with its summary, every declared option), and each option as a keyword of its signature (``None``: left out), so
    that ``help(sparkdl.fit)`` and notebooks' completion show them; both follow the registry as modes are registered.
    """
    template = function.__doc__
    parameters = list(inspect.signature(function).parameters.values())

    def render() -> None:
        declared = declared_options()
        function.__doc__ = template.replace("{modes}", _modes()).replace("{mode_options}", _options(declared))
        keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in declared]
        function.__signature__ = inspect.Signature([*parameters[:-1], *keywords, parameters[-1]])

    on_change(render)
    return function


def _modes() -> str:
    """Each mode name and its summary, as the docstring's lines (its first line without the section's indent)."""
    lines = [
        textwrap.fill(f'``"{name}"``: {mode.summary(name)}', 110, initial_indent=" " * 8, subsequent_indent=" " * 12)
        for name, mode in MODES.items()
    ]
    return "\n".join(lines).lstrip()  # the placeholder's line keeps its indent


def _options(declared) -> str:
    lines = []
    for name, entry in declared.items():
        option = entry.option
        default = (
            " Required." if option.required else "" if option.default is None else f" Default: {option.default!r}."
        )
        text = f"{name} ({option.expected()}): {entry.described()}.{default}"
        lines.append(textwrap.fill(text, 110, initial_indent=" " * 8, subsequent_indent=" " * 12))
    return "\n".join(lines).lstrip()
