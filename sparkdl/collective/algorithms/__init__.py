"""The registry of collective algorithms: which ones each operation has, and which one runs when the caller does not say.

Built in: ``ring`` (bandwidth-optimal, every rank moves 2(N-1)K/N: large arrays); ``tree`` (binomial,
log2(N) rounds: small arrays); ``naive`` (through one root or directly between ranks: the lectures'
baseline, and the natural way for gather, scatter, alltoall and messages); ``hierarchical`` (shared
memory within a host, a ring across hosts: allreduce, chosen whenever ranks share hosts);
``shared_memory`` (through the host's segment alone: reduce_scatter and allgather, chosen when one host
holds every rank). Each is a :class:`~.base.Algorithm` in a module of its own; another package adds one
with :func:`register_algorithm`, and every communicator then runs it when asked (``algorithm=`` per call,
or as the communicator's default) and the cost model counts it.
"""

from __future__ import annotations

from sparkdl.collective.algorithms.base import Algorithm, Sharing
from sparkdl.collective.algorithms.hierarchical import Hierarchical
from sparkdl.collective.algorithms.naive import Naive
from sparkdl.collective.algorithms.ring import Ring
from sparkdl.collective.algorithms.shared_memory import SharedMemory
from sparkdl.collective.algorithms.tree import Tree
from sparkdl.collective.api import OPERATION_NAMES

_REGISTERED: dict[str, Algorithm] = {}
#: The algorithms of each operation, by name, in the order registered; the first is its default where nothing
#: else applies. Kept in step with the registry by :func:`register_algorithm` and :func:`unregister_algorithm`.
ALGORITHMS: dict[str, tuple[str, ...]] = {}
_names: frozenset[str] = frozenset()
_by_precedence: dict[str, tuple[Algorithm, ...]] = {}  # each operation's algorithms, higher precedence first


def register_algorithm(algorithm: Algorithm) -> None:
    """Adds ``algorithm`` under its name: every communicator runs it from now on when asked for it."""
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"Expected a sparkdl.collective.Algorithm. Received: {algorithm!r}")
    name = getattr(algorithm, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"Expected the algorithm's `name` to be a non-empty string. Received: name={name!r}")
    if name in _REGISTERED:
        raise ValueError(f"Algorithm name {name!r} is taken already (by {type(_REGISTERED[name]).__name__}).")
    operations = frozenset(getattr(algorithm, "operations", ()))
    unknown = operations - set(OPERATION_NAMES)
    if not operations or unknown:
        raise ValueError(
            f"Expected the algorithm's `operations` among {list(OPERATION_NAMES)}. Received: {sorted(operations)}"
        )
    missing = [op for op in sorted(operations) if getattr(type(algorithm), op) is getattr(Algorithm, op)]
    if missing:
        raise ValueError(f"Expected algorithm {name!r} to implement its operations. Received: no method for {missing}")
    uncounted = set(algorithm.costs) - operations
    if uncounted:
        raise ValueError(
            f"Expected the costs of algorithm {name!r} to be of its operations. Received: {sorted(uncounted)}"
        )
    _REGISTERED[name] = algorithm
    _index()


def unregister_algorithm(name: str) -> None:
    """Removes the algorithm registered as ``name`` (a test's, once it is done)."""
    if name not in _REGISTERED:
        raise ValueError(f"Expected a registered algorithm's name, one of {sorted(_REGISTERED)}. Received: {name!r}")
    del _REGISTERED[name]
    _index()


def _index() -> None:
    global _names
    ALGORITHMS.clear()
    for operation in OPERATION_NAMES:
        ALGORITHMS[operation] = tuple(name for name, a in _REGISTERED.items() if operation in a.operations)
        ranked = sorted((_REGISTERED[name] for name in ALGORITHMS[operation]), key=lambda a: -a.precedence)
        _by_precedence[operation] = tuple(ranked)
    _names = frozenset(_REGISTERED)


def names() -> frozenset[str]:
    """Every registered algorithm's name (one set until the registry changes)."""
    return _names


def registered() -> dict[str, Algorithm]:
    """The registered algorithms by name, in the order registered."""
    return dict(_REGISTERED)


def algorithm(name: str) -> Algorithm:
    return _REGISTERED[name]


def choose(
    operation: str, requested: str | None, default: str | None, nbytes: int, shared_memory: bool, one_host: bool = False
) -> str:
    """The algorithm ``operation`` runs: the one requested for the call, else the communicator's, else the first
    that wants the call (:meth:`Algorithm.wanted`, by precedence), else the operation's first.

    ``shared_memory``: the ranks share hosts in equal numbers, with a segment each; ``one_host``: one
    segment holds every rank.
    """
    available = ALGORITHMS[operation]
    sharing = Sharing(shared_memory, one_host)
    if requested is not None:
        if requested not in available:
            raise ValueError(
                f"Expected `algorithm` to be one of {list(available)} for {operation}. Received: algorithm={requested!r}"
            )
        if not _REGISTERED[requested].usable(sharing):
            raise ValueError(_REGISTERED[requested].refusal(operation))
        return requested
    if default is not None and default in available and _REGISTERED[default].usable(sharing):
        return default
    for candidate in _by_precedence[operation]:
        if candidate.usable(sharing) and candidate.wanted(operation, nbytes, sharing):
            return candidate.name
    return available[0]


for _built_in in (Ring(), Tree(), Naive(), Hierarchical(), SharedMemory()):
    register_algorithm(_built_in)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Sharing",
    "algorithm",
    "choose",
    "names",
    "register_algorithm",
    "registered",
    "unregister_algorithm",
]
