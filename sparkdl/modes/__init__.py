"""The training modes, siblings behind one protocol (``base.Mode``, whose ``configure`` makes a ``base.Plan`` per
variant) and one registry (``registry.MODES``).

``sync`` and ``sharded`` (barrier mode: ring allreduce or Horovod; ZeRO-1 and ZeRO-3 in ``fully_sharded``),
``pipeline`` (GPipe stages), ``gossip`` (decentralized averaging with peers), ``parameter_server`` (async,
hogwild, ssp, sync_ps: the workers push gradients to the server in ``sparkdl.ps``), ``average`` (periodic model
averaging through Spark's broadcasts and task results). The barrier modes' tasks share one frame (``barrier``).
A new mode is one new package with a ``Mode`` subclass, registered in ``registry.py``.
"""
