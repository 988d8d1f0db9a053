"""The custom classes and functions a model needs, found on the driver and shipped to the workers with the job.

Loading a model, Keras finds a custom class or function only in ``custom_objects`` or in its registry
(``keras.saving.register_keras_serializable``), and a process's registry holds only what that process
imported. A class defined in the driver's script or notebook (``__main__``), in a module beside it, or
registered there at run time is unknown to the workers, and an unregistered one even to the driver's own
``load_model``. So sparkdl reads the model's config (what its ``.keras`` archive holds), takes every
object it names that is not Keras's own, and looks each one up on the driver: in the ``custom_objects``
given, in Keras's registry, in the module that defines it (``__main__`` for a script or notebook) and
among the model's own layers (classes defined inside a function). What it finds travels in the job's
closure keyed as Keras looks it up (:class:`ShippedObjects`), pickled by cloudpickle, by value where the
workers could not import it, and registered there under the name it was registered with on the driver (so that
the models the workers save name it as the driver does). What it cannot find is refused on the driver, before
any Spark job, naming the object and the fix.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import site
import sys
import sysconfig
import threading
import zipfile
from collections.abc import Iterator, Mapping
from types import FunctionType, ModuleType

from sparkdl import _compat

# Packages Keras imports objects from by itself (``serialization_lib._retrieve_class_or_fn``).
_KERAS_PACKAGES = {"keras", "keras_hub", "keras_cv", "keras_nlp"}
_PICKLING = threading.Lock()  # cloudpickle's by-value registry is global: one pickling at a time changes it


class ShippedObjects(dict):
    """Custom objects by the names Keras looks them up with, pickled with cloudpickle: classes and functions whose
    module the workers could not import (``__main__``, a module outside site-packages) by value."""

    def __reduce__(self):
        return _unpickled, (_pickled(dict(self)),)


def for_model(model, given: Mapping | None = None, *, setting: str = "custom_objects") -> dict:
    """The custom objects a live model needs (its config's, found as the module docstring says), with ``given``.

    On tf.keras 2 (the Horovod stack) ``given`` as it is: that Keras finds registered objects by importing their
    modules, which travel by reference, as they always did.
    """
    if _compat.keras_major() < 3:
        return dict(given or {})
    import keras

    return needed(keras.saving.serialize_keras_object(model), given, _layer_classes(model), setting=setting)


def for_archive(data: bytes, given: Mapping | None = None, *, setting: str = "custom_objects") -> dict:
    """The custom objects the model in ``.keras`` archive ``data`` needs, with ``given`` (tf.keras 2: ``given``)."""
    if _compat.keras_major() < 3:
        return dict(given or {})
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        config = json.loads(archive.read("config.json"))
    return needed(config, given, setting=setting)


def needed(
    config: dict, given: Mapping | None = None, classes: tuple[type, ...] = (), *, setting: str = "custom_objects"
) -> ShippedObjects:
    """The objects ``config`` (a serialized model) names that are not Keras's own, found in ``given``, Keras's
    registry, their modules or ``classes``; ``given`` travels whole. Raises ``ValueError`` for one not found."""
    found = ShippedObjects(given or {})
    for reference in _references(config):
        if reference.key in found:
            continue
        obj = reference.find(found, classes)
        if obj is None:
            raise MissingObject(reference, setting)
        if obj is not _KERAS_OWN:
            found[reference.key] = obj
    return found


@dataclasses.dataclass(frozen=True)
class _Reference:
    """One object a config names: a class (by its registered name) or a function (by its name)."""

    entry: dict  # its serialized form: module, class_name, config, registered_name

    @property
    def is_function(self) -> bool:
        return self.entry.get("class_name") == "function"

    @property
    def key(self) -> str:
        """The name Keras looks it up by, in ``custom_objects`` and in its registry."""
        if self.is_function:
            return str(self.entry.get("config"))
        return str(self.entry.get("registered_name") or self.entry["class_name"])

    @property
    def name(self) -> str:
        """Its Python name: a class's name, or a function's name without a registered package."""
        return self.key.rpartition(">")[2] if self.is_function else str(self.entry["class_name"])

    @property
    def module(self) -> str:
        """The module defining it (Keras writes none for ``__main__``, nor for functions)."""
        module = self.entry.get("module")
        return "__main__" if module in (None, "builtins") else str(module)

    def find(self, given: Mapping, classes: tuple[type, ...]):
        """The object on the driver (``_KERAS_OWN`` for a built-in function Keras finds itself), or None."""
        import keras

        for name in (self.key, self.name):
            if name in given:
                return given[name]
        registered = keras.saving.get_custom_objects().get(self.key)
        if registered is not None:
            return registered
        module = sys.modules.get(self.module)
        defined = vars(module).get(self.name) if module is not None else None
        if defined is not None and (callable(defined) if self.is_function else isinstance(defined, type)):
            return defined
        for cls in classes:  # classes defined inside a function, found among the model's layers
            if not self.is_function and cls.__name__ == self.name and cls.__module__ == self.module:
                return cls
        if self.is_function and _keras_resolves(self.entry):
            return _KERAS_OWN
        return None

    @property
    def what(self) -> str:
        return "function" if self.is_function else "class"


class MissingObject(ValueError):
    """A custom class or function the model uses that sparkdl cannot find on the driver (``reference`` names it)."""

    def __init__(self, reference: _Reference, setting: str):
        self.reference = reference
        r = reference
        super().__init__(
            f"The model uses the custom {r.what} {r.name!r} (module {r.module!r}, looked up by Keras as {r.key!r}), "
            f"which sparkdl cannot find in this process to send to the workers: it is not in `{setting}`, not "
            "registered with Keras, and not defined at the top level of its module. Define it at the top level of "
            f"your script, notebook or a module, or pass it in `{setting}` ({{{r.key!r}: {r.name}}})."
        )


_KERAS_OWN = object()  # a name Keras resolves itself (one of its built-in functions)


def _references(config) -> Iterator[_Reference]:
    """Every object ``config`` names that Keras does not import itself, depth first."""
    if isinstance(config, list):
        for item in config:
            yield from _references(item)
    elif isinstance(config, dict):
        if "class_name" in config and "module" in config:
            module = config["module"] or ""
            is_function = config["class_name"] == "function"
            if module.split(".")[0] not in _KERAS_PACKAGES and (module != "builtins" or is_function):
                yield _Reference(config)
        for value in config.values():
            yield from _references(value)


def _keras_resolves(entry: dict) -> bool:
    """Whether Keras finds a function by itself (its built-in ``relu``, ``mse``, ...), with no custom objects."""
    import keras

    try:
        keras.saving.deserialize_keras_object(entry)
        return True
    except (TypeError, ValueError):
        return False


def _layer_classes(model) -> tuple[type, ...]:
    flatten = getattr(model, "_flatten_layers", None)
    layers = flatten(include_self=True) if flatten is not None else [model, *getattr(model, "layers", [])]
    return tuple({type(layer) for layer in layers})


def _pickled(objects: dict) -> bytes:
    """``objects`` pickled by cloudpickle, the modules the workers may not have by value (``__main__`` always is)."""
    from pyspark import cloudpickle

    names = {getattr(obj, "__module__", None) for obj in objects.values()}
    local = [
        sys.modules[n] for n in names if n and n != "__main__" and n in sys.modules and not _installed(sys.modules[n])
    ]
    with _PICKLING:
        already = set(cloudpickle.list_registry_pickle_by_value())
        added = [module for module in local if module.__name__ not in already]
        for module in added:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cloudpickle.dumps(objects)
        finally:
            for module in added:
                cloudpickle.unregister_pickle_by_value(module)


def _unpickled(data: bytes) -> ShippedObjects:
    from pyspark import cloudpickle

    objects = ShippedObjects(cloudpickle.loads(data))
    _register_shipped_names(objects)
    return objects


def _register_shipped_names(objects: Mapping) -> None:
    """Registers with this process's Keras each class or function shipped under a registered name (``package>name``).

    A class pickled by value is a new class in the process that unpickles it, unknown to Keras's registry there, so a
    model the worker saves would name it by its bare ``__name__``: the driver, loading that model, could not find a
    class defined inside a function by that name (it has no module to look in). Registered again here, it is saved
    under the name the driver registered it with.
    """
    import keras

    for key, obj in objects.items():
        package, _, name = key.rpartition(">")
        shippable = isinstance(obj, FunctionType) or (isinstance(obj, type) and hasattr(obj, "get_config"))
        if package and shippable and keras.saving.get_registered_name(obj) != key:
            keras.saving.register_keras_serializable(package, name)(obj)


def _installed(module: ModuleType) -> bool:
    """Whether ``module`` comes with the Python installation or a package installed in it (not user files beside
    a script), which the workers are expected to have as the driver does."""
    path = getattr(module, "__file__", None)
    if path is None:  # built into the interpreter, or a namespace package
        return True
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    path = os.path.realpath(path)
    return any(path.startswith(os.path.realpath(root) + os.sep) for root in roots)
