"""A plain-SGD parameter-server shard that the server and attack tests share."""

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
