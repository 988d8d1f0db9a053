#!/usr/bin/env bash
# Builds the Horovod stack (see constraints.txt) into a virtualenv and installs sparkdl into it.
#
#   conf/horovod/install.sh [VENV]        default VENV: .venv-horovod
#
# Horovod 0.28.1 compiles against the installed TensorFlow (about 5 minutes on 2 cores), so its wheel
# is built once and kept in SPARKDL_WHEEL_CACHE (default ~/.cache/sparkdl/wheels), keyed by the
# constraints file: later runs install the cached wheel in seconds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$repo/.venv-horovod}"
constraints="$repo/conf/horovod/constraints.txt"
key="$(sha256sum "$constraints" | cut -c1-12)"
wheels="${SPARKDL_WHEEL_CACHE:-$HOME/.cache/sparkdl/wheels}/horovod-$key"

python3.11 -m venv "$venv"
pip=("$venv/bin/pip" install --disable-pip-version-check -c "$constraints")
"${pip[@]}" --upgrade pip setuptools wheel
# Horovod's build imports TensorFlow, so the stack goes in first and the build sees it (--no-build-isolation).
"${pip[@]}" -e "$repo[horovod-stack,test]" cmake
if ! ls "$wheels"/horovod-*.whl >/dev/null 2>&1; then
  mkdir -p "$wheels"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
  MAKEFLAGS="-j$(nproc)" PATH="$venv/bin:$PATH" \
    "$venv/bin/pip" wheel --disable-pip-version-check --no-build-isolation --no-deps -c "$constraints" \
      -w "$wheels" horovod
fi
"${pip[@]}" "$wheels"/horovod-*.whl  # with its runtime deps (psutil, pyyaml, cloudpickle)
# Fails here, not in the tests, when the build lacks TensorFlow or Gloo support.
"$venv/bin/python" -c "
import horovod, horovod.tensorflow as hvd
assert hvd.gloo_built(), 'Horovod was built without Gloo'
print('horovod', horovod.__version__, 'with Gloo and TensorFlow: ok')"
