#!/usr/bin/env bash
# Source this on a bare GPU machine whose Python already has torch (and cannot reach PyPI):
# installs the wheels carried in .whl/ into /tmp/site and exposes the graphserving package
# from this checkout without building it.  Usage: source bench/device_env.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/gs
ln -sfn "$PWD/src/graphserving" /tmp/gs/graphserving
ln -sfn "$PWD/runtime" src/graphserving/runtime
export PYTHONPATH=/tmp/site:/tmp/gs
export PYTHONUNBUFFERED=1
set +e
python3 -c "import torch, graphserving.runtime.graphs.runner as g; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
