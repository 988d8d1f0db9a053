"""Plain-SGD parameter-server shards that the server, placement and attack tests share."""

import numpy as np

LR = np.float32(0.1)


class SGDShard:
    """w -= lr * g on a float32 vector."""

    def __init__(self, init):
        self.w = np.array(init, dtype=np.float32)
        self.size = self.w.size

    def read(self):
        return self.w.copy()

    def apply(self, gradient):  # float32, or bfloat16/float16 under compression: widened here
        self.w -= LR * np.asarray(gradient, np.float32)


def make_shards(sizes, seed=0):
    """One SGDShard of each size, its weights drawn from a standard normal (``seed``'s generator, in order)."""
    rng = np.random.default_rng(seed)
    return [SGDShard(rng.standard_normal(size)) for size in sizes]
