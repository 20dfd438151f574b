#!/usr/bin/env bash
# Source this on a bare GPU machine whose Python already has torch (and cannot reach PyPI):
# installs the wheels carried in .whl/ and this checkout's own wheel (built here, no index) into
# /tmp/site, so the code under test is what the wheel ships.  Usage: source bench/device_env.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
set +e
python3 -c "import torch, graphserving.runtime.graphs.runner as g; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), g.__file__)"
