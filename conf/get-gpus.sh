#!/usr/bin/env bash
# GPU discovery script for Spark's resource scheduling: prints the GPUs of this
# machine (or container) as the JSON Spark expects, e.g.
#   {"name": "gpu", "addresses": ["0", "1"]}
# Set it as spark.executor.resource.gpu.discoveryScript (YARN, Kubernetes) or
# spark.worker.resource.gpu.discoveryScript (standalone); see conf/gpu-cluster/spark-defaults.conf.
# The addresses are nvidia-smi's indices, which are CUDA's device numbers when
# CUDA_DEVICE_ORDER=PCI_BUS_ID.
set -euo pipefail

addresses=$(nvidia-smi --query-gpu=index --format=csv,noheader | sed -e 's/[[:space:]]//g' -e '/^$/d' \
    | sed -e 's/.*/"&"/' | paste -sd, -)
echo "{\"name\": \"gpu\", \"addresses\": [${addresses}]}"
