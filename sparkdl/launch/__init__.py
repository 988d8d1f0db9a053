"""Running functions on Spark tasks: task slots, the barrier stage, worker output and errors, GPUs, collective backends."""

from sparkdl.launch.errors import WorkerError
from sparkdl.launch.session import task_slots
from sparkdl.launch.slots import check_slots, claim_slots
from sparkdl.launch.stage import connect_collective, run_tasks

__all__ = ["WorkerError", "check_slots", "claim_slots", "connect_collective", "run_tasks", "task_slots"]
