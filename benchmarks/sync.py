"""The sync-mode benchmark in one run: allreduce bandwidth, then sparkdl.fit against single-process Keras.

    python benchmarks/sync.py

Each part can also run alone: benchmarks/allreduce_bandwidth.py, benchmarks/fit_vs_single.py.
"""

import allreduce_bandwidth
import fit_vs_single

if __name__ == "__main__":
    print("== (1) allreduce bus bandwidth (ring, naive, shared memory) vs raw TCP loopback ==")
    allreduce_bandwidth.main([])
    print("\n== (2) sparkdl.fit sync vs single-process model.fit ==")
    fit_vs_single.main([])
