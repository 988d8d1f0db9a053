"""Each pipeline stage's peak resident memory and the fit's time in GPipe's schedule and in 1F1B's, side by side: what
1F1B promises (stage s holds at most S - s micro-batches' activations at once where GPipe holds all M, for the same
bubble), measured at each stage task's peak.

One session on ``local[2]`` whose Python workers are not reused (``spark.python.worker.reuse=false``): each stage task
is a process of its own, whose peak resident memory (``ru_maxrss``, the kernel's count) it reports in
``FitResult.stats["pipeline"]["stages"]``. The model: ``--layers`` Dense(``--width``, relu) layers on 64 inputs, then
Dense(10, softmax), SGD, cut into two stages; ``--steps`` steps of ``--batch`` rows in ``--micro-batches``, so that a
micro-batch's activations (the outputs its tape keeps, ``rows x width x 4`` bytes a layer) dwarf the weights. After a
first fit that is not counted, the fits alternate between the schedules, ``--repeats`` times each; the table gives
each one's median.

    python benchmarks/pipeline_schedules.py [--micro-batches 8] [--batch 16384] [--width 512] [--layers 4]
        [--steps 3] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

FEATURES = 64
SCHEDULES = ("gpipe", "1f1b")


def model(layers: int, width: int):
    import keras

    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    built = keras.Sequential([keras.Input((FEATURES,)), *dense, keras.layers.Dense(10, activation="softmax")])
    built.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    return built


def measure(*, micro_batches: int, batch: int, width: int, layers: int, steps: int, repeats: int) -> dict:
    """``{"micro_batch_activation_bytes": [per stage], schedule: {"peaks": [[per stage], ...], "seconds": [...]}}``:
    a micro-batch's layer outputs on each stage (the bytes its tape keeps, by the model's shapes), and each fit's
    stage peaks and wall seconds."""
    import numpy as np

    import sparkdl
    from sparkdl.modes.pipeline.cut import plan_stages

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workloads import local_session

    spark = local_session(2, **{"spark.python.worker.reuse": "false"})
    try:
        rng = np.random.default_rng(0)
        rows = batch * steps
        x = rng.random((rows, FEATURES), dtype=np.float32)
        y = rng.integers(0, 10, rows)
        df = spark.createDataFrame(
            [(row.tolist(), int(label)) for row, label in zip(x, y)], "features array<float>, label bigint"
        ).cache()
        df.count()
        plan = plan_stages(model(layers, width), 2)
        rows_per_micro_batch = -(-batch // micro_batches)
        per_stage = [
            sum(rows_per_micro_batch * int(layer.units) * 4 for layer in stage if hasattr(layer, "units"))
            for stage in _stage_layers(model(layers, width), plan)
        ]
        result: dict = {"micro_batch_activation_bytes": per_stage}

        def fit(schedule: str):
            return sparkdl.fit(
                df,
                model(layers, width),
                mode="pipeline",
                num_stages=2,
                num_workers=2,
                micro_batches=micro_batches,
                schedule=schedule,
                epochs=1,
                batch_size=batch,
                shuffle=False,
                seed=0,
                progress=False,
            )

        fit(SCHEDULES[0])  # Spark's first barrier stage of the session: not counted
        for _ in range(repeats):
            for schedule in SCHEDULES:
                clock = time.monotonic()
                fitted = fit(schedule)
                seconds = time.monotonic() - clock
                peaks = [stage["peak_resident_bytes"] for stage in fitted.stats["pipeline"]["stages"]]
                entry = result.setdefault(schedule, {"peaks": [], "seconds": []})
                entry["peaks"].append(peaks)
                entry["seconds"].append(seconds)
        return result
    finally:
        spark.stop()


def _stage_layers(whole, plan) -> list[list]:
    """The model's layers of each stage of ``plan``."""
    from sparkdl.modes.pipeline.cut import build_stage, stage_weights

    return [build_stage(plan, s, stage_weights(whole, plan, s)).layers for s in range(plan.num_stages)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    result = measure(
        micro_batches=args.micro_batches,
        batch=args.batch,
        width=args.width,
        layers=args.layers,
        steps=args.steps,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(result), flush=True)
        return
    activation = result["micro_batch_activation_bytes"]
    m = args.micro_batches
    print(
        f"{args.layers} x Dense({args.width}), batch {args.batch} in {m} micro-batches, 2 stages; one micro-batch's "
        f"layer outputs: {' / '.join(f'{a / 1e6:.1f}' for a in activation)} MB (stage 0 / stage 1)"
    )
    print(f"{'schedule':<8}{'stage 0 peak MB':>18}{'stage 1 peak MB':>18}{'fit s':>8}   activations held (schedule)")
    for schedule in SCHEDULES:
        peaks = [statistics.median(p[s] for p in result[schedule]["peaks"]) for s in range(2)]
        held = [m, m] if schedule == "gpipe" else [min(2, m), 1]
        print(
            f"{schedule:<8}{peaks[0] / 1e6:>18.0f}{peaks[1] / 1e6:>18.0f}"
            f"{statistics.median(result[schedule]['seconds']):>8.1f}   {held[0]} / {held[1]} micro-batches"
        )
    saved = [
        statistics.median(p[s] for p in result["gpipe"]["peaks"])
        - statistics.median(p[s] for p in result["1f1b"]["peaks"])
        for s in range(2)
    ]
    expected = [(m - min(2, m)) * activation[0], (m - 1) * activation[1]]
    print(
        "1F1B below GPipe: "
        + " / ".join(
            f"{s / 1e6:.0f} MB (the schedules' difference in layer outputs: {e / 1e6:.0f} MB)"
            for s, e in zip(saved, expected)
        )
    )


if __name__ == "__main__":
    main()
