"""Sync mode: every step, the workers' gradients are averaged (ring allreduce or Horovod) in one barrier stage.

``mode.py`` (the driver: launch the stage, read rank 0's result), ``task.py`` (a task: its rows,
its rank, the model to start from, checkpoints on rank 0), ``replicas.py`` (the hooked optimizer
and the callback that keep the replicas one model).
"""
