"""Parameter servers and their clients on loopback, and threads that drive them: what the tests of ``sparkdl.ps``
without Spark share."""

import threading

from sparkdl.ps.client import ParameterClient
from sparkdl.ps.rules import Immediate
from sparkdl.ps.server import ParameterServer

HOST = "127.0.0.1"
SECRET = b"ps-servers-test-secret"
ASYNC = Immediate()  # the rule a server takes unless a test gives another


def server(shards, rule=ASYNC, num_workers=2, **kwargs):
    """One server of all of ``shards`` (enter it, or use it in ``with``)."""
    return ParameterServer(shards, host=HOST, secret=SECRET, rule=rule, num_workers=num_workers, **kwargs)


def client(ps, worker, sizes, timeout=10.0, secret=SECRET, addresses=None, **kwargs):
    """Worker ``worker``'s client of ``ps``: one server of every shard, or a list of servers that run apart (shard k
    the only one of server k, as server tasks run them), which it joins and says DONE to each. ``secret`` and
    ``addresses`` (the shards', in order) may be given wrong on purpose."""
    if isinstance(ps, list):
        found, kwargs = [one.addresses[0] for one in ps], {"separate_servers": True, **kwargs}
    else:
        found = ps.addresses
    return ParameterClient(
        addresses or found, worker=worker, secret=secret, shard_sizes=sizes, timeout=timeout, **kwargs
    )


def in_thread(fn):
    """Runs ``fn`` in a thread; returns the thread and a list that receives its result (or exception)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out
