"""The checks job's answers, kept with a persisted DataFrame: another fit on the same cached rows runs no job.

A DataFrame's rows can differ from one of its Spark jobs to the next (files rewritten under it, a
nondeterministic expression), but not while it stays persisted (``df.cache()``, ``df.persist()``):
every job then reads the rows Spark cached. So the answer of the checks job (``sparkdl.data.checks``)
over a persisted DataFrame is kept with that DataFrame object, by what was asked (its columns, the
types they are read as, the validation rows' rule), as long as the object lives and stays persisted.
A later fit over it that asks the same runs no checks job, and the driver's rules (nulls, shapes,
ranges, row counts) judge the kept answer as they judged the first: bad rows are refused again, the
same way. Tuning is the case it serves: CrossValidator and TrainValidationSplit fit every candidate
on one persisted DataFrame per fold. A fit that finds the DataFrame no longer persisted forgets its
answers (unpersisted and cached again, it may hold other rows); Spark recomputes a cached partition
lost with its executor from the DataFrame's source, for the training stage's read as well.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Sequence

from pyspark.sql import Column, DataFrame

_lock = threading.Lock()
_answers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DataFrame -> {question: answer}


def aggregate(df: DataFrame, question: Hashable, aggregates: Callable[[], Sequence[Column]]) -> dict:
    """``df.agg(*aggregates())``'s one row as a dict; ``question`` says what the aggregates ask, exactly (two equal
    questions must build equal aggregates). Over a persisted ``df`` a kept answer is returned without a job (and
    without building the aggregates)."""
    persisted = _is_persisted(df)
    with _lock:
        if not persisted:
            _answers.pop(df, None)  # unpersisted since: its rows may be others when it is cached again
        kept = _answers.get(df, {}).get(question)
    if kept is not None:
        return dict(kept)
    row = df.agg(*aggregates()).first()
    assert row is not None, "an aggregate without grouping returns one row"
    answer = row.asDict()
    if persisted:
        with _lock:
            _answers.setdefault(df, {})[question] = dict(answer)
    return answer


def _is_persisted(df: DataFrame) -> bool:
    level = df.storageLevel
    return bool(level.useMemory or level.useDisk or level.useOffHeap)
