"""The training modes, siblings behind one protocol (``base.Mode``) and one registry (``registry.MODES``).

``sync`` (ring allreduce or Horovod, barrier mode), ``parameter_server`` (async, hogwild, ssp, sync_ps:
the workers push gradients to the server in ``sparkdl.ps``), ``average`` (periodic model
averaging through Spark's broadcasts and accumulators). A new mode is one new package with a
``Mode`` subclass, registered in ``registry.py``.
"""
