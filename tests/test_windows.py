"""A large partition's shuffled epoch read a window at a time: the schedule's rows exactly, with few system
calls and a flat resident set. Real files and real system calls (counted by the kernel); no Spark needed."""

import gc
import os

import numpy as np
import pytest
from test_spill import FIELDS

from sparkdl import schedule
from sparkdl.data import windows
from sparkdl.data.read_ahead import read_ahead
from sparkdl.data.spill import FileRows, SpilledRows


def _spilled(tmp_path, rows):
    rng = np.random.default_rng(0)
    expected = {
        "pixels": rng.normal(size=(rows, 8, 8, 1)).astype("float32"),
        "ids": np.arange(rows) + 2**53 - rows,  # exact int64 ids name each row
        "label": rng.normal(size=(rows, 2)),
    }
    spilled = SpilledRows(FIELDS, str(tmp_path), mapped_bytes=0)
    for start in range(0, rows, 1000):
        spilled.append({column: array[start : start + 1000] for column, array in expected.items()})
    reader = spilled.finish()
    assert isinstance(reader, FileRows)
    return reader, expected


def _read_syscalls():
    with open("/proc/self/io") as io:
        return int(dict(line.split(": ") for line in io)["syscr"])


def _read_steps(reader, rows, steps, start, stop):
    got, asked = [], []
    for part in schedule.epoch_steps(
        rows, keys=np.arange(rows), steps=steps, seed=7, shuffle=True, start=start, stop=stop
    ):
        got += [arrays for chunk in reader.chunks(part.order, part.spans) for arrays in chunk.step_arrays()]
        asked += [part.order[first:end] for first, end in part.spans]
    return got, asked


@pytest.mark.parametrize(
    "steps, start, stop, windowed",
    [
        (40, 0, 80, True),  # two whole epochs
        (40, 25, 70, True),  # resumed mid-epoch: the rest of epoch 0 (a third of it), all of epoch 1
        (40, 3, 7, False),  # an average-mode round of 4 steps: a tenth of the rows, read row by row
        (5000, 0, 5000, False),  # more steps than rows: filler steps repeat a row, so read row by row
    ],
)
def test_steps_read_back_are_the_schedules_rows_exactly_with_few_reads_when_windowed(
    tmp_path, monkeypatch, steps, start, stop, windowed
):
    rows = 3000
    record_bytes = 8 * 8 * 4 + 8 + 2 * 8
    monkeypatch.setattr(windows, "WINDOW_BYTES", 170 * record_bytes)  # many windows, none a whole number of steps
    monkeypatch.setattr(windows, "BLOCK_BYTES", 700 * record_bytes)  # several blocks, the last one short
    reader, expected = _spilled(tmp_path, rows)
    before = _read_syscalls()
    got, asked = _read_steps(reader, rows, steps, start, stop)
    reads = _read_syscalls() - before
    assert len(got) == len(asked) == stop - start
    for arrays, index in zip(got, asked):
        assert sorted(arrays) == sorted(expected)
        for column, array in arrays.items():
            np.testing.assert_array_equal(array, expected[column][index])
            assert array.dtype == expected[column].dtype and array.flags.c_contiguous
    rows_read = sum(len(index) for index in asked)
    if windowed:  # a block of the file and a window each one read (per epoch), not a read per row
        assert reads < rows_read / 10, (reads, rows_read)
    else:
        assert reads >= rows_read, (reads, rows_read)
    assert os.listdir(tmp_path) == []  # the scratch file has no name


def test_a_batch_of_an_earlier_window_is_not_overwritten_by_later_ones(tmp_path, monkeypatch):
    """Keras may still hold batches (prefetched) while later windows are read: each window is its own arrays."""
    monkeypatch.setattr(windows, "WINDOW_BYTES", 100 * (8 * 8 * 4 + 8 + 2 * 8))
    reader, expected = _spilled(tmp_path, 2000)
    got, asked = _read_steps(reader, 2000, 20, 0, 40)  # all of them held at once
    for arrays, index in zip(got, asked):
        np.testing.assert_array_equal(arrays["ids"], expected["ids"][index])


def _status_mb(field):
    with open("/proc/self/status") as status:
        return int(dict(line.split(":", 1) for line in status)[field].split()[0]) / 1024


def test_a_windowed_epoch_keeps_the_resident_set_flat_and_a_dropped_reader_closes_its_scratch_file(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(windows, "WINDOW_BYTES", 8 << 20)
    monkeypatch.setattr(windows, "BLOCK_BYTES", 4 << 20)
    rows = 400_000  # 112 MB of records
    reader, expected = _spilled(tmp_path, rows)
    del expected
    keys = np.arange(rows)  # a worker holds its rows' keys (8 bytes a row) from the start
    gc.collect()
    anon, mapped = _status_mb("RssAnon"), _status_mb("RssFile")
    peak_anon = peak_mapped = 0.0
    steps = rows // 512
    for part in schedule.epoch_steps(rows, keys=keys, steps=steps, seed=0, shuffle=True, start=0, stop=steps):
        for chunk in read_ahead(reader.chunks(part.order, part.spans)):  # as workers read: a thread ahead
            for _ in chunk.step_arrays():  # Keras lets go of each step's rows: so do we
                peak_anon = max(peak_anon, _status_mb("RssAnon") - anon)
                peak_mapped = max(peak_mapped, _status_mb("RssFile") - mapped)
    assert peak_mapped < 4, peak_mapped  # nothing of the file is mapped
    # the window read from and the one ready (16 MB), the next one in order and its region (16 MB), a block
    # of the file sorted (8 MB), an int32 a row (2 MB)
    assert peak_anon < 56, peak_anon
    scratch = reader._scratch.fileno()
    os.fstat(scratch)
    del reader
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(scratch)
