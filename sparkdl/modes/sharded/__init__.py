"""Sharded mode (ZeRO): sync's training with the optimizer's state, and with ``shard_weights=True`` the weights too,
split over the ranks (``mode.py``; ZeRO-1 runs on sync's replicas, ZeRO-3 in ``modes.fully_sharded``)."""
