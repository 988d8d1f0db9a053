"""The parameter-server mode and its variants async, hogwild, ssp and sync_ps: workers push gradients to a server.

``mode.py`` (the variants, each an update rule of ``sparkdl.ps.rules`` and its options; their plan, whose
``run`` is the one run path of a fit: the server's model, the servers, the stage, the result and its
stats), ``task.py`` (a worker: Keras ``fit`` whose hooked optimizer pushes and pulls, ``push_pull.py``).
Where the shards run is a placement behind ``placement.py``'s interface: ``driver_servers.py`` (threads of
the driver) or ``executor_servers.py`` (Spark tasks beside the workers: ``stage.py``, their layout and
rendezvous, and ``server_task.py``, a server task).
"""
