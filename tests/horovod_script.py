"""A Horovod training script as its users write it (tf.keras, hvd.DistributedOptimizer, Horovod callbacks).

Nothing in it knows about Spark or sparkdl: the same ``train`` runs under ``horovodrun`` and
through ``sparkdl.run(train, num_workers=2, backend="horovod")``.
"""

import hashlib

import numpy as np


def train(epochs=8, batch_size=32, lr=0.05):
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    hvd.init()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[0], "GPU")

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]

    tf.keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast must fix that
    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr * hvd.size(), momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        experimental_run_tf_function=False,
    )
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    history = model.fit(
        x_shard, y_shard, batch_size=batch_size, epochs=epochs, callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0
    )
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"weights {digest} on rank {hvd.rank()} of {hvd.size()}")
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "accuracy": float(accuracy),
        "loss": [float(v) for v in history.history["loss"]],
    }
