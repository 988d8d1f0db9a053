"""Fully sharded data parallelism (ZeRO stage 3): ``mode="sharded", shard_weights=True``."""
