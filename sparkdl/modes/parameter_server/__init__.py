"""The parameter-server mode and its variants async, hogwild, ssp and sync_ps: workers push gradients to a server.

``mode.py`` (the driver: the server in ``sparkdl.ps`` up, the tasks launched, checkpoints of the
server's state), ``task.py`` (a task: Keras ``fit`` whose hooked optimizer pushes and pulls).
With ``server_placement="executors"`` the shards are tasks beside the workers: ``placement.py`` (their
layout and rendezvous), ``server_task.py`` (a server task), ``executors.py`` (the driver's side).
"""
