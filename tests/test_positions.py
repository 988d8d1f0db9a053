"""Where an epoch stands, found again on as many workers or on others: the rows a resumed epoch trains are exactly
those it had not trained, counted by key, whatever the workers before and after (real communicators, one per rank).

The trained rows are computed here from the rule (each worker's rows sorted by their sort value, the first
``j * n // S`` of them after ``j`` of ``S`` steps), not with ``sparkdl.position``'s bisection.
"""

import collections
import dataclasses

import numpy as np
import pytest
from collective_ranks import run_ranks

from sparkdl import schedule
from sparkdl.position import EpochPosition, EpochRest, Segment, key_sum, shard_of

KEYS = np.arange(5, 5 + 997, dtype=np.int64) * 7919 + (np.int64(3) << 33)  # 997 rows, keys as Spark would number
SEED, EPOCH, BATCH = 11, 2, 16


def _dealt(keys, workers):
    return [keys[shard_of(keys, workers) == rank] for rank in range(workers)]


def _trained_by_rule(keys_by_rank, steps, done):
    """The keys the first ``done`` of ``steps`` steps trained, each worker taking its sorted rows in order."""
    trained = []
    for keys in keys_by_rank:
        values = schedule.sort_values(keys, seed=SEED, epoch=EPOCH, shuffle=True)
        trained += keys[np.argsort(values)][: done * len(keys) // steps].tolist()
    return trained


def _left(rests, dealt, steps=None):
    """The keys of the (first ``steps``) steps left of every rank's rest."""
    return [
        int(key)
        for rank, rest in rests.items()
        for part in rest.parts(fillers=False)
        for a, b in part.spans[:steps]
        for key in dealt[rank][part.order[a:b]]
    ]


def _first_position(workers, done):
    """The position after ``done`` steps of an epoch run from its start on ``workers`` workers."""
    rows = tuple(len(k) for k in _dealt(KEYS, workers))
    steps = schedule.steps_per_epoch(rows, BATCH)
    return EpochPosition(EPOCH, SEED, True, key_sum(KEYS), (Segment(workers, rows, steps, done),)), steps


def _rests(position, workers):
    """Every rank's ``EpochRest`` of ``position`` on ``workers`` ranks, each holding its dealt keys."""
    dealt = _dealt(KEYS, workers)
    results = run_ranks(
        workers, lambda comm: EpochRest.resume(position, dealt[comm.rank], key_sum(KEYS), comm, batch_size=BATCH)
    )
    return dict(enumerate(results))


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3), (3, 3), (1, 3), (3, 1)])
def test_a_resumed_epoch_trains_exactly_the_rows_it_had_not(before, after):
    position, steps = _first_position(before, done=5)
    trained = _trained_by_rule(_dealt(KEYS, before), steps, 5)
    assert 0 < len(trained) < len(KEYS)
    rests = _rests(position, after)
    dealt = _dealt(KEYS, after)
    left = _left(rests, dealt)
    assert collections.Counter(trained + left) == collections.Counter(KEYS.tolist())  # none twice, none missed
    steps_left = {rest.steps_left for rest in rests.values()}
    assert len(steps_left) == 1  # the ranks stay in lockstep
    if before == after:  # the same workers go on with the run's own steps: the batches of a run without the fault
        assert steps_left == {steps - 5}
        for rank, rest in rests.items():
            values = schedule.sort_values(dealt[rank], seed=SEED, epoch=EPOCH, shuffle=True)
            whole = dealt[rank][np.argsort(values)]
            parts = list(
                schedule.epoch_steps(
                    len(whole),
                    keys=dealt[rank],
                    steps=steps,
                    seed=SEED,
                    shuffle=True,
                    start=EPOCH * steps + 5,
                    stop=(EPOCH + 1) * steps,
                )
            )
            expected = [dealt[rank][parts[0].order[a:b]].tolist() for a, b in parts[0].spans]
            got = [dealt[rank][rest.order[a:b]].tolist() for a, b in rest.parts()[0].spans]
            assert got == expected and len(whole) == len(dealt[rank])


def test_an_epoch_resumed_twice_on_other_workers_still_trains_every_row_once():
    position, steps = _first_position(3, done=4)
    first = _trained_by_rule(_dealt(KEYS, 3), steps, 4)
    rests = _rests(position, 2)  # 3 workers -> 2, which train 3 of their steps and stop again
    second = _left(rests, _dealt(KEYS, 2), steps=3)
    again = rests[0].position_after(3)
    assert [s.shards for s in again.segments] == [3, 2] and again.steps == 4 + 3
    left = _left(_rests(again, 3), _dealt(KEYS, 3))
    assert collections.Counter(first + second + left) == collections.Counter(KEYS.tolist())


def test_a_position_taken_on_other_rows_is_refused():
    position, _ = _first_position(2, done=3)
    others = KEYS[:-1]
    with pytest.raises(ValueError, match="Expected the rows the checkpoint of epoch 2"):
        run_ranks(1, lambda comm: EpochRest.resume(position, others, key_sum(others), comm, batch_size=BATCH))


def test_a_position_survives_its_vector_form():
    segments = (Segment(3, (5, 6, 7), 4, 2, by_partition=True), Segment(2, (3, 4), 3, 1))
    position = EpochPosition(4, 9, False, 2**64 - 3, segments)
    assert EpochPosition.from_vector(position.to_vector()) == position
    assert position.steps == 3 and position.segments[0].trained == (2, 3, 3)
    written_before_deals = [4, 9, 0, -3, 1, 2, 3, 1, 3, 4]  # a checkpoint's vector before segments said how rows went
    assert EpochPosition.from_vector(np.array(written_before_deals, np.int64)) == dataclasses.replace(
        position, segments=segments[1:]
    )


