"""1F1B's promise where memory runs out: each pipeline stage's peak resident memory, against GPipe's.

benchmarks/pipeline_schedules.py fits one model (4 Dense(512) layers, cut into two stages; batches of 16,384 rows in 8
micro-batches, so that a micro-batch's activations, about 4 MB a layer, dwarf the weights) in each schedule, in a
Spark of its own with fresh Python workers for every task, and reports each stage task's peak resident memory (the
kernel's ``ru_maxrss``, which the stage reads in its own process). It runs once for this file's test.
"""

import json
import sys
from pathlib import Path

import pytest
from process_groups import own_spark_environment, run_in_own_group

# A Spark of its own and two fits in fresh workers: the slow command.
pytestmark = pytest.mark.slow

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline_schedules.py"
MICRO_BATCHES = 8


def test_a_1f1b_stage_peaks_below_gpipes_by_the_activations_it_no_longer_holds(tmp_path):
    """GPipe's stage holds all 8 micro-batches' activations at its peak; 1F1B's first stage at most 2 (S - s), its
    last one 1. Each stage's peak is at least half of that difference in layer outputs below GPipe's (the rest of a
    tape's keep, the relu's inputs and TensorFlow's own buffers, comes on top of the layer outputs counted)."""
    log = tmp_path / "log"
    command = [sys.executable, str(BENCHMARK), "--json", "--repeats", "1", "--steps", "2"]
    command += ["--micro-batches", str(MICRO_BATCHES)]
    status = run_in_own_group(command, cwd=BENCHMARK.parent, env=own_spark_environment(), log=log, timeout=540)
    output = log.read_text()
    assert status == 0, output[-6000:]
    result = json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))
    activation = result["micro_batch_activation_bytes"]
    (gpipe,), (one_f_one_b,) = result["gpipe"]["peaks"], result["1f1b"]["peaks"]
    held_fewer = [MICRO_BATCHES - 2, MICRO_BATCHES - 1]  # stage 0 holds 2 in 1F1B, stage 1 holds 1
    for stage in range(2):
        saved, promised = gpipe[stage] - one_f_one_b[stage], held_fewer[stage] * activation[stage]
        assert saved >= promised / 2, (stage, gpipe, one_f_one_b, activation)
