"""The one registry of training modes: each name ``fit(mode=...)`` accepts, and the mode object that runs it.

A new mode is a ``modes.base.Mode`` subclass in a module of its own, added to ``_MODES`` here.
"""

from __future__ import annotations

from sparkdl.modes.average.mode import AverageMode
from sparkdl.modes.base import Mode
from sparkdl.modes.parameter_server.mode import ParameterServerMode
from sparkdl.modes.sync.mode import SyncMode

_MODES: tuple[Mode, ...] = (SyncMode(), ParameterServerMode(), AverageMode())

MODES: dict[str, Mode] = {name: mode for mode in _MODES for name in mode.names}


def check_mode_options(mode: str, names: dict[str, str] | None = None, **options) -> dict:
    """Checks the settings only some modes take: one that ``mode`` does not take, or a bad value, is an error.

    ``options`` maps each such setting to its value (``None``: left out). ``names`` maps a setting
    (and ``mode``) to what the errors call it, e.g. a job's flags (``{"mode": "--mode",
    "max_staleness": "--max-staleness"}``); by default the argument names. Returns the options
    ``mode`` takes, with their values.
    """
    names = names or {}

    def called(name):
        return names.get(name, f"`{name}`")

    def shown(name, value):
        return f"{names[name]} {value}" if name in names else f"{name}={value!r}"

    if mode not in MODES:
        raise ValueError(f"Expected {called('mode')} to be one of {list(MODES)}. Received: {shown('mode', mode)}")
    taken = MODES[mode].options(mode)
    for name, value in options.items():
        if value is None:
            continue
        if name not in taken:
            takers = [other for other in MODES if name in MODES[other].options(other)]
            modes = (
                f"{names['mode']} {' or '.join(takers)}"
                if "mode" in names
                else "mode=" + " or ".join(map(repr, takers))
            )
            raise ValueError(
                f"{called(name)} applies to {modes} only. Received: {shown(name, value)} with {shown('mode', mode)}"
            )
        option = taken[name]
        if option.check is not None:
            option.check(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < option.minimum:
            kind = "non-negative" if option.minimum == 0 else "positive"
            raise ValueError(f"Expected {called(name)} to be a {kind} integer. Received: {shown(name, value)}")
    for name, option in taken.items():
        if option.required and options.get(name) is None:
            raise ValueError(f"{shown('mode', mode)} needs {called(name)}: {option.meaning}.")
    return {name: options.get(name) for name in taken}
