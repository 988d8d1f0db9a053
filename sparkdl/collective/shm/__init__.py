"""Ranks of one host through shared memory: the operations over one segment (:mod:`.group`) and how the ranks come
to share it safely and wait on each other (:mod:`.segment`)."""

from sparkdl.collective.shm.group import SharedMemoryGroup, available

__all__ = ["SharedMemoryGroup", "available"]
