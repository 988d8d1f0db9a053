"""Gossip mode (decentralized D-PSGD): each worker trains its own replica and averages it with its neighbours only.

``peers.py`` (who averages with whom in each round, the same on every rank), ``exchange.py`` (one
round's weights on the wire, on streams that never wait on each other), ``hook.py`` (the rounds run
inside Keras's own train step, overlapping the next step's forward and backward pass), ``replicas.py``
(once an epoch: metrics combined, the replicas' spread, their average for checkpoints and the result),
``task.py`` (a barrier task), ``mode.py`` (the driver side: options, launch, result).
"""
