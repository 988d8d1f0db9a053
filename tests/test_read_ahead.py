"""Rows read by a thread ahead of training: in order, a bounded distance ahead, errors raised where they belong,
and a reading dropped half-way stops and lets go of the scratch file. Real threads and real files."""

import threading
import time

import numpy as np
import pytest
from test_windows import _spilled

from sparkdl import schedule
from sparkdl.data import spill, windows
from sparkdl.data.read_ahead import Chunk, read_ahead

WAIT = 30  # seconds: generous, only there so that a broken read-ahead fails instead of hanging


def _chunks(count, made, closed=None, fail_at=None):
    try:
        for number in range(count):
            if number == fail_at:
                raise ValueError(f"chunk {number} could not be read")
            made.append((number, threading.current_thread().name))
            yield Chunk({"n": np.full(3, number)}, [(0, 1), (1, 3)])
    finally:
        if closed is not None:
            closed.set()


def test_chunks_come_in_order_made_by_another_thread_while_the_caller_still_holds_the_one_before():
    made = []
    ahead = read_ahead(_chunks(5, made), depth=1)
    first = next(ahead)
    deadline = time.monotonic() + WAIT
    while len(made) < 2 and time.monotonic() < deadline:  # the next one is made before the caller asks for it
        time.sleep(0.05)
    assert len(made) >= 2
    assert len(made) <= 3  # one ready, one waiting to be handed over: no further ahead
    rest = list(ahead)
    assert [int(chunk.arrays["n"][0]) for chunk in [first, *rest]] == [0, 1, 2, 3, 4]
    assert {name for _, name in made} == {"sparkdl-read-ahead"}
    assert [a["n"].tolist() for a in first.step_arrays()] == [[0], [0, 0]]


def test_an_error_in_the_thread_is_raised_to_the_caller_after_the_chunks_before_it():
    ahead = read_ahead(_chunks(5, [], fail_at=2))
    assert int(next(ahead).arrays["n"][0]) == 0
    assert int(next(ahead).arrays["n"][0]) == 1
    with pytest.raises(ValueError, match="chunk 2 could not be read"):
        next(ahead)


def test_closing_the_reading_half_way_stops_the_thread_and_closes_its_chunks():
    closed = threading.Event()
    ahead = read_ahead(_chunks(10_000, [], closed))
    next(ahead)
    ahead.close()
    assert closed.wait(WAIT)
    for thread in threading.enumerate():
        if thread.name == "sparkdl-read-ahead":
            thread.join(WAIT)
            assert not thread.is_alive()


def _epoch(rows, steps):
    return next(
        schedule.epoch_steps(rows, keys=np.arange(rows), steps=steps, seed=3, shuffle=True, start=0, stop=steps)
    )


def test_a_windowed_reading_dropped_half_way_lets_the_next_one_use_the_scratch_file(tmp_path, monkeypatch):
    monkeypatch.setattr(windows, "WINDOW_BYTES", 200 * (8 * 8 * 4 + 8 + 2 * 8))
    reader, expected = _spilled(tmp_path, 3000)
    part = _epoch(3000, 30)
    dropped = read_ahead(reader.chunks(part.order, part.spans))
    next(dropped)
    dropped.close()  # Keras let go of the stream: its thread stops and releases the scratch file
    got = [arrays for chunk in read_ahead(reader.chunks(part.order, part.spans)) for arrays in chunk.step_arrays()]
    assert len(got) == 30
    for arrays, (start, stop) in zip(got, part.spans):
        np.testing.assert_array_equal(arrays["ids"], expected["ids"][part.order[start:stop]])


def test_a_second_windowed_reading_while_the_first_holds_the_scratch_file_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "SCRATCH_WAIT_SECONDS", 0.2)
    reader, _ = _spilled(tmp_path, 3000)
    part = _epoch(3000, 30)
    first = reader.chunks(part.order, part.spans)
    next(first)  # holds the scratch file until it is finished or closed
    with pytest.raises(RuntimeError, match="scratch file .* still in use after 0.2 s"):
        next(reader.chunks(part.order, part.spans))
    first.close()
    assert next(reader.chunks(part.order, part.spans)).steps
