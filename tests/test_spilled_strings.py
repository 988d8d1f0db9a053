"""A worker's spilled string fields: their bytes in a text file beside the fixed-size records, read back exactly by
both readers (mapped, and by system calls with an epoch in windows), and as private and short-lived as the rows.
Real files and real system calls; no Spark needed."""

import os

import numpy as np
import pyarrow as pa
import pytest

from sparkdl import schedule
from sparkdl.data import spill, windows
from sparkdl.data.fields import INPUT, TARGET, Field, Fields
from sparkdl.data.spill import MAPPED_BYTES, FileRows, MappedRows, SpilledRows

FIELDS = Fields(
    inputs=(
        Field(INPUT, "text", "text", ("text",), (1,), "string"),
        Field(INPUT, "tokens", "tokens", ("tokens",), (3,), "string"),
    ),
    targets=(Field(TARGET, "label", "label", ("label",), (), "int64"),),
    named_inputs=True,
)
WORDS = ["", "naïve", "日本語", "🎉", "nul\x00inside", "new\nline", "x" * 300]


def _table(rows: int) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Rows as Arrow hands them to a worker (one flat list per row), and the bytes each row must give back."""
    rng = np.random.default_rng(0)
    text = [f"{WORDS[i % len(WORDS)]} {i}" for i in range(rows)]
    tokens = [[WORDS[j] for j in rng.integers(0, len(WORDS), 3)] for _ in range(rows)]
    table = pa.table(
        {
            "text": pa.array([[t] for t in text], pa.list_(pa.string())),
            "tokens": pa.array(tokens, pa.list_(pa.large_string())),
            "label": pa.array([[i] for i in range(rows)], pa.list_(pa.int64())),
        }
    )
    expected = {
        "text": np.array([[t.encode()] for t in text], object),
        "tokens": np.array([[w.encode() for w in row] for row in tokens], object),
        "label": np.arange(rows),
    }
    return table, expected


def _spilled(tmp_path, rows, mapped_bytes, batch=97):
    table, expected = _table(rows)
    spilled = SpilledRows(FIELDS.all, str(tmp_path), mapped_bytes)
    for record_batch in table.to_batches(max_chunksize=batch):  # as Arrow batches arrive, sliced (offsets not at 0)
        spilled.append(FIELDS.arrays(record_batch))
    return spilled.finish(), expected


def _assert_rows(got, expected, index):
    assert sorted(got) == sorted(expected)
    for column, values in got.items():
        want = expected[column][index]
        assert values.shape == want.shape, column
        assert values.tolist() == want.tolist(), column  # bytes for bytes: nothing decoded, padded or stripped


@pytest.mark.parametrize("mapped_bytes", [MAPPED_BYTES, 0], ids=["mapped", "read by rows"])
def test_strings_come_back_byte_for_byte_and_the_files_are_gone(tmp_path, mapped_bytes):
    reader, expected = _spilled(tmp_path, 1000, mapped_bytes)
    assert os.listdir(tmp_path) == []  # the rows' and the texts' files: unlinked once opened
    assert isinstance(reader, MappedRows if mapped_bytes else FileRows)
    rng = np.random.default_rng(1)
    for index in (rng.permutation(1000)[:128], np.arange(200, 328), np.array([4, 4, 4]), np.arange(0)):
        _assert_rows(reader.read(index), expected, index)


def test_a_windowed_epoch_gives_each_steps_strings(tmp_path, monkeypatch):
    """Read in windows (a few rows each here), every step's strings are the schedule's rows', a chunk a step."""
    monkeypatch.setattr(windows, "WINDOW_BYTES", 16 * 1024)
    windowed = []
    monkeypatch.setattr(spill, "read_in_windows", lambda *args: windowed.append(1) or windows.read_in_windows(*args))
    reader, expected = _spilled(tmp_path, 3000, mapped_bytes=0)
    for part in schedule.epoch_steps(3000, keys=np.arange(3000), steps=30, seed=3, shuffle=True, start=0, stop=30):
        chunks = list(reader.chunks(part.order, part.spans))
        assert len(chunks) == len(part.spans)  # strings are resolved a step at a time, never a whole window at once
        for chunk, (first, end) in zip(chunks, part.spans):
            (arrays,) = chunk.step_arrays()
            _assert_rows(arrays, expected, part.order[first:end])
    assert windowed  # the epoch went through the windows


def test_keras_gets_a_string_tensor_for_each_string_input(tmp_path):
    import tensorflow as tf

    reader, expected = _spilled(tmp_path, 10, MAPPED_BYTES)
    x, y = FIELDS.keras_batch(reader.read(np.arange(10)))
    assert x["text"].dtype == tf.string and x["text"].shape == (10, 1) and x["tokens"].shape == (10, 3)
    assert x["tokens"].numpy().tolist() == expected["tokens"].tolist()
    assert y.tolist() == list(range(10))
