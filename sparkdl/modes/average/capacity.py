"""Average mode's rounds pass through the driver's JVM: a model it cannot carry is refused before the first round.

Every round the driver broadcasts the model's state (its weights and optimizer variables) and
every worker sends back a delta of the same size, in an accumulator update inside its task
result (classic) or in result rows (Spark Connect). Broadcasts and task results are built whole
in the driver JVM's heap, and task results count against ``spark.driver.maxResultSize``. That is
average mode's design (no sockets of sparkdl's: executors that cannot reach the driver), and
what it cannot carry fails late and badly: an ``OutOfMemoryError`` in the broadcast, a task
result lost, or a driver JVM that dies with the session. So ``check`` compares a round's needs
with both settings before the mode's first job, and raises a ``ValueError`` that names the
setting to raise and the size it needs.

The heap a round needs was measured in local mode (the driver's JVM runs the tasks too, so it
holds both ends of every task result), with random weights under plain SGD and no
``spark.testing.memory``. One worker, 512 MB heap: a 60 MB state trained (three runs out of
three), 100 MB trained once and lost its task result once, 140 MB killed the JVM. One worker,
1 GB: 160 MB trained, 200 MB lost its task result, 240 and 320 MB killed the JVM. Two workers,
1 GB: 100 MB each trained (twice), 160 MB each failed (twice). ``needed_heap`` is the line
those figures draw: twice the state (the broadcasts of the model and of its state) plus 3.5
times the state per worker (a round's deltas, which arrive together). Executors of their own
(not local mode) take the tasks' ends off the driver, so there the rule errs on the safe side.
"""

from __future__ import annotations

import math
import re

from pyspark.sql import SparkSession

from sparkdl.launch import session

MAX_RESULT_SETTING = "spark.driver.maxResultSize"
_DEFAULT_MAX_RESULT = "1g"
_HEAP_PER_BROADCAST_BYTE = 2  # the model's and its state's broadcasts (module docstring)
_HEAP_PER_DELTA_BYTE = 3.5  # a round's deltas, one per worker, which arrive together (module docstring)
_SIZE = re.compile(r"(\d+)\s*([kmgtp]?)b?", re.IGNORECASE)
_MB = 1 << 20


def needed_heap(state_bytes: int, num_workers: int) -> int:
    """The driver JVM heap (``Runtime.maxMemory``) a round of ``num_workers`` deltas of ``state_bytes`` needs."""
    return math.ceil(state_bytes * (_HEAP_PER_BROADCAST_BYTE + _HEAP_PER_DELTA_BYTE * num_workers))


def shortfalls(state_bytes: int, num_workers: int, heap: int | None, max_result: int | None) -> list[str]:
    """What a session with driver heap ``heap`` and ``spark.driver.maxResultSize`` ``max_result`` lacks (None:
    not known; a ``max_result`` of 0: no limit) for rounds of ``num_workers`` deltas of ``state_bytes``."""
    missing = []
    heap_needed = needed_heap(state_bytes, num_workers)
    if heap is not None and heap < heap_needed:
        missing.append(
            f"spark.driver.memory of at least {_megabytes(heap_needed)} MB (the heap is {_megabytes(heap)} MB)"
        )
    results = state_bytes * num_workers
    if max_result and max_result < results:
        missing.append(
            f"{MAX_RESULT_SETTING} of at least {_megabytes(results)} MB (it is {_megabytes(max_result)} MB; 0 for no limit)"
        )
    return missing


def check(spark: SparkSession, state_bytes: int, num_workers: int) -> None:
    """Raises ``ValueError`` when the session's driver cannot carry a round (module docstring)."""
    missing = shortfalls(state_bytes, num_workers, session.driver_heap(spark), _max_result_size(spark))
    if missing:
        raise ValueError(
            f"Expected a driver that can carry the rounds of mode='average': each broadcasts the model's "
            f"{_megabytes(state_bytes)} MB state (weights and optimizer variables) and gets {num_workers} delta(s) of that size back in the tasks' "
            f"results, through the driver JVM. Received: a session that needs {' and '.join(missing)}. Set them before "
            "the driver starts (spark-submit --driver-memory, or SparkSession.builder.config(...) in a fresh process), "
            "use fewer workers, or train with mode='sync' or a parameter-server mode, which move the model over "
            "sparkdl's own connections."
        )


def _max_result_size(spark: SparkSession) -> int | None:
    try:
        text = str(spark.conf.get(MAX_RESULT_SETTING, _DEFAULT_MAX_RESULT))
    except Exception:  # noqa: BLE001 - a Connect server may refuse to show core settings
        return None
    match = _SIZE.fullmatch(text.strip())
    if match is None:  # a form Spark itself refuses, with its own message
        return None
    number, unit = match.groups()
    return int(number) << (10 * " kmgtp".index(unit.lower() or " "))


def _megabytes(size: int) -> int:
    return -(-size // _MB)
