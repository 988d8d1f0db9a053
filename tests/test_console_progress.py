"""``progress=False`` end to end: a real fit, on a console where a progress bar would be drawn, prints neither
the bar nor the epoch lines; the same fit with ``progress=True`` prints both (so the check can fail)."""

import io
import re
import sys

import pytest
from frames import digits_frame
from models import make_mlp

import sparkdl


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as a user's console does: where sparkdl draws its bar."""

    def isatty(self):
        return True


@pytest.mark.parametrize("progress", [True, False])
def test_progress_false_prints_no_bar_and_no_epoch_lines(spark, digits, capsys, monkeypatch, progress):
    x_train, _, y_train, _ = digits
    df = digits_frame(spark, x_train[:128], y_train[:128])
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    result = sparkdl.fit(df, make_mlp(hidden=(8,)), num_workers=2, epochs=2, batch_size=8, seed=0, progress=progress)

    assert len(result.history["loss"]) == 2
    out, err = capsys.readouterr().out, terminal.getvalue()
    epoch_lines = re.findall(r"^epoch [12]/2 .*loss=", out, re.M)
    bar = re.findall(r"sparkdl sync x2.*\|", err)
    if progress:
        assert len(epoch_lines) == 2 and bar, (out, err)
    else:
        assert epoch_lines == [] and bar == [] and "epoch" not in out + err, (out, err)
