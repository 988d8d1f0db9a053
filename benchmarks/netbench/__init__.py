"""The parts of ``benchmarks/network_patterns.py``: the emulated network, its probes, the ranks' runs, the report."""
