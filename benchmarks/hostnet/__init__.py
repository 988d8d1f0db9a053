"""Hosts of their own on one machine: network namespaces joined by a bridge, links shaped, delayed, lossy or cut,
a Spark standalone cluster with a worker on each host, and the faults a cluster meets. Used by the benchmarks
(``network_patterns.py``, ``faults.py``) and by the tests (``tests/test_hosts.py``), which put ``benchmarks/`` on
their path to import it."""
