"""The parameter-server benchmark in one run: server throughput, then every mode on digits next to sync and
single-process Keras.

    python benchmarks/parameter_server.py
"""

import fit_vs_single
import ps_throughput

if __name__ == "__main__":
    print("== (1) parameter-server throughput: pushes/s and MB/s by workers and shards ==")
    ps_throughput.main([])
    print("\n== (2) digits, every mode vs sync and single-process model.fit ==")
    fit_vs_single.main(["--modes", "sync", "async", "hogwild", "ssp", "average", "--repeats", "2"])
