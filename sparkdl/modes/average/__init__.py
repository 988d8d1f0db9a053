"""Average mode: periodic model averaging through Spark's own machinery, no sockets of ours.

``mode.py`` (the driver's loop of rounds, metrics and checkpoints per epoch), ``rounds.py`` (what a
round is: its steps, the epochs it finishes, how deltas are averaged), ``task.py`` (a worker's
round), ``deltas.py`` (how a round's deltas reach the driver: accumulators, or result rows under
Spark Connect).
"""
