"""The one registry of training modes: each name ``fit(mode=...)`` accepts, the mode object that runs it, and the
options the modes declare.

A new mode is a ``modes.base.Mode`` subclass in a module of its own, added to ``_BUILT_IN`` here, or
registered by another package: under the entry point group ``sparkdl.modes`` (found when sparkdl is
imported, so that ``jobs/train.py`` and the estimator see it too), or with :func:`register` at run time.
Its options (``Mode.options``) become ``sparkdl.fit`` keywords, ``KerasEstimator`` Params and job flags
without another edit (:func:`declared_options`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from importlib.metadata import entry_points

from sparkdl.modes.average.mode import AverageMode
from sparkdl.modes.base import Mode, Option
from sparkdl.modes.gossip.mode import GossipMode
from sparkdl.modes.parameter_server.mode import ParameterServerMode
from sparkdl.modes.pipeline.mode import PipelineMode
from sparkdl.modes.sharded.mode import ShardedMode
from sparkdl.modes.sync.mode import SyncMode

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sparkdl.modes"

_BUILT_IN: tuple[Mode, ...] = (
    SyncMode(),
    ShardedMode(),
    ParameterServerMode(),
    AverageMode(),
    PipelineMode(),
    GossipMode(),
)

MODES: dict[str, Mode] = {}
_LISTENERS: list[Callable[[], None]] = []  # called after each change of MODES: prose made from the registry


@dataclasses.dataclass(frozen=True)
class DeclaredOption:
    """An option as every mode taking it declares it, and the names of those modes."""

    option: Option
    modes: tuple[str, ...]

    def described(self) -> str:
        """``"async/hogwild/ssp: steps whose gradients make one push"``: for Param docs and help texts."""
        return f"{'/'.join(self.modes)}: {self.option.meaning}"


def register(mode: Mode) -> Mode:
    """Makes ``mode`` runnable under each of its names; a name already taken, or an option that another mode
    declares differently, is an error."""
    for name in mode.names:
        if name in MODES:
            raise ValueError(f"Mode name {name!r} is taken already (by {type(MODES[name]).__name__}).")
    for name in mode.names:
        MODES[name] = mode
    try:
        declared_options()  # two declarations of one option must agree
    except ValueError:
        unregister(mode)
        raise
    _changed()
    return mode


def unregister(mode: Mode) -> None:
    """Removes ``mode``'s names (a test's mode, or a plugin's being replaced)."""
    for name in mode.names:
        if MODES.get(name) is mode:
            del MODES[name]
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    """Calls ``listener`` now and after every change of the registry (``fit``'s docstring and signature follow it:
    ``modes.keywords``)."""
    _LISTENERS.append(listener)
    listener()


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


def declared_options() -> dict[str, DeclaredOption]:
    """Every option any registered mode takes, by name, in the order the modes declare them."""
    declared: dict[str, DeclaredOption] = {}
    for name, mode in MODES.items():
        for option in mode.options(name):
            known = declared.get(option.name)
            if known is None:
                declared[option.name] = DeclaredOption(option, (name,))
                continue
            if dataclasses.replace(known.option, required=False) != dataclasses.replace(option, required=False):
                raise ValueError(
                    f"Modes {known.modes[0]!r} and {name!r} declare the option {option.name!r} differently: "
                    f"{known.option} against {option}. Declare it once and share it (sparkdl.modes.shared_options)."
                )
            declared[option.name] = DeclaredOption(known.option, (*known.modes, name))
    return declared


def check_mode_options(mode: str, names: dict[str, str] | None = None, **options) -> dict:
    """Checks the settings only some modes take: one that ``mode`` does not take, or a bad value, is an error.

    ``options`` maps each such setting to its value (``None``: left out). ``names`` maps a setting
    (and ``mode``) to what the errors call it, e.g. a job's flags (``{"mode": "--mode",
    "max_staleness": "--max-staleness"}``); by default the argument names. Returns the options
    ``mode`` takes, with their values (their ``default`` where left out).
    """
    names = names or {}

    def called(name):
        return names.get(name, f"`{name}`")

    def shown(name, value):
        return f"{names[name]} {value}" if name in names else f"{name}={value!r}"

    if mode not in MODES:
        raise ValueError(f"Expected {called('mode')} to be one of {list(MODES)}. Received: {shown('mode', mode)}")
    taken = {option.name: option for option in MODES[mode].options(mode)}
    declared = declared_options()
    for name, value in options.items():
        if value is None:
            continue
        if name not in taken:
            takers = declared[name].modes if name in declared else ()
            if not takers:
                raise ValueError(f"Unknown mode option {called(name)}. Options the modes take: {sorted(declared)}")
            modes = (
                f"{names['mode']} {' or '.join(takers)}"
                if "mode" in names
                else "mode=" + " or ".join(map(repr, takers))
            )
            raise ValueError(
                f"{called(name)} applies to {modes} only. Received: {shown(name, value)} with {shown('mode', mode)}"
            )
        option = taken[name]
        if option.check is not None:  # first: its error says more than the kind's
            option.check(value)
        if not option.accepts(value):
            raise ValueError(f"Expected {called(name)} to be {option.expected()}. Received: {shown(name, value)}")
    for name, option in taken.items():
        if option.required and options.get(name) is None:
            raise ValueError(f"{shown('mode', mode)} needs {called(name)}: {option.meaning}.")
    return {name: option.default if options.get(name) is None else options[name] for name, option in taken.items()}


def _register_plugins() -> None:
    """The modes other packages declare under the ``sparkdl.modes`` entry point group (a ``Mode`` subclass or
    instance each); one that fails to load is logged and left out, not fatal to sparkdl."""
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            register(loaded() if isinstance(loaded, type) else loaded)
        except Exception:
            logger.warning(
                "sparkdl: the mode %r (entry point %s) could not be registered", entry.name, entry.value, exc_info=True
            )


for _mode in _BUILT_IN:
    register(_mode)
_register_plugins()
