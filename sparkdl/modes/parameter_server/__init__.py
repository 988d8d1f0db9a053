"""The parameter-server mode and its variants async, hogwild and ssp: workers push gradients to a server.

``mode.py`` (the driver: the server in ``sparkdl.ps`` up, the tasks launched, checkpoints of the
server's state), ``task.py`` (a task: Keras ``fit`` whose hooked optimizer pushes and pulls).
"""