# 3 input partitions of uneven sizes, keys as Spark numbers them (partition << 33 | place)
PARTITION_KEYS = np.concatenate(
    [(np.int64(p) << 33) + np.arange(n, dtype=np.int64) for p, n in enumerate([300, 410, 287])]
)


@pytest.mark.parametrize("after", [3, 2, 1])
def test_an_epoch_dealt_by_whole_partitions_resumes_on_any_workers(after):
    """On 3 workers reading one input partition each (``TaskLayout.by_partition``), 5 steps trained; resumed on 3
    workers reading them the same way it goes on with its own steps; on 2 or 1, dealt row by row, it trains the rest:
    every row once in all."""
    by_partition = [PARTITION_KEYS[PARTITION_KEYS >> 33 == p] for p in range(3)]
    rows = tuple(len(keys) for keys in by_partition)
    steps = schedule.steps_per_epoch(rows, BATCH)
    segment = Segment(3, rows, steps, 5, by_partition=True)
    position = EpochPosition(EPOCH, SEED, True, key_sum(PARTITION_KEYS), (segment,))
    trained = _trained_by_rule(by_partition, steps, 5)
    whole = after == 3
    dealt = by_partition if whole else [PARTITION_KEYS[shard_of(PARTITION_KEYS, after) == r] for r in range(after)]
    results = run_ranks(
        after,
        lambda comm: EpochRest.resume(
            position, dealt[comm.rank], key_sum(PARTITION_KEYS), comm, batch_size=BATCH, by_partition=whole
        ),
    )
    rests = dict(enumerate(results))
    left = _left(rests, dealt)
    assert collections.Counter(trained + left) == collections.Counter(PARTITION_KEYS.tolist())
    assert {rest.steps_left for rest in rests.values()} == ({steps - 5} if whole else {rests[0].segment.planned})
    assert rests[0].position_after(0).segments[-1].by_partition == whole


@pytest.mark.parametrize("before, replicas", [(2, 2), (2, 3), (3, 1)])
def test_a_pipelines_stages_walk_their_replicas_rest_whatever_rows_they_hold(before, replicas):
    """The shards are a pipeline's replicas (3 stages each): a replica's first stage holds its shard's rows, its last
    stage a copy of them (arrived in another order), its middle stage none. The first stages' rows are counted once;
    each last stage trains the same rows at the same steps, and each middle stage walks the same steps' sizes."""
    stages = 3
    position, steps = _first_position(before, done=5)
    trained = _trained_by_rule(_dealt(KEYS, before), steps, 5)
    dealt = _dealt(KEYS, replicas)
    rng = np.random.default_rng(0)
    held = {}
    for rank in range(replicas * stages):
        replica, stage = divmod(rank, stages)
        keys = dealt[replica] if stage in (0, stages - 1) else np.empty(0, np.int64)
        held[rank] = rng.permutation(keys) if stage == stages - 1 else keys

    def rest(comm):
        shards, shard = range(0, comm.size, stages), comm.rank // stages
        return EpochRest.resume(
            position, held[comm.rank], key_sum(KEYS), comm, batch_size=BATCH, shards=shards, shard=shard
        )

    rests = dict(enumerate(run_ranks(replicas * stages, rest)))

    def steps_of(rank):
        return [held[rank][rests[rank].order[a:b]].tolist() for part in rests[rank].parts() for a, b in part.spans]

    def sizes_of(rank):
        return [b - a for part in rests[rank].parts() for a, b in part.spans]

    for replica in range(replicas):
        first, middle, last = (replica * stages + stage for stage in range(stages))
        assert steps_of(last) == steps_of(first) and sizes_of(middle) == sizes_of(first)
    left = _left({replica: rests[replica * stages] for replica in range(replicas)}, dealt)
    assert collections.Counter(trained + left) == collections.Counter(KEYS.tolist())
    steps_left = {rest.steps_left for rest in rests.values()}
    assert len(steps_left) == 1 and (before != replicas or steps_left == {steps - 5})


def test_a_worker_left_without_rows_of_the_epoch_still_steps_with_the_others():
    """Resumed on more workers one step before the epoch's end, some workers hold none of the rows left: they run
    one-row filler steps (weighing nothing) so that every worker runs the same steps."""
    steps = len(KEYS)  # one row a step: one row left after the last but one
    position = EpochPosition(EPOCH, SEED, True, key_sum(KEYS), (Segment(1, (len(KEYS),), steps, steps - 1),))
    rests = _rests(position, 3)
    counts = [rest.segment.rows[rank] for rank, rest in rests.items()]
    assert 0 in counts and sum(counts) > 0
    assert len({rest.steps_left for rest in rests.values()}) == 1
    for rank, rest in rests.items():
        spans = [span for part in rest.parts() for span in part.spans]
        assert len(spans) == rest.steps_left  # fillers included: the ranks stay in lockstep
        if counts[rank] == 0:
            assert set(spans) == {(0, 1)} and (rest.scales(rank) == 0).all()
    left = _left(rests, _dealt(KEYS, 3))
    trained = _trained_by_rule(_dealt(KEYS, 1), steps, steps - 1)
    assert collections.Counter(trained + left) == collections.Counter(KEYS.tolist())
